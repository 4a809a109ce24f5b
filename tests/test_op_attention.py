"""causal attention: the op against PyTorch SDPA and finite differences; the CUDA kernels against the CPU backend (`cuda`)."""

from __future__ import annotations

import math

import ml_dtypes
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


@pytest.fixture(params=["split", "fused-bulk", "split-tma", "fused-tma"])
def bwd(request, monkeypatch):
    """The backward tests run with every bf16/fp16 backward (KILN_ATTENTION_BWD): the dK/dV and dQ
    kernels, the fused kernel that adds dQ in the hardware's order, the split one with the
    warp-specialised TMA kernels, and the TMA dK/dV kernel that adds dQ in a fixed order (fused-tma)."""
    monkeypatch.setenv("KILN_ATTENTION_BWD", request.param)
    return request.param


def _fused_runs(bwd, dtype, d):
    """Skips a variant's case where the launcher runs the split kernels anyway (float32; head dims
    other than 64 and 128 for the fused backward and for split-tma): the same test twice."""
    from kiln.backend.cuda.attention import BWD_TMA_HEAD_DIMS, FUSED_HEAD_DIMS, FUSED_TMA_HEAD_DIMS
    dims = {"fused-bulk": FUSED_HEAD_DIMS, "split-tma": BWD_TMA_HEAD_DIMS, "fused-tma": FUSED_TMA_HEAD_DIMS}.get(bwd)
    if dims is not None and (np.dtype(dtype) == np.float32 or d not in dims):
        pytest.skip(f"{bwd} is bf16/fp16 at head dims {dims}; this case runs the split kernels")

ATT_SHAPES = [(1, 1, 3, 64), (2, 3, 65, 64), (1, 2, 200, 128), (1, 1, 33, 32), (2, 2, 100, 48),
              (4, 12, 256, 64),
              pytest.param((4, 12, 1024, 64), marks=pytest.mark.slow),
              pytest.param((1, 2, 2048, 128), marks=pytest.mark.slow),
              pytest.param((1, 1, 16384, 64), marks=pytest.mark.slow)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ATT_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention(gpu, rng, bwd, shape, dtype):
    _fused_runs(bwd, dtype, shape[-1])
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
def test_attention_reads_and_writes_packed_views(gpu, rng, bwd, shape, dtype):
    """q, k, v as views of one [B, T, 3, H, D] buffer (c_attn's output), dO as a view of [B, T, H, D]
    and dq, dk, dv written into views of one packed gradient give, bit for bit, what contiguous
    operands give (D = 48: the CPU fallback, copied into the views)."""
    b, h, t, d = shape
    _fused_runs(bwd, dtype, d)
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


@pytest.mark.cuda
def test_the_cpu_fallback_is_ordered_with_kilns_stream_whichever_stream_is_current(gpu, rng):
    """D = 48 runs on the CPU (launch.cpu_fallback). Its arguments written on kiln's stream behind ~80 ms
    of GEMMs, and the legacy null stream current when it is called (as CuPy's stream stack left it on the
    H200, see device.compute_stream): the host reads what kiln's stream wrote, not the arrays before it
    did, and kiln's stream reads the results after they land (2026-12-05: zeros from the fallback)."""
    from kiln.backend.cuda import device
    xp = gpu.xp
    shape, scale = (1, 2, 40, 48), 1.0 / math.sqrt(48)
    host = [rand(shape, np.float32, rng) for _ in range(3)]
    src = [gpu.asarray(a) for a in host]  # kiln's stream is current from here
    args = [xp.zeros(shape, np.float32) for _ in host]
    big = xp.full((4096, 4096), 1e-4, np.float32)
    for _ in range(30):  # a queue on kiln's stream ahead of the arguments' writes
        big = big @ big
    for dst, a in zip(args, src):
        dst[...] = a
    xp.cuda.Stream.null.use()
    try:
        out, lse = gpu.attention_fwd(*args, scale)
    finally:
        device.stream()  # kiln's stream current again
    got = (gpu.to_numpy(out * 1.0), gpu.to_numpy(lse * 1.0))  # read by kernels on kiln's stream first
    ref = cpu.attention_fwd(*host, scale)
    assert all(np.array_equal(g, r) for g, r in zip(got, ref))


def test_cpu_reference_of_blocks_matches_pytorch_with_an_explicit_mask():
    """The CPU reference of context parallelism's blocks: q [Tq] against k, v [Tk], causal with an
    offset (query i sees keys j <= i + offset) and full, output, lse and gradients."""
    for tq, tk, causal, offset in ((5, 9, True, 4), (6, 4, True, 0), (7, 3, False, 0), (4, 4, True, 2)):
        q, k, v = randn(2, 3, tq, 4), randn(2, 3, tk, 4), randn(2, 3, tk, 4)
        g = randn(2, 3, tq, 4)
        tq_, tk_, tv_ = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        mask = torch.ones(tq, tk, dtype=torch.bool)
        if causal:
            mask = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset
        ref = TF.scaled_dot_product_attention(tq_, tk_, tv_, attn_mask=mask, scale=0.3)
        ref.backward(torch.tensor(g))
        out, lse = cpu.attention_fwd(q, k, v, 0.3, causal=causal, offset=offset)
        s = (torch.tensor(q) @ torch.tensor(k).transpose(-1, -2) * 0.3).masked_fill(~mask, -math.inf)
        assert rel(out, ref.detach().numpy()) < 1e-13
        assert rel(lse, torch.logsumexp(s, -1).numpy()) < 1e-13
        grads = cpu.attention_bwd(g, q, k, v, out, lse, 0.3, causal=causal, offset=offset)
        for got, want in zip(grads, (tq_, tk_, tv_)):
            assert rel(got, want.grad.numpy()) < 1e-12


# q rows, k rows, causal, offset: context parallelism's blocks (zigzag's half chunks against whole
# ones and the reverse; a later query chunk against an earlier key chunk, causal with an offset),
# and lengths off the tile sizes.
BLOCKS = [(64, 128, False, 0), (128, 64, False, 0), (100, 37, False, 0), (96, 160, True, 64),
          (130, 130, True, 0), (65, 200, True, 135), (200, 65, True, 3), (256, 512, True, 0)]


@pytest.mark.cuda
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_blocks_of_other_lengths_and_offsets(gpu, rng, bwd, block, d, dtype):
    _fused_runs(bwd, dtype, d)
    tq, tk, causal, offset = block
    q, g = (rand((2, 3, tq, d), dtype, rng) for _ in range(2))
    k, v = (rand((2, 3, tk, d), dtype, rng) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    out, lse = gpu.attention_fwd(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), scale, causal=causal, offset=offset)
    rout, rlse = cpu.attention_fwd(f64(q), f64(k), f64(v), scale, causal=causal, offset=offset)
    close(gpu, out, rout, dtype, factor=5 if dtype == np.float32 else 1)
    close(gpu, lse, rlse, np.float32, factor=5)
    grads = gpu.attention_bwd(gpu.asarray(g), gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), out, lse, scale,
                              causal=causal, offset=offset)
    refs = cpu.attention_bwd(f64(g), f64(q), f64(k), f64(v), f64(gpu.to_numpy(out)), f64(gpu.to_numpy(lse)), scale,
                             causal=causal, offset=offset)
    for got, ref in zip(grads, refs):
        close(gpu, got, ref, dtype, factor=10 if dtype == np.float32 else 2)


@pytest.mark.cuda
@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_context_parallel_blocks_on_the_gpu_equal_full_causal_attention(gpu, rng, zigzag, dtype):
    """Ring attention's blocks and merge, every rank of W = 4 in one process on the GPU (the
    kernels for unequal lengths and full blocks), equal causal attention over the whole sequence."""
    from kiln.distributed.context_parallel import _backward_blocks, _forward_blocks, sequence_slices
    w, b, h, t, d = 4, 2, 3, 512, 64
    scale = 1.0 / math.sqrt(d)
    q, k, v, g = (rand((b, h, t, d), dtype, rng) for _ in range(4))
    xp = gpu.xp
    shard = [np.concatenate([np.arange(s.start, s.stop) for s in sequence_slices(t, r, w, zigzag)]) for r in range(w)]
    kv = [gpu.asarray(np.stack([k[:, :, i], v[:, :, i]])) for i in shard]
    rout, rlse = cpu.attention_fwd(f64(q), f64(k), f64(v), scale)
    rgrads = cpu.attention_bwd(f64(g), f64(q), f64(k), f64(v), rout, rlse, scale)
    dkv = [xp.zeros((2, b, h, t // w, d), dtype=xp.float32) for _ in range(w)]
    dq = np.zeros((b, h, t, d))
    for r in range(w):
        qr, gr = gpu.asarray(q[:, :, shard[r]]), gpu.asarray(g[:, :, shard[r]].astype(np.float32))
        out = xp.zeros(qr.shape, dtype=xp.float32)
        lse = xp.full(qr.shape[:-1], -xp.inf, dtype=xp.float32)
        for source in range(w):
            _forward_blocks(gpu, qr, kv[source], source, r, zigzag, scale, out, lse)
        close(gpu, out, rout[:, :, shard[r]], dtype, factor=5 if dtype == np.float32 else 2)
        dqr = xp.zeros(qr.shape, dtype=xp.float32)
        for source in range(w):
            _backward_blocks(gpu, gr, qr, kv[source], out, lse, source, r, zigzag, scale, dqr, dkv[source])
        dq[:, :, shard[r]] = gpu.to_numpy(dqr)
    close(gpu, dq, rgrads[0], dtype, factor=10 if dtype == np.float32 else 3)
    for i in (0, 1):
        got = np.zeros((b, h, t, d))
        for r in range(w):
            got[:, :, shard[r]] = gpu.to_numpy(dkv[r][i])
        close(gpu, got, rgrads[1 + i], dtype, factor=10 if dtype == np.float32 else 3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_is_bitwise_repeatable(gpu, rng, bwd, dtype):
    """Two runs of the forward and backward on the same inputs give the same bits (no atomics). The
    fused backward's dQ adds in the hardware's order: its dq is only close, everything else the same bits."""
    _fused_runs(bwd, dtype, 64)
    shape = (2, 4, 300, 64)
    q, k, v, g = (gpu.asarray(rand(shape, dtype, rng)) for _ in range(4))
    runs = []
    for _ in range(2):
        out, lse = gpu.attention_fwd(q, k, v, 0.125)
        runs.append([gpu.to_numpy(a) for a in (out, lse, *gpu.attention_bwd(g, q, k, v, out, lse, 0.125))])
    for i, (a, b_) in enumerate(zip(*runs)):
        if bwd == "fused-bulk" and i == 2:
            close(gpu, a.astype(np.float64), b_.astype(np.float64), dtype)
        else:
            assert np.array_equal(a.view(np.uint8), b_.view(np.uint8))


# the paper's shapes and context parallelism's blocks of other lengths and offsets
FUSED_SHAPES = [((16, 12, 1024, 1024, 64), True, 0), ((4, 16, 2048, 2048, 128), True, 0),
                ((2, 3, 200, 65, 64), True, 3), ((2, 3, 65, 200, 128), True, 135), ((2, 3, 100, 37, 64), False, 0),
                ((2, 3, 256, 512, 64), True, 0), ((2, 3, 96, 160, 128), True, 64)]


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["fused-bulk", "split-tma", "fused-tma"])
@pytest.mark.parametrize("shape, causal, offset", FUSED_SHAPES)
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
def test_attention_bwd_variant_equals_split(gpu, rng, monkeypatch, variant, shape, causal, offset, dtype):
    """The fused backward, and split-tma's kernels (two consumer warpgroups of 64 rows, the streamed tiles by
    TMA: the one-warpgroup kernels' products over the same 64-row tiles in the same order), against the split
    kernels on the same inputs, within the dtype's tolerance and elementwise within a few ulps (a query tile that
    missed a key block's contribution is off by far more; one never written stays NaN: dq, dk, dv are written
    into NaN-filled destinations)."""
    b, h, tq, tk, d = shape
    _fused_runs(variant, dtype, d)
    xp = gpu.xp
    q, g = (gpu.asarray(rand((b, h, tq, d), dtype, rng)) for _ in range(2))
    k, v = (gpu.asarray(rand((b, h, tk, d), dtype, rng)) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    out, lse = gpu.attention_fwd(q, k, v, scale, causal=causal, offset=offset)
    grads = {}
    for name in ("split", variant):
        monkeypatch.setenv("KILN_ATTENTION_BWD", name)
        into = tuple(xp.full(a.shape, xp.nan, dtype=a.dtype) for a in (q, k, v))
        grads[name] = [gpu.to_numpy(a).astype(np.float64) for a in
                       gpu.attention_bwd(g, q, k, v, out, lse, scale, into=into, causal=causal, offset=offset)]
    eps = float(ml_dtypes.finfo(dtype).eps)  # both round the same fp32 sums (up to order) to dtype: a few ulps apart
    for got, ref in zip(grads[variant], grads["split"]):
        close(gpu, got, ref, dtype)
        bound = 4 * eps * (np.abs(ref) + 0.05 * np.abs(ref).max())
        assert (np.abs(got - ref) <= bound).all(), f"{(np.abs(got - ref) > bound).sum()} elements off"


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["split-tma", "fused-tma"])
def test_attention_bwd_tma_is_bitwise_repeatable(gpu, rng, monkeypatch, variant):
    """split-tma's blocks take their jobs from a ticket, in whatever order they free up: a job's sums do not
    depend on the block that runs it, so two backwards give the same bits (1536 jobs a kernel, over 11 an SM);
    fused-tma's dQ additions into a tile wait for their turn, so theirs do not depend on it either."""
    monkeypatch.setenv("KILN_ATTENTION_BWD", variant)
    q, k, v, g = (gpu.asarray(rand((16, 12, 1024, 64), ml_dtypes.bfloat16, rng)) for _ in range(4))
    out, lse = gpu.attention_fwd(q, k, v, 0.125)
    first, second = ([gpu.to_numpy(a).view(np.uint16) for a in gpu.attention_bwd(g, q, k, v, out, lse, 0.125)]
                     for _ in range(2))
    for a, b in zip(first, second):
        assert np.array_equal(a, b)


def test_attention_bwd_variant_is_named_by_the_environment(monkeypatch):
    from kiln.backend.cuda.attention import bwd_variant
    from kiln.errors import ConfigError
    monkeypatch.delenv("KILN_ATTENTION_BWD", raising=False)
    assert bwd_variant() == "auto"
    monkeypatch.setenv("KILN_ATTENTION_BWD", "fused-bulk")
    assert bwd_variant() == "fused-bulk"
    monkeypatch.setenv("KILN_ATTENTION_BWD", "fused")  # the ordered fused backward, removed on 2026-12-06
    with pytest.raises(ConfigError, match="one of auto, split, fused-bulk, split-tma, fused-tma, got 'fused'"):
        bwd_variant()


def test_attention_bwd_auto_takes_fused_tma_at_long_head_dim_64_and_split_tma_else(monkeypatch):
    from kiln.backend.cuda.attention import FUSED_TMA_MIN_QUERIES as LONG, bwd_kernels
    monkeypatch.delenv("KILN_ATTENTION_BWD", raising=False)
    assert bwd_kernels(True, 64, LONG - 1) == "split-tma"
    assert bwd_kernels(True, 64, LONG) == "fused-tma"
    assert bwd_kernels(True, 128, LONG) == "split-tma"
    assert bwd_kernels(True, 48, LONG) == "split"
    assert bwd_kernels(False, 64, LONG) == "split"  # float32: the CUDA-core kernels
    monkeypatch.setenv("KILN_ATTENTION_BWD", "split")
    assert bwd_kernels(True, 64, LONG) == "split"
    monkeypatch.setenv("KILN_ATTENTION_BWD", "split-tma")
    assert bwd_kernels(True, 64, LONG) == "split-tma"
    assert bwd_kernels(True, 128, 1024) == "split-tma"
    assert bwd_kernels(True, 48, 1024) == "split"
    monkeypatch.setenv("KILN_ATTENTION_BWD", "fused-tma")
    assert bwd_kernels(True, 64, 512) == "fused-tma"
    assert bwd_kernels(True, 128, LONG) == "split-tma"  # the fused dQ reads K from shared memory at head dim 64 only
    assert bwd_kernels(False, 64, LONG) == "split"
    monkeypatch.setenv("KILN_ATTENTION_BWD", "fused-bulk")
    assert bwd_kernels(True, 128, 1024) == "fused-bulk"
    assert bwd_kernels(True, 48, 1024) == "split"


@pytest.mark.cuda
def test_attention_bwd_fused_masks_keys_past_the_last_in_ds(gpu, rng, monkeypatch):
    """Full attention over 37 keys with q and k anti-aligned, so every lse is about -15: a key past n_k
    (zero-filled, S = 0) would give dS = -exp(-lse)·delta, beyond fp16's range, and inf·0 = NaN in every
    dQ of its query row, unless the fused kernel masks it as the split dQ kernel does."""
    b, h, n_q, n_k, d = 1, 2, 100, 37, 64
    u = rng.standard_normal((b, h, 1, d))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    q = gpu.asarray((12 * u + 0.1 * rng.standard_normal((b, h, n_q, d))).astype(np.float16))
    k = gpu.asarray((-12 * u + 0.1 * rng.standard_normal((b, h, n_k, d))).astype(np.float16))
    v, g = gpu.asarray(rand((b, h, n_k, d), np.float16, rng)), gpu.asarray(rand((b, h, n_q, d), np.float16, rng))
    scale = 1.0 / math.sqrt(d)
    out, lse = gpu.attention_fwd(q, k, v, scale)
    assert gpu.to_numpy(lse).max() < -10  # exp(-lse)·|delta| past fp16's 65504 for a typical delta
    grads = {}
    for variant in ("split", "fused-bulk"):
        monkeypatch.setenv("KILN_ATTENTION_BWD", variant)
        grads[variant] = [gpu.to_numpy(a) for a in gpu.attention_bwd(g, q, k, v, out, lse, scale)]
    for got, ref in zip(grads["fused-bulk"], grads["split"]):
        assert np.isfinite(got).all()
        close(gpu, got.astype(np.float64), ref.astype(np.float64), np.float16)


@pytest.mark.cuda
def test_attention_bwd_fused_replays_in_a_captured_graph(monkeypatch):
    """The fused backward's dQ accumulator is zeroed on kiln's stream, so a captured step zeroes it on every
    replay: three replays on new inputs equal the step run op by op, bit for bit but dq, which is summed in
    the hardware's order: within bf16's tolerance (a stale accumulator would carry the last replay's)."""
    if not kiln.cuda_is_available():
        pytest.skip("needs an NVIDIA GPU with CuPy")
    from kiln.graph import CapturedStep
    monkeypatch.setenv("KILN_ATTENTION_BWD", "fused-bulk")
    rng = np.random.default_rng()

    q, k, v = (kiln.tensor(rand((2, 4, 512, 64), ml_dtypes.bfloat16, rng), device="cuda", requires_grad=True)
               for _ in range(3))

    def step(g):
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(g)
        grads = (q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
        return (out, *grads)

    graph = CapturedStep(step)
    for _ in range(4):  # the first call captures, the rest replay
        g = kiln.tensor(rand((2, 4, 512, 64), ml_dtypes.bfloat16, rng), device="cuda")
        got = [t.numpy() for t in graph(g)]
        want = [t.numpy() for t in step(g)]
        for i, (a, b_) in enumerate(zip(got, want)):
            if i == 1:
                np.testing.assert_allclose(a.astype(np.float32), b_.astype(np.float32), rtol=2e-2, atol=2e-2)
            else:
                assert np.array_equal(a.view(np.uint8), b_.view(np.uint8))
    assert graph.captured
    graph.release()


def test_attention_bwd_fused_sizes():
    """The fused kernel's dynamic shared memory (Q and dO twice, K, dS, dQ's two fp32 stages to reduce from and
    the alignment) fits a block, and the delta kernel's rows per block follow from 16-byte loads."""
    from kiln.backend.cuda.attention import delta_rows_per_block, fused_shared_bytes
    assert fused_shared_bytes(64) == 4 * 8192 + 8192 + 8192 + 2 * 64 * 64 * 4 + 1024 == 82944
    assert fused_shared_bytes(128) == 4 * 4096 + 16384 + 2048 + 2 * 16 * 128 * 4 + 1024 == 52224
    assert [delta_rows_per_block(d, 2) for d in (32, 64, 128)] == [64, 32, 16]
    assert [delta_rows_per_block(d, 4) for d in (32, 64, 128)] == [32, 16, 8]


def test_attention_rejects_a_negative_causal_offset_and_mismatched_blocks():
    from kiln.backend.cuda.attention import _mask_offset
    q, k = np.zeros((1, 2, 4, 8)), np.zeros((1, 2, 6, 8))
    assert _mask_offset(q, k, False, 0) == 6 and _mask_offset(q, k, True, 2) == 2
    with pytest.raises(ShapeError, match="offset .* must be >= 0, got -1"):
        _mask_offset(q, k, True, -1)
    with pytest.raises(ShapeError, match="k, v"):
        _mask_offset(q, np.zeros((1, 3, 6, 8)), True, 0)


# --- the bf16/fp16 forward kernels (KILN_ATTENTION_FWD): flash-attention 3's structure, the default, -----
# --- and the one-warpgroup kernel (the other tests run the default) ----------------------------------

TMA_DTYPES = [ml_dtypes.bfloat16, np.float16]
TMA_DTYPE_IDS = ["bf16", "fp16"]


@pytest.fixture(params=["tma", "tma-pingpong", "wgmma"])
def tma(request, monkeypatch):
    """Each test of this section runs with each forward: the TMA kernel with its consumers interleaved freely
    or by turns, and the one-warpgroup kernel."""
    monkeypatch.setenv("KILN_ATTENTION_FWD", request.param)
    return request.param


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 3, 65, 64), (1, 2, 200, 128), (1, 12, 1024, 64), (4, 12, 512, 64),
                                   (1, 4, 2048, 128), (4, 8, 600, 128),
                                   pytest.param((1, 1, 16384, 64), marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=TMA_DTYPE_IDS)
def test_attention_fwd_tma_matches_the_cpu_reference(gpu, rng, tma, shape, causal, dtype):
    """4x12x512x64 (192 jobs of 128 rows) and 4x8x600x128 (160) are more jobs than an H200 has SMs
    (132): the persistent blocks carry the K/V ring and Q's barriers from job to job."""
    q, k, v = (rand(shape, dtype, rng) for _ in range(3))
    scale = 1.0 / math.sqrt(shape[-1])
    out, lse = gpu.attention_fwd(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), scale, causal=causal)
    rout, rlse = cpu.attention_fwd(f64(q), f64(k), f64(v), scale, causal=causal)
    close(gpu, out, rout, dtype)
    close(gpu, lse, rlse, np.float32, factor=5)


@pytest.mark.cuda
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", TMA_DTYPES, ids=TMA_DTYPE_IDS)
def test_attention_fwd_tma_blocks_of_other_lengths_and_offsets(gpu, rng, tma, block, d, dtype):
    tq, tk, causal, offset = block
    q = rand((2, 3, tq, d), dtype, rng)
    k, v = (rand((2, 3, tk, d), dtype, rng) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    out, lse = gpu.attention_fwd(gpu.asarray(q), gpu.asarray(k), gpu.asarray(v), scale, causal=causal, offset=offset)
    rout, rlse = cpu.attention_fwd(f64(q), f64(k), f64(v), scale, causal=causal, offset=offset)
    close(gpu, out, rout, dtype)
    close(gpu, lse, rlse, np.float32, factor=5)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16, 12, 1024, 64), (8, 16, 1024, 64), (4, 32, 2048, 128)])
@pytest.mark.parametrize("variant", ["tma", "tma-pingpong"])
def test_attention_fwd_tma_agrees_with_the_one_warpgroup_forward_at_the_papers_shapes(gpu, rng, monkeypatch,
                                                                                     shape, variant):
    """At the paper's whole shapes (too large for the float64 reference) against the one-warpgroup kernel."""
    q, k, v = (gpu.asarray(rand(shape, ml_dtypes.bfloat16, rng)) for _ in range(3))
    scale = 1.0 / math.sqrt(shape[-1])
    monkeypatch.setenv("KILN_ATTENTION_FWD", "wgmma")
    ref, rlse = (gpu.to_numpy(a).astype(np.float64) for a in gpu.attention_fwd(q, k, v, scale))
    monkeypatch.setenv("KILN_ATTENTION_FWD", variant)
    out, lse = gpu.attention_fwd(q, k, v, scale)
    close(gpu, out, ref, ml_dtypes.bfloat16)
    close(gpu, lse, rlse, np.float32, factor=5)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_attention_fwd_tma_reads_packed_views_and_is_bitwise_repeatable(gpu, rng, tma, d):
    """q, k, v as views of one [B, T, 3, H, D] buffer give, bit for bit, what contiguous copies
    give, and two runs give the same bits."""
    b, h, t = 2, 3, 300
    xp = gpu.xp
    qkv = gpu.asarray(rand((b, t, 3, h, d), ml_dtypes.bfloat16, rng))
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    runs = [[gpu.to_numpy(a) for a in gpu.attention_fwd(q, k, v, 0.125)] for _ in range(2)]
    runs.append([gpu.to_numpy(a) for a in gpu.attention_fwd(*(xp.ascontiguousarray(a) for a in (q, k, v)), 0.125)])
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            assert np.array_equal(a.view(np.uint8), b_.view(np.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
def test_attention_fwd_reads_a_broadcast_k_and_v_that_tma_cannot_map(gpu, rng, tma, d):
    """k and v broadcast over the heads (stride 0, as an expanded grouped-query k/v would be): TMA cannot
    map a zero stride, so the TMA variants run the one-warpgroup kernel, which reads it in place."""
    xp = gpu.xp
    q = rand((2, 4, 200, d), ml_dtypes.bfloat16, rng)
    k1, v1 = (rand((2, 1, 200, d), ml_dtypes.bfloat16, rng) for _ in range(2))
    k, v = (xp.broadcast_to(gpu.asarray(a), q.shape) for a in (k1, v1))
    assert k.strides[1] == 0
    out, lse = gpu.attention_fwd(gpu.asarray(q), k, v, 0.125)
    rout, rlse = cpu.attention_fwd(f64(q), f64(np.broadcast_to(k1, q.shape)), f64(np.broadcast_to(v1, q.shape)), 0.125)
    close(gpu, out, rout, ml_dtypes.bfloat16)
    close(gpu, lse, rlse, np.float32, factor=5)


def test_attention_fwd_variant_is_named_by_the_environment(monkeypatch):
    from kiln.backend.cuda.attention import fwd_variant
    from kiln.errors import ConfigError
    monkeypatch.delenv("KILN_ATTENTION_FWD", raising=False)
    assert fwd_variant() == "tma-pingpong"
    monkeypatch.setenv("KILN_ATTENTION_FWD", "wgmma")
    assert fwd_variant() == "wgmma"
    monkeypatch.setenv("KILN_ATTENTION_FWD", "fa3")
    with pytest.raises(ConfigError, match="one of tma-pingpong, tma, wgmma, got 'fa3'"):
        fwd_variant()


def test_attention_dkdv_tiles_are_the_defaults_or_what_the_tuning_knob_names(monkeypatch):
    from kiln.backend.cuda.attention import _dkdv_tiles
    from kiln.errors import ConfigError
    monkeypatch.delenv("KILN_ATTENTION_DKDV_TILES", raising=False)
    assert _dkdv_tiles() == {64: (64, 1), 128: (32, 1)}
    monkeypatch.setenv("KILN_ATTENTION_DKDV_TILES", "64:32x3, 128:16x1")
    assert _dkdv_tiles() == {64: (32, 3), 128: (16, 1)}
    for bad in ("64:48x1", "96:32x1", "64:32", "64:32x5", "x"):
        monkeypatch.setenv("KILN_ATTENTION_DKDV_TILES", bad)
        with pytest.raises(ConfigError, match="HEAD_DIM:ROWSxBLOCKS"):
            _dkdv_tiles()


def test_attention_bwd_tma_fits_in_shared_memory():
    """The split-tma kernels' stages, lse/delta, the consumers' K and V tiles (dK/dV at head dim 128) or a job's
    rows (head dim 64), mbarriers and job slot fit the H200's 227 KiB a block."""
    from kiln.backend.cuda.attention import BWD_TMA_HEAD_DIMS, bwd_tma_shared_bytes
    assert [bwd_tma_shared_bytes(d) for d in BWD_TMA_HEAD_DIMS] == [117864, 199784]
    assert all(bwd_tma_shared_bytes(d) <= 227 * 1024 for d in BWD_TMA_HEAD_DIMS)


def test_attention_bwd_fused_tma_fits_in_shared_memory():
    """The fused dK/dV/dQ kernel's split-tma layout, dSᵀ tiles, dQ stages and their barriers fit 227 KiB."""
    from kiln.backend.cuda.attention import FUSED_TMA_HEAD_DIMS, fused_tma_shared_bytes
    assert [fused_tma_shared_bytes(d) for d in FUSED_TMA_HEAD_DIMS] == [184416]
    assert all(fused_tma_shared_bytes(d) <= 227 * 1024 for d in FUSED_TMA_HEAD_DIMS)


def test_attention_fwd_tma_fits_in_shared_memory():
    """Q, the K/V stages, the mbarriers and the job slot fit the H200's 227 KiB of shared memory a
    block, with the 1024 bytes that align the swizzled tiles."""
    from kiln.backend.cuda.attention import TMA_HEAD_DIMS, tma_shared_bytes
    assert [tma_shared_bytes(d) for d in TMA_HEAD_DIMS] == [148568, 230472]
    assert all(tma_shared_bytes(d) <= 227 * 1024 for d in TMA_HEAD_DIMS)


def test_attention_kernels_group_heads_by_the_jobs_a_block_takes():
    """Head groups of about 4 jobs a running block, of even size: the TMA forward (132 blocks) at GPT-2's
    192 heads and T 1024 (8 jobs a head) in 3 groups of 64; at T 16384 (128 jobs a head, 24 heads) 5 groups
    of 5 (the last 4); the split kernels' 396 slots at 64-row blocks; never fewer than 1 or more than all."""
    from kiln.backend.cuda.attention import head_group
    assert head_group(192, 8, 132) == 64
    assert head_group(24, 128, 132) == 5
    assert head_group(192, 16, 396) == 96
    assert head_group(12, 8, 132) == 12
    assert head_group(1, 1, 132) == 1
    assert head_group(4, 1 << 14, 132) == 1
    assert head_group(5, 0, 132) == 5


def test_tma_map_strides_of_packed_views_and_unit_axes():
    """A [B, H, T, D] view of a packed [B, T, 3, H, D] bf16 buffer keeps its strides; an axis of
    length 1 gets the extent of the axes inside it; strides TMA cannot take are refused."""
    from kiln.backend.cuda.tma import strides_bytes
    b, t, h, d = 2, 5, 3, 64
    view = np.zeros((b, t, 3, h, d), dtype=np.float16)[:, :, 0].transpose(0, 2, 1, 3)
    assert strides_bytes(view.shape, view.strides, 2) == [3 * h * d * 2, d * 2, t * 3 * h * d * 2]
    one = np.zeros((1, 1, t, d), dtype=np.float16)
    assert strides_bytes(one.shape, one.strides, 2) == [d * 2, t * d * 2, t * d * 2]
    with pytest.raises(ShapeError, match="multiples of 16 bytes, got 72 bytes"):
        strides_bytes((1, 1, 4, 32), (0, 0, 72, 2), 2)


def _cuda_h_enum(text: str, typedef: str) -> dict:
    """{name: value} of `typedef enum ... { ... } typedef;` in cuda.h (implicit values count on)."""
    import re
    body = re.search(r"typedef enum \w+\s*\{([^}]*)\}\s*" + typedef + r"\s*;", text).group(1)
    out, nxt = {}, 0
    for entry in re.sub(r"//[^\n]*|/\*.*?\*/", "", body, flags=re.S).split(","):
        if entry.strip():
            name, _, value = entry.partition("=")
            nxt = int(value.strip(), 0) if value.strip() else nxt
            out[name.strip()] = nxt
            nxt += 1
    return out


def test_tma_map_arguments_are_cuda_h_values_for_the_kernels_boxes():
    """cuTensorMapEncodeTiled's arguments, hand-computed: a contiguous bf16 [2, 3, 300, 64] and a
    packed fp16 [B, T, 3, H, 128] view, Q's boxes of 128 rows; the enum values are cuda.h's own
    (read from the header NVRTC compiles against)."""
    from pathlib import Path

    from kiln.backend.cuda import compiler
    from kiln.backend.cuda.tma import encode_arguments
    a = np.zeros((2, 3, 300, 64), dtype=ml_dtypes.bfloat16)
    assert encode_arguments(a.shape, a.strides, "bfloat16", 2, 128) == (
        9, 4, (64, 300, 3, 2), (128, 300 * 128, 3 * 300 * 128), (64, 128, 1, 1), (1, 1, 1, 1), 0, 3, 2, 0)
    b, t, h, d = 2, 5, 3, 128
    view = np.zeros((b, t, 3, h, d), dtype=np.float16)[:, :, 1].transpose(0, 2, 1, 3)
    row, head, batch = 3 * h * d * 2, d * 2, t * 3 * h * d * 2
    assert encode_arguments(view.shape, view.strides, "float16", 2, 128) == (
        6, 4, (d, t, h, b), (row, head, batch), (64, 128, 1, 1), (1, 1, 1, 1), 0, 3, 2, 0)
    headers = [Path(p) / "cuda.h" for p in compiler.cuda_include_dirs() if (Path(p) / "cuda.h").exists()]
    if not headers:
        pytest.skip("cuda.h not found (pip install nvidia-cuda-runtime)")
    text = headers[0].read_text(errors="replace")
    types = _cuda_h_enum(text, "CUtensorMapDataType")
    assert (types["CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"], types["CU_TENSOR_MAP_DATA_TYPE_FLOAT16"]) == (9, 6)
    assert _cuda_h_enum(text, "CUtensorMapInterleave")["CU_TENSOR_MAP_INTERLEAVE_NONE"] == 0
    assert _cuda_h_enum(text, "CUtensorMapSwizzle")["CU_TENSOR_MAP_SWIZZLE_128B"] == 3
    assert _cuda_h_enum(text, "CUtensorMapL2promotion")["CU_TENSOR_MAP_L2_PROMOTION_L2_128B"] == 2
    assert _cuda_h_enum(text, "CUtensorMapFloatOOBfill")["CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE"] == 0


def test_tma_map_arguments_refuse_what_the_driver_would():
    """Empty dimensions, strides at 2^40, boxes past 256 rows and other dtypes get kiln's message,
    not a bare CUDA_ERROR_INVALID_VALUE from the driver."""
    from kiln.backend.cuda.tma import encode_arguments
    with pytest.raises(ShapeError, match="every dimension in 1..2\\^31, got shape \\(2, 3, 0, 64\\)"):
        encode_arguments((2, 3, 0, 64), (0, 0, 128, 2), "bfloat16", 2, 128)
    with pytest.raises(ShapeError, match="strides below 2\\^40"):
        encode_arguments((2, 1, 4, 64), (2**40, 512, 128, 2), "bfloat16", 2, 128)
    with pytest.raises(ShapeError, match="at most 256 rows, got 512"):
        encode_arguments((1, 1, 4, 64), (512, 512, 128, 2), "float16", 2, 512)
    with pytest.raises(ShapeError, match="bfloat16 or float16, got float32"):
        encode_arguments((1, 1, 4, 64), (1024, 1024, 256, 4), "float32", 4, 128)


@pytest.mark.cuda
def test_attention_fwd_tma_of_no_query_rows_is_empty(gpu, rng, tma):
    """No query rows: nothing launched and no tensor map encoded (TMA refuses an empty dimension),
    as the default forward returns empty arrays."""
    k, v = (gpu.asarray(rand((2, 3, 5, 64), ml_dtypes.bfloat16, rng)) for _ in range(2))
    out, lse = gpu.attention_fwd(gpu.asarray(np.zeros((2, 3, 0, 64), ml_dtypes.bfloat16)), k, v, 0.125)
    assert out.shape == (2, 3, 0, 64) and lse.shape == (2, 3, 0)


# --- float32 under tf32 products (matmul precision "tf32": the *_tf32 kernels) ---------------------

TF32_FWD, TF32_BWD = 2e-3, 5e-3  # ||gpu - ref|| / ||ref|| against the fp64 CPU reference: tf32 operands


@pytest.fixture
def tf32(gpu):
    """The cuda backend with its matmul precision "tf32" (conftest sets "fp32" back after every test)."""
    gpu.set_matmul_precision("tf32")
    return gpu


def _tf32_case(gpu, rng, q_shape, k_shape, causal=True, offset=0):
    """The tf32 forward and backward against the CPU reference, and against the strict fp32 kernels: not their
    bits (the products did round to tf32)."""
    q, g = (rand(q_shape, np.float32, rng) for _ in range(2))
    k, v = (rand(k_shape, np.float32, rng) for _ in range(2))
    scale = 1.0 / math.sqrt(q_shape[-1])
    args = [gpu.asarray(a) for a in (q, k, v)]
    out, lse = gpu.attention_fwd(*args, scale, causal=causal, offset=offset)
    rout, rlse = cpu.attention_fwd(f64(q), f64(k), f64(v), scale, causal=causal, offset=offset)
    assert rel(gpu.to_numpy(out), rout) < TF32_FWD
    assert rel(gpu.to_numpy(lse), rlse) < TF32_FWD
    grads = gpu.attention_bwd(gpu.asarray(g), *args, out, lse, scale, causal=causal, offset=offset)
    refs = cpu.attention_bwd(f64(g), f64(q), f64(k), f64(v), f64(gpu.to_numpy(out)), f64(gpu.to_numpy(lse)), scale,
                             causal=causal, offset=offset)
    for got, ref in zip(grads, refs):
        assert rel(gpu.to_numpy(got), ref) < TF32_BWD
    gpu.set_matmul_precision("fp32")
    strict, _ = gpu.attention_fwd(*args, scale, causal=causal, offset=offset)
    gpu.set_matmul_precision("tf32")
    assert rel(gpu.to_numpy(strict), rout) < 1e-5 < rel(gpu.to_numpy(out), rout)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 1, 3, 64), (2, 3, 65, 64), (1, 2, 200, 128), (1, 1, 33, 32), (4, 12, 256, 64),
                                   pytest.param((4, 12, 1024, 64), marks=pytest.mark.slow),
                                   pytest.param((1, 2, 2048, 128), marks=pytest.mark.slow)])
def test_attention_under_tf32_matches_the_cpu_reference(tf32, rng, shape):
    _tf32_case(tf32, rng, shape, shape)


@pytest.mark.cuda
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("d", [32, 64, 128])
def test_attention_under_tf32_blocks_of_other_lengths_and_offsets(tf32, rng, block, d):
    tq, tk, causal, offset = block
    _tf32_case(tf32, rng, (2, 3, tq, d), (2, 3, tk, d), causal, offset)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [32, 64, 128])
def test_attention_under_tf32_reads_packed_views_and_is_bitwise_repeatable(tf32, rng, d):
    """q, k, v as views of one [B, T, 3, H, D] buffer, dq, dk, dv written into views of one packed gradient:
    the same bits as contiguous operands give, and as a second run gives."""
    gpu, xp, b, h, t = tf32, tf32.xp, 2, 3, 130
    qkv = gpu.asarray(rand((b, t, 3, h, d), np.float32, rng))
    g = gpu.asarray(rand((b, t, h, d), np.float32, rng)).transpose(0, 2, 1, 3)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    runs = []
    for packed in (True, True, False):
        args = (q, k, v) if packed else tuple(xp.ascontiguousarray(a) for a in (q, k, v))
        out, lse = gpu.attention_fwd(*args, 0.125)
        dqkv = xp.zeros((b, t, 3, h, d), dtype=xp.float32)
        into = tuple(dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)) if packed else None
        grads = gpu.attention_bwd(g if packed else xp.ascontiguousarray(g), *args, out, lse, 0.125, into=into)
        runs.append([gpu.to_numpy(a) for a in (out, lse, *grads)])
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            assert np.array_equal(a.view(np.uint32), b_.view(np.uint32))


def test_attention_tf32_kernels_shared_memory():
    """The *_tf32 kernels' own 64 rows and one streamed tile (rows of D + 4 floats; dK/dV's tile with its lse
    and delta) at head dims 32, 64 and 128: at most two blocks' worth of an SM's 227 KiB at D = 128."""
    from kiln.backend.cuda.attention import tf32_shared_bytes
    assert [[tf32_shared_bytes(k, d) for k in ("fwd", "dkdv", "dq")] for d in (32, 64, 128)] == \
        [[27648, 37376, 36864], [52224, 70144, 69632], [67584, 101632, 101376]]
    assert all(tf32_shared_bytes(k, d) <= 227 * 1024 // 2 for k in ("fwd", "dkdv", "dq") for d in (32, 64, 128))
