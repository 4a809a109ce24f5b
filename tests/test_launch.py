"""`kiln launch` itself: the environment each rank gets, the gang torn down on Ctrl-C and on a
rank's death, the detectors, the fault specs and bad launch options (issue 16)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.cli import main
from kiln.errors import ConfigError, NotBuiltError
from kiln.launch import BadStepDetector, LaunchConfig
from kiln.launch.faults import FaultPlan, parse
from kiln.launch.incidents import describe_exit
from tests.launch_support import incidents, launch, processes_of, start_launch

STEPS = [sys.executable, str(Path(__file__).parent / "ranks" / "launch_steps.py")]
ABORT = [sys.executable, str(Path(__file__).parent / "ranks" / "launch_abort.py")]


def test_every_rank_gets_torchruns_environment(tmp_path):
    script = ("import json, os, sys; keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', "
              "'MASTER_PORT', 'TORCHELASTIC_RESTART_COUNT', 'TORCHELASTIC_RUN_ID', 'KILN_RUN_DIR']; "
              "open(os.path.join(os.environ['KILN_RUN_DIR'], 'env-' + os.environ['RANK'] + '.json'), 'w')"
              ".write(json.dumps({k: os.environ[k] for k in keys})); print('hello from', os.environ['RANK'])")
    proc = launch(tmp_path / "run", [sys.executable, "-c", script], "--nproc", 3, "--max-restarts", 0)
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads((tmp_path / "run" / f"env-{r}.json").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}
    run_id = json.loads((tmp_path / "run" / "launch.json").read_text())["run_id"]
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {run_id}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    for r in range(3):  # one log per rank, with its output
        assert f"hello from {r}" in (tmp_path / "run" / "logs" / f"rank-{r}.log").read_text()


def test_a_dead_rank_kills_and_restarts_the_whole_gang(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, [*STEPS, 12, 0.05], "--nproc", 2, "--max-restarts", 2, fault="kill@step=5,rank=1")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"], inc["attempt"]) == ("dead_rank", 1, 5, 0)
    assert inc["evidence"] == "exit: killed by SIGKILL" and inc["recovery_s"] > 0
    for r in range(2):  # both ranks ran again in attempt 1 (rank 0 was killed with the gang)
        assert json.loads((run / f"rank-{r}.json").read_text()) == {"step": 12, "attempt": 1}
        assert (run / "logs" / f"rank-{r}.log").read_text().count("=== kiln launch: run") == 2
    assert processes_of(run) == []


def test_a_hung_rank_is_found_from_its_step_time(tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = launch(run, [*STEPS, 10, 0.05], "--nproc", 2, "--hang-timeout-min", 1.5, fault="hang@step=4,rank=0")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"]) == ("hang", 0, 4)
    assert "no heartbeat progress" in inc["evidence"]
    assert time.monotonic() - t0 < 60
    assert processes_of(run) == []


def test_a_peer_left_waiting_for_a_dead_rank_aborts_through_the_store(tmp_path):
    """Rank 1 dies at step 3 while rank 0 waits for it in an exchange (300 s timeout): the supervisor
    tells rank 0 through the store to abort, and it exits by itself at once (no SIGKILL)."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = launch(run, [*ABORT, 6, 0.05], "--nproc", 2, "--max-restarts", 1, "--hang-timeout-min", 300,
                  fault="kill@step=3,rank=1")
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 60
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"]) == ("dead_rank", 1, 3)
    assert inc["teardown"].startswith("rank(s) [0] aborted their communicators through the store ([]) and "
                                      "exited within") and "SIGKILL" not in inc["teardown"], inc["teardown"]
    assert "kiln launch tears attempt 0 down (dead_rank on rank 1 at step 3): aborted 0 communicator(s)" in \
        (run / "logs" / "rank-0.log").read_text()
    for r in range(2):
        assert json.loads((run / f"rank-{r}.json").read_text()) == {"step": 6, "attempt": 1}
    assert processes_of(run) == []


@pytest.mark.cuda
@pytest.mark.slow  # a kiln launch on the GPU: benchmarks/device_check.sh's launch-tests part
@pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")
def test_a_hung_ranks_nccl_communicator_is_aborted_through_the_store(tmp_path):
    """One GPU, world size 1 over NCCL: the rank hangs at step 3; the supervisor's abort through the
    store makes it ncclCommAbort its communicator and exit, and the restarted attempt finishes."""
    run = tmp_path / "run"
    proc = launch(run, [*ABORT, 6, 0.05, "--nccl"], "--nproc", 1, "--max-restarts", 1, "--hang-timeout-min", 2,
                  fault="hang@step=3")
    assert proc.returncode == 0, proc.stderr + (run / "logs" / "rank-0.log").read_text()[-3000:]
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"]) == ("hang", 0, 3)
    assert inc["teardown"].startswith("rank(s) [0] aborted their communicators through the store "
                                      "(['nccl rank 0 of 1'])") and "SIGKILL" not in inc["teardown"], inc["teardown"]
    assert json.loads((run / "rank-0.json").read_text()) == {"step": 6, "attempt": 1}
    assert processes_of(run) == []


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(run, node: int, port: int, *command, fault: str | None = None) -> subprocess.Popen:
    """One node's `kiln launch` of a two-node gang (one rank each) on this machine."""
    return start_launch(run, list(command), "--nnodes", 2, "--node-rank", node, "--master", f"127.0.0.1:{port}",
                        "--nproc", 1, "--max-restarts", 1, "--hang-timeout-min", 300, fault=fault)


@pytest.mark.parametrize("dead", [1, 0], ids=["node-1-fails", "node-0-fails"])
def test_two_nodes_restart_together(tmp_path, dead):
    """Two `kiln launch` supervisors of one gang (node 0 serves the store) and one shared run folder:
    the rank of node `dead` is killed at step 3 while its peer waits for it in an exchange; that
    node writes the incident and sets the abort, the other node's rank aborts through the store,
    and both nodes start attempt 1 together, which finishes."""
    run, port = tmp_path / "run", _free_port()
    nodes = [_node(run, n, port, *ABORT, 6, 0.05, fault=f"kill@step=3,rank={dead}") for n in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], outs
    [inc] = incidents(run)  # written by the failed node only
    assert (inc["class"], inc["rank"], inc["step"], inc["attempt"]) == ("dead_rank", dead, 3, 0)
    assert inc["action"] == "gang killed, restarted from the start (no good checkpoint) (attempt 1)"
    assert inc["recovery_s"] > 0
    other = 1 - dead
    assert f"another node tore attempt 0 down (dead_rank on rank {dead} at step 3)" in outs[other][1]
    assert f"kiln launch tears attempt 0 down (dead_rank on rank {dead} at step 3)" in \
        (run / "logs" / f"rank-{other}.log").read_text()
    run_id = json.loads((run / "launch.json").read_text())["run_id"]
    for r in range(2):
        assert json.loads((run / f"rank-{r}.json").read_text()) == {"step": 6, "attempt": 1}
        assert f"run {run_id} attempt 1 rank {r}" in (run / "logs" / f"rank-{r}.log").read_text()
    assert "finished after 1 restart(s)" in outs[0][1] and "finished after 1 restart(s)" in outs[1][1]
    assert processes_of(run) == []


def test_two_nodes_give_up_together_when_the_budget_is_spent(tmp_path):
    run, port = tmp_path / "run", _free_port()
    fail = [sys.executable, "-c", "import os, sys, time; time.sleep(0.5); "
            "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(300)"]  # rank 1 fails, rank 0 waits
    nodes = [_node(run, n, port, *fail) for n in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [1, 1], outs
    found = incidents(run)
    assert [(i["class"], i["rank"], i["attempt"]) for i in found] == [("dead_rank", 1, 0), ("dead_rank", 1, 1)]
    assert found[1]["action"] == "gave up: the restart budget (1) is spent"
    assert "gave up: the restart budget (1) is spent" in outs[0][1]
    assert processes_of(run) == []


def test_the_restart_budget_ends_the_run(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, [sys.executable, "-c", "import sys; sys.exit(3)"], "--max-restarts", 1)
    assert proc.returncode == 1
    found = incidents(run)
    assert [i["class"] for i in found] == ["dead_rank", "dead_rank"]
    assert "restarted" in found[0]["action"] and "restart budget (1) is spent" in found[1]["action"]
    assert found[1]["evidence"] == "exit: exit status 3"


def test_sigint_leaves_no_process_behind(tmp_path):
    """Ctrl-C: every rank and everything it started is gone, and the launcher exits 130."""
    run = tmp_path / "run"
    rank = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"]
    launcher = start_launch(run, rank, "--nproc", 2)
    deadline = time.monotonic() + 60
    while len(processes_of(run)) < 4 and time.monotonic() < deadline:  # 2 ranks + 2 grandchildren
        time.sleep(0.1)
    started = processes_of(run)
    assert len(started) == 4
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, err
    assert processes_of(run) == []
    assert "SIGINT: stopping the gang" in err


def test_no_orphans_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of the supervisor itself: the ranks die with it (PR_SET_PDEATHSIG)."""
    run = tmp_path / "run"
    launcher = start_launch(run, [sys.executable, "-c", "import time; time.sleep(300)"], "--nproc", 2)
    deadline = time.monotonic() + 60
    while len(processes_of(run)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(processes_of(run)) == 2
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of(run) == []


# ---------------------------------------------------------------------- detectors and specs
def test_detector_flags_nan_and_a_spike_by_its_zscore():
    rng = np.random.default_rng()
    values = 2.0 + 0.05 * rng.standard_normal(30)
    detector = BadStepDetector(z=6.0, window=20, min_history=10, ratio=1.0)
    assert all(detector.check(i + 1, float(v), 1.0 + float(v)) is None for i, v in enumerate(values))
    window = values[-20:]
    spike = float(window.mean() + 7 * window.std(ddof=1))
    bad = detector.check(31, spike, 3.0)
    assert (bad.kind, bad.series, bad.step) == ("spike", "loss", 31)
    assert math.isclose(bad.zscore, 7.0, rel_tol=1e-9)
    # the spike stayed out of the window: a value 5 sigma up is still below the threshold
    assert detector.check(32, float(window.mean() + 5 * window.std(ddof=1)), 3.0) is None
    bad = detector.check(33, 2.0, float("nan"))
    assert (bad.kind, bad.series) == ("nan", "grad_norm")
    assert BadStepDetector(min_history=10).check(1, float("inf"), None).kind == "nan"
    # a smooth series' natural rise is no spike when it is under `ratio` x the mean
    smooth = BadStepDetector(z=6.0, window=20, min_history=10, ratio=2.0)
    assert all(smooth.check(i, 2.0, 1.0 + 1e-3 * i) is None for i in range(1, 15))
    assert smooth.check(15, 2.0, 1.5) is None and smooth.check(16, 2.0, 30.0).kind == "spike"


class _HeartbeatStore:
    """The launch store as a rank's heartbeats use it: the last record under each key."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def set(self, key, value):
        self.records[key] = json.loads(value)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_step_after_an_eval_or_a_checkpoint_gets_the_step_timeout(rank, tmp_path):
    """An "eval" or "checkpoint" heartbeat gets the startup timeout (900 s). Left so until the next step's
    own heartbeat, at its end, a rank stuck (alive) in that step's collective was called hung only after
    900 s: the trainer says "step" again once the eval or checkpoint returns. The supervisor's timeout as
    each step starts: the startup timeout before the first, the step timeout (hang_min_s) after it.
    Rank 1 runs _fit_without_writing: its evals (it saves checkpoints only in sharded runs)."""
    import io

    from kiln.launch.rank import RankAgent
    from kiln.launch.supervisor import Supervisor
    from kiln.train import TrainConfig, Trainer
    t = Trainer(TrainConfig(model_overrides={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
                            batch_size=4, max_steps=6, eval_interval=3, eval_iters=2, checkpoint_interval=2,
                            device="cpu", progress=False, sample_tokens=0, out_dir=str(tmp_path), run_name="beats"))
    store = _HeartbeatStore()
    t.launch = RankAgent(store, rank, 0, tmp_path / "launched")
    t.rank = rank  # rank 1 writes no files: the same steps and evals
    sup = Supervisor(LaunchConfig(command=["true"], run_dir=tmp_path / "launch"), out=io.StringIO())
    key, started, train_step = f"launch/hb/0/{rank}", {}, t.train_step

    def step(*args, **kwargs):
        hb = store.records[key]
        started[t.step + 1] = (hb["step"], hb["phase"], sup._hang_timeout(hb))
        return train_step(*args, **kwargs)

    t.train_step = step
    t.fit()
    c = sup.config
    assert started == {1: (0, "start", c.startup_timeout_s), **{s: (s - 1, "step", c.hang_min_s) for s in range(2, 7)}}
    assert store.records[key]["phase"] == "finish"
    if rank == 0:  # the checkpoints of steps 2 and 4 were saved inside the loop
        assert list((tmp_path / "launched" / "checkpoints").glob("*.kiln"))


def test_fault_specs_parse_and_fire_once_on_their_rank_and_attempt():
    [a, b] = parse("kill@step=7,rank=1; spike@step=3,scale=100,attempt=1")
    assert (a.kind, a.step, a.rank, a.attempt) == ("kill", 7, 1, 0)
    assert (b.kind, b.step, b.attempt, b.options) == ("spike", 3, 1, {"scale": "100"})
    plan = FaultPlan([b], rank=0, attempt=1)
    assert plan.loss_scale(2) is None and plan.loss_scale(3) == 100.0 and plan.loss_scale(3) is None
    assert FaultPlan.from_env(0, 1, {"KILN_FAULT": "kill@step=7,rank=1"}) is None
    # only a NaN or spike changes its step's computation: that step alone runs outside the CUDA graph
    plan = FaultPlan(parse("kill@step=2;nan@step=4;spike@step=6"), rank=0, attempt=0)
    assert [s for s in range(1, 8) if plan.acts_inside_step(s)] == [4, 6]
    nan = plan.loss_scale(4)
    assert nan != nan  # NaN times the loss: it spreads through backward and the reductions
    plan.loss_scale(6)
    assert not plan.acts_inside_step(6)  # fired: the step is over
    for bad in ("explode@step=1", "kill@rank=1", "kill@step=x", "kill@step"):
        with pytest.raises(ConfigError):
            parse(bad)


def test_exit_descriptions():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(137) == "killed by SIGKILL"
    assert describe_exit(1) == "exit status 1"


def test_bad_launch_options_are_errors(tmp_path, capsys):
    for args in (["--nproc", "0"], ["--nnodes", "2", "--node-rank", "0"], ["--on-bad-step", "ignore"],
                 ["--node-rank", "3"], ["--master", "nohost"]):
        assert main(["launch", "--run-dir", str(tmp_path / "r"), *args, "--", "true"]) == 2
        assert capsys.readouterr().err.startswith("kiln: error:")
    assert main(["launch", "--run-dir", str(tmp_path / "r")]) == 2
    assert "needs a command" in capsys.readouterr().err
    with pytest.raises(NotBuiltError, match="several nodes"):
        LaunchConfig(["true"], tmp_path, nnodes=2, master="h:1", mpi=True).validate()
    assert os.environ.get("KILN_LAUNCH_STORE") is None


def test_ranks_rendezvous_through_the_launchers_store(tmp_path):
    """One store per job: under kiln launch no rank serves another (TORCHELASTIC_USE_AGENT_STORE),
    and the ranks' exchange (the NCCL id's path without MPI) goes through the launcher's."""
    run = tmp_path / "run"
    proc = launch(run, [sys.executable, str(Path(__file__).parent / "ranks" / "launch_store.py")], "--nproc", 3)
    assert proc.returncode == 0, proc.stderr
    for r in range(3):
        got = json.loads((run / f"store-{r}.json").read_text())
        assert got == {"agent_store": True, "serves": False, "launcher": "torchrun", "ranks": [0, 1, 2]}
