"""causal attention: the op against PyTorch SDPA and finite differences; the CUDA kernels against the CPU backend (`cuda`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import kiln
from kiln.backend import cpu
from kiln.errors import ShapeError
from kiln.nn import functional as F
from tests.conftest import DTYPE_IDS, DTYPES, close, f64, rand, rel
from tests.gradcheck import gradcheck, randn


def test_attention_matches_pytorch_sdpa_and_finite_differences():
    q, k, v = randn(2, 3, 7, 4), randn(2, 3, 7, 4), randn(2, 3, 7, 4)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ref = TF.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    g = randn(*ref.shape)
    ref.backward(torch.tensor(g))
    kq, kk, kv = (kiln.tensor(a, requires_grad=True) for a in (q, k, v))
    out = F.scaled_dot_product_attention(kq, kk, kv)
    out.backward(kiln.tensor(g))
    assert rel(out.numpy(), ref.detach().numpy()) < 1e-13
    for a, b in ((kq, tq), (kk, tk), (kv, tv)):
        assert rel(a.grad.numpy(), b.grad.numpy()) < 1e-12
    small = [randn(1, 2, 4, 3) for _ in range(3)]
    gradcheck(F.scaled_dot_product_attention, *small)


def test_causal_self_attention_on_packed_qkv_matches_pytorch_and_finite_differences():
    b, t, h, d = 2, 7, 3, 4
    qkv = randn(b, t, 3 * h * d)
    tqkv = torch.tensor(qkv, requires_grad=True)
    tq, tk, tv = (a.reshape(b, t, h, d).transpose(1, 2) for a in tqkv.split(h * d, dim=-1))
    ref = TF.scaled_dot_product_attention(tq, tk, tv, is_causal=True).transpose(1, 2).reshape(b, t, h * d)
    g = randn(*ref.shape)
    ref.backward(torch.tensor(g))
    kqkv = kiln.tensor(qkv, requires_grad=True)
    out = F.causal_self_attention(kqkv, h)
    out.backward(kiln.tensor(g))
    assert out.shape == (b, t, h * d)
    assert rel(out.numpy(), ref.detach().numpy()) < 1e-13
    assert rel(kqkv.grad.numpy(), tqkv.grad.numpy()) < 1e-12
    gradcheck(lambda x: F.causal_self_attention(x, 2), randn(1, 4, 3 * 2 * 3))
    with pytest.raises(ShapeError, match="3 \\* n_head"):
        F.causal_self_attention(kiln.randn(2, 4, 10), 2)


# --- attention ----------------------------------------------------------------------------

ATT_SHAPES = [(1, 1, 3, 64), (2, 3, 65, 64), (1, 2, 200, 128), (1, 1, 33, 32), (2, 2, 100, 48),
              (4, 12, 256, 64),
              pytest.param((4, 12, 1024, 64), marks=pytest.mark.slow),
              pytest.param((1, 2, 2048, 128), marks=pytest.mark.slow),
              pytest.param((1, 1, 16384, 64), marks=pytest.mark.slow)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ATT_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention(gpu, rng, shape, dtype):
    q, k, v, g = (rand(shape, dtype, rng) for _ in range(4))
    scale = 1.0 / math.sqrt(shape[-1])
    out, lse = gpu.attention_fwd(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), scale)
    rout, rlse = cpu.attention_fwd(f64(q), f64(k), f64(v), scale)
    close(gpu, out, rout, dtype, factor=5 if dtype == np.float32 else 1)
    close(gpu, lse, rlse, np.float32, factor=5)
    # The backward from the kernel's own output and lse, as autograd calls it.
    grads = gpu.attention_bwd(gpu.asarray(g), gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), out, lse, scale)
    refs = cpu.attention_bwd(f64(g), f64(q), f64(k), f64(v), f64(gpu.to_numpy(out)), f64(gpu.to_numpy(lse)), scale)
    for got, ref in zip(grads, refs):
        close(gpu, got, ref, dtype, factor=10 if dtype == np.float32 else 2)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 3, 65, 64), (1, 2, 200, 128), (2, 4, 100, 32), (1, 2, 40, 48)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_reads_and_writes_packed_views(gpu, rng, shape, dtype):
    """q, k, v as views of one [B, T, 3, H, D] buffer (c_attn's output), dO as a view of [B, T, H, D]
    and dq, dk, dv written into views of one packed gradient give, bit for bit, what contiguous
    operands give (D = 48: the CPU fallback, copied into the views)."""
    b, h, t, d = shape
    xp = gpu.xp
    scale = 1.0 / math.sqrt(d)
    qkv = gpu.asarray(rand((b, t, 3, h, d), dtype, rng))
    g = gpu.asarray(rand((b, t, h, d), dtype, rng)).transpose(0, 2, 1, 3)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    qc, kc, vc, gc = (xp.ascontiguousarray(a) for a in (q, k, v, g))
    out, lse = gpu.attention_fwd(q, k, v, scale)
    out_c, lse_c = gpu.attention_fwd(qc, kc, vc, scale)
    assert np.array_equal(gpu.to_numpy(out), gpu.to_numpy(out_c)) and np.array_equal(gpu.to_numpy(lse), gpu.to_numpy(lse_c))
    dqkv = xp.zeros((b, t, 3, h, d), dtype=qkv.dtype)
    into = tuple(dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    got = gpu.attention_bwd(g, q, k, v, out, lse, scale, into=into)
    assert all(a is b_ for a, b_ in zip(got, into))
    ref = gpu.attention_bwd(gc, qc, kc, vc, xp.ascontiguousarray(out_c), lse_c, scale)
    for a, r in zip(into, ref):
        assert np.array_equal(gpu.to_numpy(a), gpu.to_numpy(r))
    cref = cpu.attention_bwd(*(f64(gpu.to_numpy(a)) for a in (gc, qc, kc, vc, out_c, lse_c)), scale)
    for a, r in zip(into, cref):
        close(gpu, a, r, dtype, factor=10 if dtype == np.float32 else 2)
