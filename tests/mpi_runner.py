"""Run a script of tests/ranks/ as N real MPI ranks (`mpiexec -n N`, or N processes given torchrun's
variables and no PMI) and collect every rank's result.

Each rank writes its result as JSON to $KILN_RANK_OUT/rank<r>.json (tests/ranks/rank_output.py);
`run_ranks` fails unless the ranks exit with the expected status and, for a success, every rank
wrote its result. A hard timeout on the subprocesses makes a hang a failure, never a stuck suite.
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
              expect_ok: bool = True, launcher: str = "mpiexec"):
    """(results of ranks 0..n-1 (None for a rank that wrote none), completed process, seconds).
    launcher "torchrun": n processes with RANK, WORLD_SIZE, ... MASTER_PORT and no mpiexec (as
    torchrun starts them); the completed process holds every rank's output, each line prefixed
    with its rank, and the status of the first rank that failed (else 0)."""
    out = tmp_path / f"{Path(script).stem}-{n}"
    out.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "KILN_RANK_OUT": str(out), **(env or {})}
    cmd = [sys.executable, str(RANKS / script), *map(str, args)]
    t0 = time.monotonic()
    if launcher == "torchrun":
        proc = _run_torchrun_style(cmd, n, full_env, timeout)
    else:
        cmd = [mpiexec(), "-n", str(n), *cmd]
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
        assert proc.returncode == 0, f"{launcher} ranks exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        missing = [r for r, res in enumerate(results) if res is None]
        assert not missing, f"ranks {missing} wrote no result\n{proc.stdout}\n{proc.stderr}"
    return results, proc, seconds


def _run_torchrun_style(cmd: list, n: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    import socket
    with socket.socket() as s:  # a free port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mpi = ("PMI_", "MPI_", "OMPI_", "PMIX_", "HYDRA_", "SLURM_")  # nothing of an MPI launcher
    clean = {k: v for k, v in env.items() if not k.startswith(mpi)}
    procs = [subprocess.Popen(cmd, env={**clean, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                                        "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    deadline = time.monotonic() + timeout
    done = []
    for r, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            seen = []  # what every rank said before it was killed (a pipe a lingering child holds is left unread)
            for i, q in enumerate(procs):
                try:
                    seen.append(f"[{i}] " + (q.communicate(timeout=5)[1] or "").replace("\n", f"\n[{i}] "))
                except subprocess.TimeoutExpired:
                    seen.append(f"[{i}] (its stderr still held open)")
            pytest.fail(f"{' '.join(cmd)} as {n} torchrun-style ranks hung: rank {r} still running after {timeout} s\n"
                        + "\n".join(seen))
        done.append((p.returncode, stdout, stderr))

    def joined(i):
        return "".join(f"[{r}] {line}\n" for r, d in enumerate(done) for line in d[i].splitlines())
    return subprocess.CompletedProcess(cmd, next((c for c, _, _ in done if c != 0), 0), joined(1), joined(2))
