"""`kiln launch --mpi`: data-parallel CPU ranks over the MPI backend (kiln DDP), supervised and
recovered: a rank killed at step k, and a stalled rank whose peers' all-reduce times out. Each
run ends with the parameters of the unfaulted run, bit for bit (issue 16)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch_support import incidents, launch, processes_of
from tests.mpi_runner import mpiexec

pytestmark = pytest.mark.dist
DDP = [sys.executable, str(Path(__file__).parent / "ranks" / "launch_ddp.py"), 12, 4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    mpiexec()  # skips without one
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = launch(run, DDP, "--mpi", "--nproc", 2)
    assert proc.returncode == 0, proc.stderr
    assert incidents(run) == []
    return dict(np.load(run / "final.npz"))


def _assert_recovered(run, reference):
    got = np.load(run / "final.npz")
    assert sorted(got) == sorted(reference)
    for name in reference:
        assert np.array_equal(got[name], reference[name]), name
    assert processes_of(run) == []


def test_a_killed_mpi_rank_is_named_and_the_gang_restarts(reference, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, DDP, "--mpi", "--nproc", 2, fault="kill@step=6,rank=1")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["rank"], inc["step"], inc["resumed_from_step"]) == ("dead_rank", 1, 6, 4)
    assert "bad termination of pid" in inc["evidence"]  # mpiexec's report, matched to the rank's pid
    _assert_recovered(run, reference)


def test_a_stalled_collective_times_out_and_the_gang_restarts(reference, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, DDP, "--mpi", "--nproc", 2, "--hang-timeout-min", 60, fault="hang@step=6,rank=1",
                  env={"KILN_DIST_TIMEOUT": "3"})
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["step"], inc["resumed_from_step"]) == ("collective_failure", 7, 4)
    assert "did not complete within 3 s" in inc["evidence"]
    assert "rank(s) [1] did not report the failed collective" in inc["evidence"]
    assert inc["detect_s"] < 30  # the collective's timeout, not the hang timeout (60 s)
    _assert_recovered(run, reference)
