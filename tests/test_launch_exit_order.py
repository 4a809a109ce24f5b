"""kiln.launch.exit_order: which of a gang's processes ended first, however close together they
end, whether the pid is known (the supervisor's children) or comes in a file (mpiexec's ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kiln.launch.exit_order import ExitOrder, process_status

pytestmark = pytest.mark.skipif(not ExitOrder.available, reason="needs os.pidfd_open (Linux 5.3)")


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_rank_that_dies_first_is_first_even_when_the_next_dies_milliseconds_later(tmp_path):
    procs = [_sleeper() for _ in range(3)]
    files = {rank: tmp_path / f"rank-{rank}.pid" for rank in (1, 2)}
    order = ExitOrder({0: procs[0].pid, **files})  # rank 0's pid known, the others' written when they start
    try:
        for rank in (1, 2):
            files[rank].write_text(f"{procs[rank].pid}\n")
        time.sleep(0.05)  # the watcher has opened every pidfd
        assert order.ended() == {}
        procs[2].kill()
        time.sleep(0.02)  # mpiexec's proxy killed the next rank 8 ms after the first died (20: a loaded CI)
        procs[0].kill()
        _wait_for(lambda: len(order.ended()) == 2)
        assert list(order.ended()) == [2, 0]  # first to end first; rank 1 still runs
    finally:
        order.stop()
        for p in procs:
            p.kill()
            p.wait()


def test_a_zombie_shows_its_status_and_a_reaped_process_none():
    p = _sleeper()
    assert process_status(p.pid) == (True, None)
    os.kill(p.pid, signal.SIGKILL)
    _wait_for(lambda: not process_status(p.pid)[0])
    assert process_status(p.pid) == (False, -signal.SIGKILL)  # not reaped yet: a zombie
    p.wait()
    assert process_status(p.pid) == (False, None)
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    _wait_for(lambda: not process_status(done.pid)[0])
    assert process_status(done.pid) == (False, 3)
    done.wait()


def test_a_rank_gone_before_the_watcher_saw_its_pid_counts_as_ended(tmp_path):
    p = _sleeper()
    p.kill()
    p.wait()
    (tmp_path / "rank-0.pid").write_text(str(p.pid))
    order = ExitOrder({0: tmp_path / "rank-0.pid", 1: tmp_path / "rank-1.pid"})  # rank 1 never starts
    try:
        _wait_for(lambda: [(r, st) for r, (st, _) in order.ended().items()] == [(0, None)])
    finally:
        order.stop()
