"""`kiln launch --mpi -- kiln train --parallel ddp`: the Trainer's data parallelism over 2 MPI
ranks on the CPU, supervised and recovered: a rank killed at step k, and a stalled rank whose
peer's all-reduce times out. Each run ends with the unfaulted run's parameters, bit for bit, and
no process left behind (issue 16)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.launch_support import incidents, launch, processes_of
from tests.mpi_runner import mpiexec

pytestmark = pytest.mark.dist
MODEL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}
TRAIN = ["kiln", "train", "--parallel", "ddp", *[a for k, v in MODEL.items() for a in ("--set", f"{k}={v}")],
         "--batch-size", 4, "--steps", 12, "--eval-interval", 12, "--device", "cpu", "--no-progress",
         "--checkpoint-interval", 4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    mpiexec()  # skips without one
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = launch(run, TRAIN, "--mpi", "--nproc", 2)
    assert proc.returncode == 0, proc.stderr
    assert incidents(run) == []
    return load_file(str(run / "model.safetensors"))


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
    assert "bad termination of pid" in inc["evidence"]  # mpiexec's report, matched to the rank's pid
    log = (run / "logs" / "rank-1.log").read_text()
    assert log.count("=== kiln launch: run") == 2 and "attempt 1: resuming" in log
    _assert_recovered(run, reference)


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
