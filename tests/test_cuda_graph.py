"""CapturedStep: a step recorded as a CUDA graph replays exactly what eager execution computes."""

import gc

import numpy as np
import pytest

import kiln
from kiln.errors import DeviceError, ShapeError
from kiln.graph import CapturedStep
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups
from kiln.train import apply_precision


def gpu(test):
    """Marks a test as a device test (pytest -m cuda), skipped without a GPU."""
    return pytest.mark.cuda(pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")(test))


CFG = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)


def test_capture_refuses_cpu_tensors():
    step = CapturedStep(lambda x: x * 2.0)
    with pytest.raises(DeviceError, match="cuda"):
        step(kiln.tensor(np.ones(3, np.float32)))


def _affine(x, w):
    return (x @ w) * 3.0 + 1.0


@gpu
def test_replays_equal_eager_and_survive_eager_allocations():
    rng = np.random.default_rng()
    w = kiln.tensor(rng.standard_normal((64, 32)).astype(np.float32), device="cuda")
    step = CapturedStep(lambda x: _affine(x, w))
    for _ in range(4):
        x = kiln.tensor(rng.standard_normal((16, 64)).astype(np.float32), device="cuda")
        out = step(x)
        # eager work between replays allocates and frees memory the graph must not share
        junk = [kiln.tensor(rng.standard_normal((16, 32)).astype(np.float32), device="cuda") * 5.0
                for _ in range(8)]
        del junk
        np.testing.assert_array_equal(out.numpy(), _affine(x, w).numpy())
    assert step.captured
    with pytest.raises(ShapeError, match="shape"):
        step(kiln.tensor(np.zeros((8, 64), np.float32), device="cuda"))
    pool_bytes = lambda: kiln.device("cuda").backend.memory_stats()["graph_pool_bytes"]  # noqa: E731
    held = pool_bytes()
    assert held > 0
    step.release()
    assert pool_bytes() < held
    # a step dropped without release() gives its memory back when it is collected
    other = CapturedStep(lambda x: _affine(x, w))
    other(x)
    held = pool_bytes()
    del other
    gc.collect()
    assert pool_bytes() < held


@gpu
def test_a_host_sync_inside_the_step_is_a_clear_error():
    from kiln.graph import GraphCaptureError
    step = CapturedStep(lambda x: x * float((x * 2.0).sum().item()))
    with pytest.raises(GraphCaptureError, match="host"):
        step(kiln.tensor(np.ones(4, np.float32), device="cuda"))


@gpu
def test_a_failed_capture_gives_back_what_the_step_allocated():
    """The memory a failed capture's step allocated (held by the traceback, partly in cycles) is
    back in the eager cache when the error arrives, so the step can run op by op at once."""
    from kiln.backend.cuda import allocator
    from kiln.graph import GraphCaptureError

    def body(x):
        big = x * 2.0  # 64 MiB in the capture's pool, held by this frame
        cycle = {"big": big}
        cycle["self"] = cycle  # only a collection frees it
        return x * float(big.sum().item())  # a host sync: the capture fails

    x = kiln.tensor(np.ones(1 << 24, np.float32), device="cuda")
    alloc = allocator.installed()
    gc.collect()  # the failed capture collects: garbage of earlier tests must not count as given back
    before = alloc.memory_stats()["allocated_bytes"]
    with pytest.raises(GraphCaptureError, match="host"):
        CapturedStep(body)(x)
    assert alloc.memory_stats()["allocated_bytes"] == before


def _train(precision, graph, steps=8):
    rng = np.random.default_rng(5)
    model = GPT(CFG, generator=kiln.Generator(3)).to("cuda")
    apply_precision(model, precision, kiln.device("cuda"))
    opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))

    def body(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        return loss, norm

    step = CapturedStep(body) if graph else body
    losses, norms = [], []
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = 1e-3 * (i + 1) / steps  # the schedule changes lr every step
        tokens = rng.integers(0, 64, (4, 128))
        x = kiln.tensor(tokens, device="cuda")
        y = kiln.tensor(tokens, device="cuda")  # learn to copy the current token: the loss must fall
        # as the Trainer: two eager steps warm the allocator, kernels and GEMM plans, then the graph
        loss, norm = step(x, y) if i >= 2 else body(x, y)
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, [p.numpy() for p in model.parameters()]


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_captured_training_step_equals_the_eager_one(precision):
    eager = _train(precision, graph=False)
    graph = _train(precision, graph=True)
    np.testing.assert_allclose(graph[0], eager[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(graph[1], eager[1], rtol=1e-5)
    for a, b in zip(graph[2], eager[2]):
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-5, atol=1e-6)
    assert eager[0][-1] < eager[0][0]


@gpu
def test_the_trainer_replays_its_steps_as_a_graph_by_default_with_the_eager_losses(tmp_path):
    from kiln.train import TrainConfig, Trainer
    common = dict(model="tiny", device="cuda", max_steps=6, batch_size=4, eval_interval=6, eval_iters=1,
                  sample_tokens=0, progress=False, out_dir=str(tmp_path), model_overrides={"n_layer": 2})
    eager = Trainer(TrainConfig(**common, run_name="eager", cuda_graph=False))
    graph = Trainer(TrainConfig(**common, run_name="graph"))
    e, g = eager.fit(), graph.fit()
    assert graph._graph_step is not None and graph._graph_step.captured
    np.testing.assert_allclose(g["final_train_loss"], e["final_train_loss"], rtol=1e-5)


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_replayed_training_is_bitwise_reproducible(precision):
    """Two fresh runs of the same seed and batches: bit-equal losses, norms and parameters (kiln's column sums,
    LayerNorm finishes and AdamW's kept bf16 copies add in fixed orders: no float atomics)."""
    first, second = _train(precision, graph=True), _train(precision, graph=True)
    assert first[0] == second[0] and first[1] == second[1]
    for a, b in zip(first[2], second[2]):
        assert np.array_equal(a, b)
