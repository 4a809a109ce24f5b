"""Running `kiln launch` in tests: the command, its run folder, and the processes it left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _launch_args(run_dir: Path, command: list[str], options, fault: str | None, env: dict | None):
    """The command line and environment of `kiln launch --run-dir run_dir *options -- command`."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("KILN_FAULT", None)
    if fault:
        full_env["KILN_FAULT"] = fault
    cmd = [sys.executable, "-m", "kiln.cli", "launch", "--run-dir", str(run_dir), *map(str, options), "--", *map(str, command)]
    return cmd, full_env


def launch(run_dir: Path, command: list[str], *options, fault: str | None = None, timeout: float = 120,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """`kiln launch --run-dir run_dir *options -- command` to completion (a hang fails the test)."""
    cmd, full_env = _launch_args(run_dir, command, options, fault, env)
    try:
        return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"kiln launch hung: {e.stdout}\n{e.stderr}")


def start_launch(run_dir: Path, command: list[str], *options, fault: str | None = None,
                 env: dict | None = None) -> subprocess.Popen:
    """The same started, not waited for (a test that signals it)."""
    cmd, full_env = _launch_args(run_dir, command, options, fault, env)
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def incidents(run_dir: Path) -> list[dict]:
    path = run_dir / "incidents.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def processes_of(run_dir: Path) -> list[int]:
    """Pids of live processes started for this run (KILN_RUN_DIR=run_dir in their environment)."""
    mark = f"KILN_RUN_DIR={run_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found
