"""Issue 16 on the GPU: a run interrupted and resumed from a checkpoint ends with the uninterrupted
run's parameters, bit for bit, as it does on the CPU (tests/test_launch_recovery.py).

The H200 recovery of stop 19 (benchmarks/results/recovery/recovery-cuda-2026-12-03.md) was not
bit-equal. Reading the code left these suspects, each isolated by one test here:

- op by op against the graph: the faulted attempts ran every step op by op (any KILN_FAULT turned
  the graph off), the unfaulted run replayed a CUDA graph from step 3. Now only the step that a
  NaN or spike fault changes runs op by op; test_the_graph_step_equals_the_op_by_op_step says
  whether the two paths give the same bits at all.
- resume: the resumed attempt records its graph again at its first step, restores the loader's
  position (the batch staged ahead is not counted) and the RNGs, from a checkpoint snapshotted to
  pinned memory on a side stream (async) or written synchronously;
  test_a_resumed_run_equals_the_uninterrupted_one covers each.
- test_a_killed_gpu_launch_equals_the_unfaulted_one: the whole path, as benchmarks/recovery.py
  runs it on one GPU.

    pytest -m cuda tests/test_launch_recovery_cuda.py     (or: bash benchmarks/device_check.sh launch-tests)
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

import kiln
from kiln.train import TrainConfig, Trainer
from tests.launch_support import incidents, launch, processes_of
from tests.test_checkpoint import stopped_run_folder

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")]
# head dim 32: the CUDA attention kernels take 32, 64 and 128 (16 falls back to the CPU, which no graph captures)
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64, "dropout": 0.0}
COMMON = dict(model_overrides=MODEL, batch_size=8, device="cuda", progress=False, eval_iters=2, sample_tokens=0)


def _params(trainer) -> dict:
    return {n: p.numpy().copy() for n, p in trainer.model.named_parameters()}


def _assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    differ = {n: float(np.abs(got[n].astype(np.float64) - want[n]).max()) for n in want
              if not np.array_equal(got[n], want[n])}
    assert not differ, f"{what}: {len(differ)} of {len(want)} parameters differ, max abs difference {differ}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_graph_step_equals_the_op_by_op_step(tmp_path, precision):
    runs = {}
    for graph in (False, True):
        t = Trainer(TrainConfig(**COMMON, precision=precision, max_steps=8, cuda_graph=graph,
                                out_dir=str(tmp_path), run_name=f"graph-{graph}"))
        rows = [t.train_step() for _ in range(8)]
        assert (t._graph_step is not None) == graph
        runs[graph] = [(r["loss"], r["grad_norm"]) for r in rows], _params(t)
    (eager_rows, eager), (graph_rows, replayed) = runs[False], runs[True]
    first = next((i + 1 for i, (a, b) in enumerate(zip(eager_rows, graph_rows)) if a != b), None)
    assert first is None, f"(loss, grad norm) differ from step {first} on: {eager_rows[first - 1:]} vs " \
                          f"{graph_rows[first - 1:]}"
    _assert_bitwise(replayed, eager, f"{precision}: the graph's parameters after 8 steps")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: AdamW's kept bf16 copies, recast before the capture
@pytest.mark.parametrize("graph, async_checkpoint", [(True, True), (True, False), (False, True)],
                         ids=["graph-async", "graph-sync", "op-by-op-async"])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, graph, async_checkpoint, precision):
    cfg = TrainConfig(**COMMON, precision=precision, max_steps=12, eval_interval=12, checkpoint_interval=4,
                      cuda_graph=graph, async_checkpoint=async_checkpoint, out_dir=str(tmp_path), run_name="full")
    full = Trainer(cfg)
    full.fit()
    stopped = stopped_run_folder(tmp_path / "full", 8, tmp_path / "stopped")
    resumed = Trainer.from_checkpoint(stopped)
    assert resumed.step == 8 and resumed.config.cuda_graph is graph
    resumed.fit()
    assert (resumed._graph_step is not None) == graph  # recorded again after the resume
    _assert_bitwise(_params(resumed), _params(full), "resumed at step 8")
    _assert_bitwise(load_file(str(stopped / "model.safetensors")), load_file(str(tmp_path / "full" / "model.safetensors")),
                    "model.safetensors")


TRAIN = ["kiln", "train", *[a for k, v in MODEL.items() for a in ("--set", f"{k}={v}")], "--batch-size", 8,
         "--steps", 16, "--eval-interval", 16, "--device", "cuda", "--no-progress",
         "--checkpoint-interval", 4]


@pytest.mark.slow  # kiln train processes on the GPU: benchmarks/device_check.sh's launch-tests part
@pytest.mark.parametrize("fault", ["kill@step=10", "nan@step=10"])
def test_a_killed_gpu_launch_equals_the_unfaulted_one(tmp_path, fault):
    """`kiln launch --nproc 1 -- kiln train --device cuda`, a rank killed (or a NaN, restarted) at
    step 10, resumed from step 8's checkpoint (async, as in benchmarks/recovery.py): the final
    parameters are the unfaulted launch's."""
    reference = tmp_path / "reference"
    proc = launch(reference, TRAIN, "--nproc", 1, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    proc = launch(run, TRAIN, "--nproc", 1, "--max-restarts", 1, fault=fault, timeout=600)
    assert proc.returncode == 0, proc.stderr + (run / "logs" / "rank-0.log").read_text()[-3000:]
    [inc] = incidents(run)
    assert (inc["step"], inc["resumed_from_step"]) == (10, 8), inc
    _assert_bitwise(load_file(str(run / "model.safetensors")), load_file(str(reference / "model.safetensors")),
                    f"after {fault}")
    assert processes_of(run) == []
