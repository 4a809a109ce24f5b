"""The result file every benchmark writes: where its figures come from (the commit they were measured at,
the GPU they ran on) and the writing itself. Benchmarks run as scripts from this folder and import it by
name."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> str:
    """A command's output, "" when it is missing or fails."""
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def commit() -> str:
    """KILN_COMMIT when set (a device run: the machine gets a copy of the working tree, whose git HEAD
    need not be the commit measured), else this checkout's HEAD."""
    return os.environ.get("KILN_COMMIT") or _run("git", "rev-parse", "HEAD")


def src_dirty() -> bool:
    """Whether tracked files under src/ differ from HEAD: the figures are then of uncommitted code."""
    return bool(_run("git", "status", "--porcelain", "--untracked-files=no", "--", "src"))


def gpu_name() -> str:
    """'name, driver version' of the first GPU as nvidia-smi reports it ("" without one)."""
    lines = _run("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader").splitlines()
    return lines[0] if lines else ""


def run_fields(device: str) -> dict:
    """The date, the machine (the GPU on cuda, else the processor), Python, the command and the commit."""
    return {"date": time.strftime("%Y-%m-%d"), "gpu": (gpu_name() if device == "cuda" else "") or platform.processor(),
            "python": platform.python_version(), "command": " ".join(["python", *sys.argv]), "commit": commit()}


def write_json(record: dict, path: Path) -> Path:
    """record as indented JSON at path (its folders made); says where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return path
