"""`kiln launch --mpi -- kiln train --parallel ddp`: the Trainer's data parallelism over 2 MPI
ranks on the CPU, supervised and recovered: a rank killed at step k (under mpiexec, and with the
ranks started by kiln launch itself, MPI through kiln's PMI servers), a stalled rank whose peer's
all-reduce times out, and (ZeRO-1, one checkpoint file per rank) a corrupt or missing shard. Each
run ends with the unfaulted run's parameters, bit for bit, and no process left behind (issue 16)."""

from __future__ import annotations

import shutil
import signal
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from kiln.checkpoint import CheckpointFolder
from kiln.launch.supervisor import newest_good_checkpoint
from tests.launch_support import incidents, launch, processes_of, start_launch
from tests.mpi_runner import mpiexec

pytestmark = pytest.mark.dist
MODEL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}
TRAIN = ["kiln", "train", "--parallel", "ddp", *[a for k, v in MODEL.items() for a in ("--set", f"{k}={v}")],
         "--batch-size", 4, "--steps", 12, "--eval-interval", 12, "--device", "cpu", "--no-progress",
         "--checkpoint-interval", 4, "--sync-checkpoint"]
# Synchronous checkpoints: the checkpoint of step 4 is durable before step 5, so a fault at step 6 resumes
# from step 4. Async, rank 0's background write of step 4 was still in flight on a loaded 2-core CI when
# rank 1 died at step 6 and mpiexec killed rank 0 (rightly no checkpoint then: the gang resumed from 0)
ZERO1 = [a if a != "ddp" else "zero1" for a in TRAIN]  # sharded checkpoints: a manifest and a file per rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    mpiexec()  # skips without one
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = launch(run, TRAIN, "--mpi", "--nproc", 2)
    assert proc.returncode == 0, proc.stderr
    assert incidents(run) == []
    return load_file(str(run / "model.safetensors"))


def test_a_hung_ddp_gang_is_aborted_through_the_store(reference, tmp_path):
    """Rank 1 stalls at step 6 and rank 0 waits in its all-reduce (a 300 s collective timeout): the
    supervisor finds the hang from the step time, and both ranks, told through the store, abort and
    exit by themselves (MPI's communicators end with the process; no SIGKILL needed)."""
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--mpi", "--nproc", 2, "--hang-timeout-min", 3, fault="hang@step=6,rank=1",
                  env={"KILN_DIST_TIMEOUT": "300"})
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["step"], inc["resumed_from_step"]) == ("hang", 6, 4)
    assert inc["teardown"].startswith("rank(s) [") and "mpi rank" in inc["teardown"], inc["teardown"]
    assert "SIGKILL" not in inc["teardown"]
    assert any("kiln launch tears attempt 0 down (hang on rank" in (run / "logs" / f"rank-{r}.log").read_text()
               for r in range(2))
    _assert_recovered(run, reference)


@pytest.fixture(scope="module")
def zero1_reference(tmp_path_factory):
    mpiexec()
    run = tmp_path_factory.mktemp("zero1") / "run"
    proc = launch(run, ZERO1, "--mpi", "--nproc", 2)
    assert proc.returncode == 0, proc.stderr
    assert incidents(run) == []
    return run


def _assert_recovered(run, reference):
    got = load_file(str(run / "model.safetensors"))
    assert sorted(got) == sorted(reference)
    for name in reference:
        assert np.array_equal(got[name], reference[name]), name
    assert processes_of(run) == []


def test_a_killed_ddp_rank_is_named_and_the_gang_restarts(reference, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--mpi", "--nproc", 2, fault="kill@step=6,rank=1")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"], inc["resumed_from_step"]) == ("dead_rank", 1, 6, 4)
    # the status rank 1's shell wrote (exit_markers.ExitMarkers); mpiexec's own report names the first bad
    # exit in rank order, which on a loaded machine was rank 0, killed by mpiexec 8 ms after rank 1 died
    assert inc["evidence"] == "exit: killed by SIGKILL", inc["evidence"]
    log = (run / "logs" / "rank-1.log").read_text()
    assert log.count("=== kiln launch: run") == 2 and "attempt 1: resuming" in log
    _assert_recovered(run, reference)


def test_a_killed_ddp_rank_without_mpiexec_is_named_and_its_peer_aborted_through_the_store(reference, tmp_path):
    """`kiln launch --nproc 2` starting the CPU ranks itself (MPI through kiln's PMI servers): rank 1 killed at
    step 6 is the rank named, and rank 0 is not killed by its PMI server (which would end it within one of
    the supervisor's polls) but aborted by the supervisor through the store."""
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--nproc", 2, fault="kill@step=6,rank=1")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"], inc["resumed_from_step"]) == ("dead_rank", 1, 6, 4)
    assert inc["evidence"] == "exit: killed by SIGKILL"
    assert inc["teardown"].startswith("rank(s) [0] aborted their communicators through the store"), inc["teardown"]
    _assert_recovered(run, reference)


def test_sigterm_stops_an_mpi_gang_that_saves_first(tmp_path):
    """SIGTERM to `kiln launch --mpi`: each rank's shell (which writes its command's exit status for the
    supervisor) waits out the TERM its command gets in the same process group, so kiln train saves and
    exits; the launcher returns 128 + SIGTERM."""
    run = tmp_path / "run"
    train = [*TRAIN[:TRAIN.index("--steps") + 1], 100000, *TRAIN[TRAIN.index("--steps") + 2:]]
    proc = start_launch(run, train, "--mpi", "--nproc", 2, "--spike-z", 1000)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):  # a few steps trained
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "no steps"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    log = (run / "logs" / "rank-0.log").read_text()
    assert "stopped by SIGTERM after step" in log and "saved" in log, log[-2000:]
    assert CheckpointFolder(run / "checkpoints").checkpoints(), "nothing saved"
    assert {p.name: p.read_text().strip() for p in (run / "logs").glob("rank-*.exit")} == {
        "rank-0.exit": "143", "rank-1.exit": "143"}  # the shells outlived the TERM and wrote the command's status
    assert processes_of(run) == []


def test_a_stalled_collective_times_out_and_the_gang_restarts(reference, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--mpi", "--nproc", 2, "--hang-timeout-min", 60, fault="hang@step=6,rank=1",
                  env={"KILN_DIST_TIMEOUT": "3"})
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"], inc["resumed_from_step"]) == ("collective_failure", 0, 7, 4)
    assert "did not complete within 3 s" in inc["evidence"]
    assert "rank(s) [1] did not report the failed collective" in inc["evidence"]
    assert inc["detect_s"] < 30  # the collective's timeout, not the hang timeout (60 s)
    _assert_recovered(run, reference)


def test_a_corrupt_shard_rolls_back_to_the_previous_sharded_checkpoint(zero1_reference, tmp_path):
    """Rank 1 damages its own shard of the step-8 checkpoint once it is durable, then dies: the
    manifest still verifies, the shard does not, so the gang resumes from step 4."""
    run = tmp_path / "run"
    proc = launch(run, ZERO1, "--mpi", "--nproc", 2, fault="corrupt@step=8,rank=1")
    assert proc.returncode == 0, proc.stderr
    found = {i["class"]: i for i in incidents(run)}
    assert sorted(found) == ["checkpoint_corrupt", "dead_rank"], found
    dead, bad = found["dead_rank"], found["checkpoint_corrupt"]
    assert (dead["rank"], dead["step"], dead["resumed_from_step"]) == (1, 8, 4)
    assert "ckpt-00000008.shard-00001-of-00002.kiln" in bad["evidence"] and "checksum" in bad["evidence"]
    folder = run / "checkpoints"
    for name in ("ckpt-00000008.kiln", "ckpt-00000008.shard-00000-of-00002.kiln",
                 "ckpt-00000008.shard-00001-of-00002.kiln"):  # set aside together, the manifest with its shards
        assert (folder / f"{name}.corrupt").is_file(), name
    assert "resuming" in (run / "logs" / "rank-0.log").read_text() and "at step 4" in \
        (run / "logs" / "rank-0.log").read_text()
    _assert_recovered(run, load_file(str(zero1_reference / "model.safetensors")))


def test_a_missing_shard_makes_the_previous_sharded_checkpoint_the_newest_good_one(zero1_reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(zero1_reference / "checkpoints", run / "checkpoints")
    folder = run / "checkpoints"
    assert [s for s, _ in CheckpointFolder(folder).checkpoints()] == [4, 8, 12]
    (folder / "ckpt-00000012.shard-00000-of-00002.kiln").unlink()
    step, [inc] = newest_good_checkpoint(run, "r", 3)
    assert step == 8
    assert (inc.cls, inc.attempt, inc.rank) == ("checkpoint_incomplete", 3, None)
    assert "ckpt-00000012.shard-00000-of-00002.kiln" in inc.evidence and "is missing" in inc.evidence
    assert sorted(p.name for p in folder.glob("ckpt-00000012*")) == [
        "ckpt-00000012.kiln.corrupt", "ckpt-00000012.shard-00001-of-00002.kiln.corrupt"]
    # what the ranks then resume from (CheckpointFolder.load_latest) is the same checkpoint
    state, path = CheckpointFolder(folder).load_latest(report=lambda msg: None)
    assert (path.name, state["state"]["step"]) == ("ckpt-00000008.kiln", 8)
    assert newest_good_checkpoint(run, "r", 4) == (8, [])  # set aside once, not reported again


@pytest.fixture(scope="module")
def ddp_skipping(tmp_path_factory):
    mpiexec()
    run = tmp_path_factory.mktemp("ddp-skip") / "run"
    proc = launch(run, TRAIN, "--mpi", "--nproc", 2, "--on-bad-step", "skip", fault="nan@step=6")
    assert proc.returncode == 0, proc.stderr
    return load_file(str(run / "model.safetensors"))


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_a_sharded_run_skips_a_bad_step_as_ddp_does(ddp_skipping, tmp_path, strategy):
    """`--on-bad-step skip` undoes the step in place: under ZeRO/FSDP that is each rank's shards and
    moments (the sharded optimizer's own update_state), then ZeRO's all-gather. The run ends where
    DDP's skipping run does (ZeRO/FSDP equal DDP on MPI; the clip's norm to float32 rounding)."""
    run = tmp_path / "run"
    proc = launch(run, [a if a != "ddp" else strategy for a in TRAIN], "--mpi", "--nproc", 2,
                  "--on-bad-step", "skip", fault="nan@step=6")
    assert proc.returncode == 0, proc.stderr
    found = incidents(run)  # each rank reports its skip
    assert sorted(i["rank"] for i in found) == [0, 1]
    assert all((i["class"], i["step"]) == ("bad_step_nan", 6) and i["action"].startswith("skipped in place")
               for i in found)
    got = load_file(str(run / "model.safetensors"))
    assert sorted(got) == sorted(ddp_skipping)
    for name, want in ddp_skipping.items():
        assert np.allclose(got[name], want, rtol=0, atol=1e-6), name
    assert processes_of(run) == []
