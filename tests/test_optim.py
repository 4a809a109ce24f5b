import math

import numpy as np
import pytest
import torch

import kiln
from kiln.errors import ConfigError
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, clip_grad_norm_, gpt_param_groups, warmup_cosine_lr


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    lrs = [warmup_cosine_lr(s, 1.0, 0.1, 10, 110) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)
    assert lrs[110] == lrs[119] == 0.1
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    with pytest.raises(ConfigError):
        warmup_cosine_lr(0, 0.1, 1.0, 10, 100)


def test_adamw_matches_torch_with_weight_decay_on_one_group_only():
    rng = np.random.default_rng()
    w0, b0 = rng.standard_normal((4, 3)), rng.standard_normal(3)
    w, b = kiln.tensor(w0, requires_grad=True), kiln.tensor(b0, requires_grad=True)
    tw, tb = torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)
    opt = AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                lr=0.01, betas=(0.9, 0.95))
    topt = torch.optim.AdamW([{"params": [tw], "weight_decay": 0.1}, {"params": [tb], "weight_decay": 0.0}],
                             lr=0.01, betas=(0.9, 0.95))
    for _ in range(10):
        x = rng.standard_normal((5, 4))
        opt.zero_grad()
        ((kiln.tensor(x) @ w + b).tanh() ** 2).sum().backward()
        opt.step()
        topt.zero_grad()
        ((torch.tensor(x) @ tw + tb).tanh() ** 2).sum().backward()
        topt.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(b.numpy(), tb.detach().numpy(), rtol=1e-12)


def test_gpt_groups_decay_two_dimensional_weights_only():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    decay, no_decay = gpt_param_groups(model, 0.1)
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_matches_torch(max_norm):
    rng = np.random.default_rng()
    arrays = [rng.standard_normal(s) for s in ((3, 4), (5,), (2, 2, 2))]
    ps = [kiln.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    for p, t, a in zip(ps, ts, arrays):
        g = rng.standard_normal(a.shape)
        p.grad, t.grad = kiln.tensor(g), torch.tensor(g)
    norm = clip_grad_norm_(ps, max_norm)
    tnorm = torch.nn.utils.clip_grad_norm_(ts, max_norm)
    assert norm.item() == pytest.approx(tnorm.item(), rel=1e-12)
    for p, t in zip(ps, ts):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-12)


def test_gradient_accumulation_equals_one_large_batch():
    cfg = GPTConfig(vocab_size=40, block_size=8, n_layer=1, n_head=2, n_embd=16)
    rng = np.random.default_rng()
    idx, tgt = rng.integers(0, 40, (4, 8)), rng.integers(0, 40, (4, 8))
    big = GPT(cfg, generator=kiln.Generator(3)).to(dtype="float64")
    acc = GPT(cfg, generator=kiln.Generator(3)).to(dtype="float64")
    big(kiln.tensor(idx), kiln.tensor(tgt))[1].backward()
    for half in (slice(0, 2), slice(2, 4)):
        (acc(kiln.tensor(idx[half]), kiln.tensor(tgt[half]))[1] / 2.0).backward()
    for p, q in zip(big.parameters(), acc.parameters()):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_optimizer_clip_is_fused_into_the_step_and_matches_torch(max_norm):
    rng = np.random.default_rng()
    arrays = [rng.standard_normal(s) for s in ((3, 4), (5,), (2, 2, 2))]
    ps = [kiln.tensor(a, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    opt = AdamW(ps, lr=0.01, weight_decay=0.1)
    topt = torch.optim.AdamW(ts, lr=0.01, weight_decay=0.1)
    for _ in range(3):
        grads = [rng.standard_normal(a.shape) * 3 for a in arrays]
        for p, t, g in zip(ps, ts, grads):
            p.grad, t.grad = kiln.tensor(g), torch.tensor(g)
        norm = opt.clip_grad_norm_(max_norm)
        tnorm = torch.nn.utils.clip_grad_norm_(ts, max_norm)
        assert float(norm.numpy()) == pytest.approx(float(tnorm), rel=1e-12)
        for p, g in zip(ps, grads):  # the gradients themselves are not rewritten
            np.testing.assert_array_equal(p.grad.numpy(), g)
        opt.step()
        topt.step()
    for p, t in zip(ps, ts):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-12)


def test_optimizer_clip_applies_to_the_next_step_only():
    p = kiln.tensor(np.ones(4), requires_grad=True)
    q = kiln.tensor(np.ones(4), requires_grad=True)
    opt, ref = AdamW([p], lr=0.1, weight_decay=0.0), AdamW([q], lr=0.1, weight_decay=0.0)
    p.grad, q.grad = kiln.tensor(np.full(4, 10.0)), kiln.tensor(np.full(4, 10.0))
    opt.clip_grad_norm_(1.0)
    opt.zero_grad()  # drops the pending clip with the gradients
    p.grad = kiln.tensor(np.full(4, 10.0))
    opt.step()
    ref.step()
    np.testing.assert_array_equal(p.numpy(), q.numpy())
    opt.zero_grad()
    with pytest.raises(kiln.KilnError, match="no gradients"):
        opt.clip_grad_norm_(1.0)


def test_cuda_adamw_block_starts_cut_each_tensor_into_whole_chunks():
    from kiln.backend.cuda.adamw import CHUNK, block_starts
    starts = block_starts([1, CHUNK, CHUNK + 1, 3 * CHUNK])
    assert starts.tolist() == [0, 1, 2, 4, 7]


def _bf16_gpt(seed):
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16), generator=kiln.Generator(seed))
    model.compute_dtype = kiln.bfloat16
    return model, AdamW(gpt_param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))


def test_bf16_step_reads_the_weight_copies_adamw_writes(monkeypatch):
    """A bf16 step over fp32 weights casts each weight once (the first forward); from then on AdamW writes
    the bf16 copy with its update and the forward reads it: the same losses, bit for bit, as a model whose
    copies are dropped after every step (each forward casting afresh), and no weight cast in the forward."""
    from kiln.backend import cpu
    rng = np.random.default_rng()
    batches = [rng.integers(0, 32, (3, 8)) for _ in range(4)]
    kept, kept_opt = _bf16_gpt(7)
    fresh, fresh_opt = _bf16_gpt(7)
    real_cast = cpu.cast
    weight_casts = []

    def counting_cast(x, dtype, out=None):
        if any(x is p.data for p in kept.parameters()):
            weight_casts.append(x.shape)
        return real_cast(x, dtype, out=out)

    monkeypatch.setattr(cpu, "cast", counting_cast)
    losses = {id(kept): [], id(fresh): []}
    for i, idx in enumerate(batches):
        x, y = kiln.tensor(idx[:, :-1]), kiln.tensor(idx[:, 1:])
        for model, opt in ((kept, kept_opt), (fresh, fresh_opt)):
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            losses[id(model)].append(loss.item())
        for p in fresh.parameters():
            p.kept = None
        if i == 0:
            assert weight_casts, "the first forward casts the weights into their copies"
            weight_casts.clear()
    assert weight_casts == []
    assert losses[id(kept)] == losses[id(fresh)]
    copies = [p for p in kept.parameters() if p.kept is not None]
    assert len(copies) == len(list(kept.parameters())) - 1  # every weight but wpe (an fp32 embedding)
    for p in copies:
        assert np.array_equal(p.kept.data.view(np.uint16), p.numpy().astype(p.kept.dtype.np).view(np.uint16))


def test_a_weight_changed_in_place_is_recast_at_the_next_forward():
    model, _ = _bf16_gpt(3)
    x = kiln.tensor(np.arange(7)[None] % 32)
    model(x)
    w = model.h[0].attn.c_attn.weight
    before = w.kept.data.copy()
    with kiln.no_grad():
        w.copy_(w.numpy() * 2.0)
    model(x)
    assert not np.array_equal(w.kept.data, before)
    assert np.array_equal(w.kept.data.view(np.uint16), w.numpy().astype(w.kept.dtype.np).view(np.uint16))


def test_bf16_step_makes_the_weight_gradients_in_fp32(monkeypatch):
    """The ops that use a bf16 copy of an fp32 weight (linear, linear_gelu, the LayerNorms, the LM head)
    make its gradient in fp32 themselves: the backward casts no parameter gradient, and none is rounded
    to bf16 on its way to the fp32 weight."""
    from kiln.backend import cpu
    model, _ = _bf16_gpt(5)
    idx = np.random.default_rng().integers(0, 32, (3, 8))
    x, y = kiln.tensor(idx[:, :-1]), kiln.tensor(idx[:, 1:])
    _, loss = model(x, y)
    shapes = {p.shape for p in model.parameters()}
    real_cast = cpu.cast
    grad_casts = []

    def counting_cast(a, dtype, out=None):
        if a.shape in shapes:
            grad_casts.append(a.shape)
        return real_cast(a, dtype, out=out)

    monkeypatch.setattr(cpu, "cast", counting_cast)
    loss.backward()
    assert grad_casts == []
    assert all(p.grad.dtype is kiln.float32 for p in model.parameters())
    w = model.h[0].mlp.c_fc.weight.grad.numpy()
    assert not np.array_equal(w, w.astype(kiln.bfloat16.np).astype(np.float32))  # not bf16 values
