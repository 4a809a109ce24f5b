"""AdamW applied inside backward (kiln.optim.AdamW(in_backward=True)): the same update as the ordinary
step, bit for bit on the CPU, with no gradient kept."""

import numpy as np
import pytest

import kiln
from kiln.autograd import graph_nodes
from kiln.errors import ConfigError, KilnError
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups


def tiny_gpt(dtype, tie_weights=True, seed=3):
    cfg = GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=tie_weights)
    model = GPT(cfg, generator=kiln.Generator(seed))
    model.to("cpu", dtype=dtype)
    return model


def adamw(model, in_backward, clip_via="recompute"):
    return AdamW(gpt_param_groups(model, 0.1), lr=3e-2, betas=(0.9, 0.95), in_backward=in_backward,
                 clip_via=clip_via)


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(kiln.tensor(rng.integers(0, 48, (3, 16))), kiln.tensor(rng.integers(0, 48, (3, 16))))
            for _ in range(steps)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("max_norm", [None, 0.05, 1e3])  # no clip; a clip that scales; one that does not
@pytest.mark.parametrize("tie_weights", [True, False])
@pytest.mark.parametrize("clip_via", ["recompute", "host"])
def test_in_backward_step_equals_backward_clip_step_bit_for_bit(dtype, max_norm, tie_weights, clip_via, monkeypatch):
    from kiln.optim import host_stash
    monkeypatch.setattr(host_stash, "WINDOW_BYTES", 2048)  # gradients go back to the allocator as copies finish
    ordinary, inside = tiny_gpt(dtype, tie_weights), tiny_gpt(dtype, tie_weights)
    opt, opt_in = adamw(ordinary, False), adamw(inside, True, clip_via)
    for step, (x, y) in enumerate(batches(4)):
        for o in (opt, opt_in):
            for g in o.param_groups:
                g["lr"] = 3e-2 / (step + 1)  # the schedule moves lr between steps
        opt.zero_grad()
        ordinary(x, y)[1].backward()
        norm = opt.clip_grad_norm_(max_norm) if max_norm is not None else None
        opt.step()
        norm_in = opt_in.backward_step(inside(x, y)[1], max_norm)
        assert all(p.grad is None for p in inside.parameters())
        if max_norm is None:
            assert norm_in is None
        else:
            assert norm_in.numpy().tobytes() == norm.numpy().tobytes()
        for (name, a), b in zip(ordinary.named_parameters(), inside.parameters()):
            assert a.numpy().tobytes() == b.numpy().tobytes(), f"step {step}: {name} differs"
    assert opt_in.step_count == opt.step_count == 4
    for m, m_in in zip(opt.state_dict()["exp_avg_sq"], opt_in.state_dict()["exp_avg_sq"]):
        assert m.tobytes() == m_in.tobytes()


def test_the_clip_scales_the_update():
    """A clip far below the norm changes the step (the coefficient reached the update)."""
    x, y = batches(1)[0]
    clipped, free = tiny_gpt("float64"), tiny_gpt("float64")
    norm = adamw(clipped, True).backward_step(clipped(x, y)[1], 1e-3)
    adamw(free, True).backward_step(free(x, y)[1])
    assert float(norm.item()) > 1e-3
    assert any(not np.array_equal(a.numpy(), b.numpy()) for a, b in zip(clipped.parameters(), free.parameters()))


def test_each_update_happens_as_its_gradient_is_made_and_frees_it():
    """When a parameter is updated, the gradients of the parameters updated before it are gone: at
    most one parameter gradient is alive at a time (here: none once its own update starts)."""
    model = tiny_gpt("float64")
    opt = adamw(model, True)
    alive, seen = [], []
    original = opt._gradient_final

    def watching(p):
        seen.append(id(p))
        alive.append(sum(q.grad is not None for q in model.parameters()))
        original(p)
    for p in model.parameters():
        p._post_accumulate_hooks[:] = [watching]
    x, y = batches(1)[0]
    opt.backward_step(model(x, y)[1], 1.0)
    n = len(list(model.parameters()))
    assert len(seen) == 2 * n and len(set(seen)) == n  # each parameter once per pass: the tied one too
    assert max(alive) == 1  # only the gradient of the parameter at hand


def test_the_host_clip_runs_one_backward_and_keeps_one_window_of_gradients(monkeypatch):
    """clip_via="host": each parameter's hook runs once (one backward, no retained graph), each gradient
    is stashed, and no more than the window's bytes of gradients (plus the newest) wait for their copies."""
    from kiln.optim import host_stash
    monkeypatch.setattr(host_stash, "WINDOW_BYTES", 4096)
    model = tiny_gpt("float64")
    opt = adamw(model, True, "host")
    seen, waiting = [], []
    original, put = opt._gradient_final, host_stash.HostGradStash.put

    def watching(p):
        seen.append(id(p))
        original(p)

    def putting(self, i, grad):
        put(self, i, grad)
        waiting.append(self._pending_bytes - grad.nbytes)
    monkeypatch.setattr(host_stash.HostGradStash, "put", putting)
    for p in model.parameters():
        p._post_accumulate_hooks[:] = [watching]
    x, y = batches(1)[0]
    loss = model(x, y)[1]
    opt.backward_step(loss, 1.0)
    n = len(list(model.parameters()))
    assert len(seen) == n == len(set(seen)) == len(waiting)
    assert max(waiting) <= 4096 and not opt._stash._pending and opt._stash.order == []
    with pytest.raises(Exception, match="retain|freed|again"):
        loss.backward()  # the graph was not retained


def test_host_memory_refused_is_a_clear_error():
    from kiln.backend import cpu
    from kiln.optim.host_stash import HostGradStash

    class Refusing:
        def __getattr__(self, name):
            return getattr(cpu, name)

        def pinned_empty(self, shape, dtype):
            raise MemoryError("cudaErrorMemoryAllocation")
    stash = HostGradStash(Refusing())
    with pytest.raises(KilnError, match="page-locked host memory .* cudaErrorMemoryAllocation.*clip_via='recompute'"):
        stash.put(0, np.ones(4))


def test_misuse_is_a_clear_error():
    model = tiny_gpt("float64")
    opt = adamw(model, True)
    x, y = batches(1)[0]
    with pytest.raises(KilnError, match="outside its backward_step"):
        model(x, y)[1].backward()
    for p in model.parameters():
        p.grad = None
    with pytest.raises(ConfigError, match="in_backward=True"):
        opt.step()
    with pytest.raises(ConfigError, match="max_norm > 0"):
        opt.backward_step(model(x, y)[1], 0.0)
    plain = adamw(tiny_gpt("float64"), False)
    with pytest.raises(ConfigError, match="in_backward=True"):
        plain.backward_step(model(x, y)[1])
    with pytest.raises(ConfigError, match="clip_via must be one of recompute, host"):
        adamw(model, True, "disk")


@pytest.mark.parametrize("recompute, norm_gelu", [(1, False), (2, False), (0, True), (1, True)])
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_recomputed_blocks_norms_and_gelus_give_the_same_training_bit_for_bit(recompute, norm_gelu, max_norm):
    """Blocks that keep only their inputs and run their forward again in backward (GPT.recompute_blocks),
    and blocks that make their LayerNorm and GELU outputs again (GPT.recompute_norm_gelu), train exactly as
    the plain graph on the CPU,
    with AdamW in backward and its two passes too."""
    plain, redone = tiny_gpt("float32"), tiny_gpt("float32")
    redone.recompute_blocks = recompute
    redone.recompute_norm_gelu = norm_gelu
    opt, opt_redone = adamw(plain, True), adamw(redone, True)
    for x, y in batches(3):
        loss, loss_redone = plain(x, y)[1], redone(x, y)[1]
        assert loss.numpy().tobytes() == loss_redone.numpy().tobytes()
        opt.backward_step(loss, max_norm)
        opt_redone.backward_step(loss_redone, max_norm)
        for (name, a), b in zip(plain.named_parameters(), redone.parameters()):
            assert a.numpy().tobytes() == b.numpy().tobytes(), name


def test_a_recomputed_block_keeps_only_its_inputs():
    """The graph of a recomputed block holds two [B, T, C] arrays, the plain block's many more."""
    from kiln.nn.recompute import RecomputedBlock
    model = tiny_gpt("float32")
    x, y = batches(1)[0]
    model.recompute_blocks = 2
    loss = model(x, y)[1]
    nodes = graph_nodes(loss)
    blocks = [n for n in nodes if isinstance(n, RecomputedBlock)]
    assert len(blocks) == 2
    assert [sum(a is not None for a in n.saved) for n in blocks] in ([2, 1], [1, 2])  # block 0 has no h


# --- on the GPU ---------------------------------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtypes", [("float32",), ("float32", "bfloat16")])
def test_cuda_norm_parts_added_in_any_order_are_grad_norm_bit_for_bit(dtypes):
    from kiln.backend import cuda as backend
    rng = np.random.default_rng()
    sizes = [70_000, 3, 16_384, 1_000_001, 257]
    grads = [kiln.tensor(rng.standard_normal(n), dtype=dtypes[i % len(dtypes)], device="cuda").data
             for i, n in enumerate(sizes)]
    parts = backend.grad_norm_parts(grads)
    for i in rng.permutation(len(grads)):
        parts.add(int(i), grads[i])
    assert parts.norm().get().tobytes() == backend.grad_norm(grads).get().tobytes()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("max_norm", [None, 0.05])
@pytest.mark.parametrize("recompute, norm_gelu, clip_via", [(0, False, "recompute"), (1, True, "recompute"),
                                                          (0, False, "host"), (1, True, "host")])
def test_cuda_in_backward_step_equals_backward_clip_step_bit_for_bit(max_norm, recompute, norm_gelu, clip_via,
                                                                       monkeypatch):
    from kiln.optim import host_stash
    monkeypatch.setattr(host_stash, "WINDOW_BYTES", 4096)  # the compute stream waits on copies mid-backward
    models = [tiny_gpt("float32").to("cuda") for _ in range(2)]
    for m in models:
        m.recompute_blocks, m.recompute_norm_gelu = recompute, norm_gelu
    ordinary, inside = models
    opt, opt_in = adamw(ordinary, False), adamw(inside, True, clip_via)
    for step, (x, y) in enumerate(batches(3)):
        x, y = x.to("cuda"), y.to("cuda")
        opt.zero_grad()
        ordinary(x, y)[1].backward()
        norm = opt.clip_grad_norm_(max_norm) if max_norm is not None else None
        opt.step()
        norm_in = opt_in.backward_step(inside(x, y)[1], max_norm)
        if max_norm is not None:
            assert norm_in.numpy().tobytes() == norm.numpy().tobytes(), \
                f"step {step}: norm {float(norm_in.item())} in backward, {float(norm.item())} ordinary"
        differ = [name for (name, a), b in zip(ordinary.named_parameters(), inside.parameters())
                  if a.numpy().tobytes() != b.numpy().tobytes()]
        assert not differ, f"step {step}: {len(differ)} parameters differ: {', '.join(differ)}"
