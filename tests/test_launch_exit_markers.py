"""kiln.launch.exit_markers: which of mpiexec's ranks ended first, from the exit statuses their shells
write before mpiexec can react; and the supervisor's classification of a failed gang that uses them."""

from __future__ import annotations

import io
import json
import subprocess
import time

from kiln.launch.exit_markers import ExitMarkers
from kiln.launch.supervisor import LaunchConfig, Supervisor


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

    def keys(self, prefix):
        return [k for k in self.records if k.startswith(prefix)]


class _Markers:
    def __init__(self, ended):
        self._ended = ended

    def ended(self):
        return dict(self._ended)


def _classify(tmp_path, failed, ended=None, reports=None):
    sup = Supervisor(LaunchConfig(command=["true"], run_dir=tmp_path, nproc=3), out=io.StringIO())
    sup.store = _Store({f"launch/error/0/{r}": rec for r, rec in (reports or {}).items()})
    if ended is not None:  # under mpiexec
        sup._exit_markers = _Markers(ended)
    beats = {r: {"step": 6, "time": time.time(), "phase": "step"} for r in range(3)}
    return sup._exit_incident(failed, beats)


def test_under_mpiexec_the_dead_rank_is_the_first_whose_shell_wrote_not_the_lowest(tmp_path):
    """The supervisor sees only mpiexec's exit; the ranks' shells wrote theirs (128 + SIGKILL first, then a
    rank that ended by hydra's SIGUSR1 while its shell lived); a rank that exited 0 is not dead."""
    t = time.time()
    inc = _classify(tmp_path, {"mpiexec": 137}, {2: (137, t), 0: (138, t + 0.004), 1: (0, t + 0.005)})
    assert (inc.cls, inc.rank) == ("dead_rank", 2)
    assert inc.evidence == "exit: killed by SIGKILL, the first to end (then rank(s) [0])"
    (tmp_path / "none").mkdir()  # no shell wrote (all killed together): mpiexec's status
    inc = _classify(tmp_path / "none", {"mpiexec": 9}, {})
    assert (inc.cls, inc.rank, inc.evidence) == ("dead_rank", None, "exit: mpiexec exit status 9")


def test_ranks_that_ended_after_a_report_are_its_consequence(tmp_path):
    """Rank 0's collective timed out: it reported, then its MPI_Abort ended the others. The cause is rank 0's
    collective failure (rank 2 stalled), not rank 2's end; a rank that reported its own failure and was still
    running when another rank's exit ended the gang is named with what it reported."""
    t = time.time()
    report = {"class": "collective_failure", "step": 7, "evidence": "did not complete within 3 s", "time": t}
    inc = _classify(tmp_path, {"mpiexec": 1}, {2: (137, t + 0.01)}, {0: report})
    assert (inc.cls, inc.rank, inc.step) == ("collective_failure", 0, 7)
    assert "rank(s) [1, 2] did not report the failed collective" in inc.evidence
    (tmp_path / "own").mkdir()
    oom = {"class": "host_oom", "step": 5, "evidence": "MemoryError", "time": t}
    inc = _classify(tmp_path / "own", {1: -9}, reports={2: oom})
    assert (inc.cls, inc.rank) == ("host_oom", 2)
    assert inc.evidence == "MemoryError (still running when the gang failed)"


def test_a_rank_dead_under_a_running_mpiexec_is_found_from_its_shells_status(tmp_path):
    """hydra's proxy may reap a dead rank's shell (exit status 137: the shell outlives its killed command)
    before it handles the close of the rank's PMI socket, and then kills none of the others: they wait in a
    collective for the dead rank and mpiexec never ends (CI, 2026-12-07: test_a_corrupt_shard_... hung, rank 0
    in its "checkpoint" phase, whose hang timeout is the startup timeout). The supervisor names the rank from
    the status its shell wrote, at once, without waiting for mpiexec."""
    config = LaunchConfig(command=["true"], run_dir=tmp_path, nproc=2, mpi=True, startup_timeout_s=5)
    sup = Supervisor(config, out=io.StringIO())
    now = time.time()
    sup.store = _Store({f"launch/hb/0/{r}": {"step": 8, "time": now, "phase": "checkpoint", "step_s": 0.1}
                        for r in range(2)})
    paths = {r: tmp_path / f"rank-{r}.exit" for r in range(2)}
    sup._exit_markers = ExitMarkers(paths)
    mpiexec = subprocess.Popen(["sleep", "60"])  # an mpiexec whose proxy killed nobody: it does not end
    sup._procs = {"mpiexec": mpiexec}
    try:
        paths[1].write_text("137\n")  # rank 1's shell, after its command was SIGKILLed
        t0 = time.monotonic()
        inc = sup._watch(time.time(), None, [])
        assert time.monotonic() - t0 < 2  # not the startup timeout's "hang" (5 s here, 900 s by default)
        assert (inc.cls, inc.rank, inc.step, inc.evidence) == ("dead_rank", 1, 8, "exit: killed by SIGKILL")
        assert mpiexec.poll() is None
        paths[0].write_text("0\n")  # a rank that finished is no failure
        paths[1].unlink()
        sup.store.records["launch/hb/0/0"] = json.dumps({"step": 12, "time": now, "phase": "finish"}).encode()
        assert sup._dead_under_mpiexec({0: {"phase": "finish"}, 1: {"phase": "step"}}) == {}
    finally:
        mpiexec.kill()
        mpiexec.wait()
