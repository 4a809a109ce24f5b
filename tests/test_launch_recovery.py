"""Recovery under `kiln launch`, one test per fault class (issue 16): every faulted run completes,
its final parameters equal an unfaulted run's bit for bit (CPU float32; a skipped step's update
excepted, and listed in incidents.jsonl), at most one checkpoint interval is recomputed, and no
process is left behind."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from kiln.train import TrainConfig, Trainer
from tests.launch_support import incidents, launch, processes_of

MODEL = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32}
STEPS, INTERVAL = 16, 4
TRAIN = ["kiln", "train", *[a for k, v in MODEL.items() for a in ("--set", f"{k}={v}")], "--batch-size", 4,
         "--steps", STEPS, "--eval-interval", STEPS, "--device", "cpu", "--no-progress",
         "--checkpoint-interval", INTERVAL]


def _trainer(tmp_path, name) -> Trainer:
    return Trainer(TrainConfig(model_overrides=MODEL, batch_size=4, max_steps=STEPS, eval_interval=STEPS,
                               device="cpu", progress=False, checkpoint_interval=INTERVAL, sample_tokens=0,
                               out_dir=str(tmp_path), run_name=name))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The unfaulted run's final parameters, in this process."""
    t = _trainer(tmp_path_factory.mktemp("reference"), "ref")
    t.fit()
    return {n: p.numpy().copy() for n, p in t.model.named_parameters()}


def _skipping(tmp_path, skipped: int) -> dict:
    """The unfaulted run with step `skipped`'s update left out: its batch drawn, no update."""
    t = _trainer(tmp_path, "skip-ref")
    while t.step < STEPS:
        if t.step + 1 == skipped:
            t._batch(t.train_loader)
            t.step += 1
        else:
            t.train_step()
    return {n: p.numpy().copy() for n, p in t.model.named_parameters()}


def _final(run) -> dict:
    return load_file(str(run / "model.safetensors"))


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name} differs (max {np.abs(got[name] - want[name]).max()})"


RESTARTS = {  # fault -> (launch options, incident classes, step resumed from)
    "kill@step=6": ((), ["dead_rank"], 4),
    "hang@step=6": (("--hang-timeout-min", 2), ["hang"], 4),
    "nan@step=6": ((), ["bad_step_nan"], 4),
    "oom@step=7": ((), ["host_oom"], 4),
    "truncate@step=8": ((), ["dead_rank", "checkpoint_truncated"], 4),
    "corrupt@step=8": ((), ["dead_rank", "checkpoint_corrupt"], 4),
    "kill_ckpt@step=8": ((), ["dead_rank"], 4),
}


@pytest.mark.parametrize("fault", list(RESTARTS))
def test_the_gang_restarts_from_the_newest_good_checkpoint(fault, reference, tmp_path):
    options, classes, resumed = RESTARTS[fault]
    run = tmp_path / "run"
    # Synchronous checkpoints, but for the fault that kills the background writer mid-file: the
    # checkpoint of step 4 is then durable before step 5, so a fault at step 6 resumes from step 4 on a
    # fast machine too (an async write still in flight is, rightly, no checkpoint: seen on an idle CI)
    train = TRAIN if fault.startswith("kill_ckpt") else [*TRAIN, "--sync-checkpoint"]
    proc = launch(run, train, "--max-restarts", 2, *options, fault=fault)
    assert proc.returncode == 0, proc.stderr + (run / "logs" / "rank-0.log").read_text()[-3000:]
    found = incidents(run)
    assert sorted(i["class"] for i in found) == sorted(classes), found
    restart = next(i for i in found if i["class"] == classes[0])
    step = int(fault.split("=")[1])
    assert (restart["rank"], restart["step"], restart["resumed_from_step"]) == (0, step, resumed)
    assert 0 < restart["steps_lost"] <= INTERVAL and restart["recovery_s"] > 0
    assert "gang killed, restarted from step" in restart["action"]
    if len(classes) > 1:  # the damaged checkpoint was set aside, not resumed from
        assert (run / "checkpoints" / f"ckpt-{step:08d}.kiln.corrupt").is_file()
    assert f"resuming {run} at step {resumed}" in (run / "logs" / "rank-0.log").read_text()
    _assert_equal(_final(run), reference)
    assert processes_of(run) == []


def test_a_spike_is_rolled_back_in_place(reference, tmp_path):
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--on-bad-step", "rollback", "--spike-min-history", 8, fault="spike@step=14")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["step"], inc["attempt"], inc["steps_lost"]) == ("bad_step_spike", 14, 0, 2)
    assert inc["action"] == "rolled back in place to step 12 (ckpt-00000012.kiln)"
    assert "standard deviations above" in inc["evidence"]
    _assert_equal(_final(run), reference)  # steps 13-14 recomputed without the spike
    assert processes_of(run) == []


def test_a_nan_step_is_skipped_in_place(tmp_path):
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--on-bad-step", "skip", fault="nan@step=6")
    assert proc.returncode == 0, proc.stderr
    [inc] = incidents(run)
    assert (inc["class"], inc["step"], inc["attempt"], inc["steps_lost"]) == ("bad_step_nan", 6, 0, 1)
    assert inc["action"].startswith("skipped in place")
    _assert_equal(_final(run), _skipping(tmp_path, skipped=6))  # the listed step's update excepted
    assert processes_of(run) == []
