"""kiln.launch.exit_order: which of a gang's processes ended first, however close together they end:
the supervisor's children by pidfds, mpiexec's ranks by the exit statuses their shells write; and the
supervisor's classification that uses the order."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kiln.launch.exit_order import ExitMarkers, ExitOrder, process_status
from kiln.launch.supervisor import LaunchConfig, Supervisor

pytestmark = pytest.mark.skipif(not ExitOrder.available, reason="needs os.pidfd_open (Linux 5.3)")


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_rank_that_dies_first_is_first_even_when_the_next_dies_milliseconds_later():
    procs = [_sleeper() for _ in range(3)]
    order = ExitOrder({rank: p.pid for rank, p in enumerate(procs)})
    try:
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


def test_a_rank_gone_before_the_watcher_started_counts_as_ended():
    gone, alive = _sleeper(), _sleeper()
    gone.kill()
    gone.wait()
    order = ExitOrder({0: gone.pid, 1: alive.pid})
    try:
        _wait_for(lambda: [(r, st) for r, (st, _) in order.ended().items()] == [(0, None)])
    finally:
        order.stop()
        alive.kill()
        alive.wait()


def test_mpiexec_ranks_end_in_the_order_their_shells_wrote_their_statuses(tmp_path):
    """The launcher's rank shell (kiln launch --mpi) writes the command's status when it ends, before the
    shell exits: the dead rank's before mpiexec's proxy can kill the others (whose shells write nothing)."""
    paths = {rank: tmp_path / f"rank-{rank}.exit" for rank in range(3)}
    markers = ExitMarkers(paths)
    assert markers.ended() == {}
    for rank, status in ((2, 137), (0, 1)):  # the way supervisor._spawn_mpi's shell writes it
        subprocess.run(["sh", "-c", f'sh -c "exit {status}"; s=$?; echo $s > "$0"', str(paths[rank])], check=True)
        time.sleep(0.02)  # file times have a clock tick's resolution: a few ms
    ended = markers.ended()
    assert list(ended) == [2, 0] and [st for st, _ in ended.values()] == [137, 1]
    paths[1].write_text("")  # a shell killed while writing: not counted
    assert list(markers.ended()) == [2, 0]


class _Store:
    """The launch store's reads the classification makes: each rank's failure report."""

    def __init__(self, records: dict[str, dict]):
        self.records = {k: json.dumps(v).encode() for k, v in records.items()}

    def try_get(self, key):
        return self.records.get(key)


class _Order:
    def __init__(self, ended):
        self._ended = ended

    def ended(self):
        return dict(self._ended)


def _classify(tmp_path, failed, ended, reports=None):
    sup = Supervisor(LaunchConfig(command=["true"], run_dir=tmp_path, nproc=3), out=io.StringIO())
    sup.store = _Store({f"launch/error/0/{r}": rec for r, rec in (reports or {}).items()})
    sup._exit_order = _Order(ended)
    beats = {r: {"step": 6, "time": time.time(), "phase": "step"} for r in range(3)}
    return sup._exit_incident(failed, beats)


def test_the_dead_rank_is_the_first_to_end_not_the_lowest(tmp_path):
    """kiln's PMI servers kill a dead rank's peers within 0.2 s: the supervisor's poll can find them all
    gone, in rank order; the exit order names the one that died."""
    t = time.time()
    inc = _classify(tmp_path, {0: -9, 2: -9}, {2: (None, t), 0: (None, t + 0.1)})
    assert (inc.cls, inc.rank) == ("dead_rank", 2)
    assert inc.evidence == "exit: killed by SIGKILL, the first to end (then rank(s) [0])"
    # under mpiexec the supervisor sees only mpiexec's exit; the ranks' shells wrote theirs (128 + SIGKILL)
    (tmp_path / "mpi").mkdir()
    inc = _classify(tmp_path / "mpi", {"mpiexec": 137}, {1: (137, t)})
    assert (inc.cls, inc.rank, inc.evidence) == ("dead_rank", 1, "exit: killed by SIGKILL")


def test_ranks_that_ended_after_a_report_are_its_consequence(tmp_path):
    """Rank 0's collective timed out: it reported, then its MPI_Abort ended every rank, rank 2 first. The
    cause is rank 0's collective failure (rank 2 stalled), not rank 2's death; a rank that reported its own
    failure and was still running is named with what it reported."""
    t = time.time()
    report = {"class": "collective_failure", "step": 7, "evidence": "did not complete within 3 s", "time": t}
    inc = _classify(tmp_path, {"mpiexec": 1}, {2: (-9, t + 0.01), 0: (-9, t + 0.02)}, {0: report})
    assert (inc.cls, inc.rank, inc.step) == ("collective_failure", 0, 7)
    assert "rank(s) [1, 2] did not report the failed collective" in inc.evidence
    (tmp_path / "own").mkdir()
    oom = {"class": "host_oom", "step": 5, "evidence": "MemoryError", "time": t}
    inc = _classify(tmp_path / "own", {1: -9}, {1: (None, t + 0.01)}, {2: oom})
    assert (inc.cls, inc.rank) == ("host_oom", 2)
    assert inc.evidence == "MemoryError (still running when the gang failed)"
