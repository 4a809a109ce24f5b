"""Run a script of tests/ranks/ as N real MPI ranks (`mpiexec -n N`) and collect every rank's result.

Each rank writes its result as JSON to $KILN_RANK_OUT/rank<r>.json (tests/ranks/rank_output.py);
`run_ranks` fails unless mpiexec exits with the expected status and, for a success, every rank
wrote its result. A hard timeout on the subprocess makes a hang a failure, never a stuck suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANKS = Path(__file__).parent / "ranks"


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec: pip install 'kiln[dist]' (mpi4py, mpich)")
    return found


def run_ranks(script: str, n: int, tmp_path, *args, timeout: float = 60, env: dict | None = None,
              expect_ok: bool = True):
    """(results of ranks 0..n-1 (None for a rank that wrote none), completed process, seconds)."""
    out = tmp_path / f"{Path(script).stem}-{n}"
    out.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "KILN_RANK_OUT": str(out), **(env or {})}
    cmd = [mpiexec(), "-n", str(n), sys.executable, str(RANKS / script), *map(str, args)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung: still running after {timeout} s\n{e.stdout}\n{e.stderr}")
    seconds = time.monotonic() - t0
    results = []
    for r in range(n):
        f = out / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.is_file() else None)
    if expect_ok:
        assert proc.returncode == 0, f"mpiexec exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        missing = [r for r, res in enumerate(results) if res is None]
        assert not missing, f"ranks {missing} wrote no result\n{proc.stdout}\n{proc.stderr}"
    return results, proc, seconds
