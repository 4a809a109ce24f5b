"""the AdamW kernels, gradient norm and scaling on the GPU against the CPU backend (`cuda`); the optimizer itself is tests/test_optim.py."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.backend import cpu
from tests.conftest import DTYPE_IDS, close, f64, rand

# --- AdamW, gradient norm, scaling --------------------------------------------------------

ADAM_SIZES = [(1,), (3,), (70001,), (768, 3), (33, 65), (16384 + 5,)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_adamw_step_matches_cpu_over_steps(gpu, rng, dtype):
    params = [rand(s, dtype, rng) for s in ADAM_SIZES]
    wds = [0.1 if len(s) > 1 else 0.0 for s in ADAM_SIZES]
    ref_p = [f64(p) for p in params]
    ref_m = [np.zeros_like(p) for p in ref_p]
    ref_v = [np.zeros_like(p) for p in ref_p]
    dp = [gpu.asarray(p) for p in params]
    dm = [gpu.zeros(p.shape, dtype) for p in params]
    dv = [gpu.zeros(p.shape, dtype) for p in params]
    for step in range(1, 4):
        grads = [rand(s, dtype, rng) for s in ADAM_SIZES]
        lr = 1e-2 / step
        cpu.adamw_step(ref_p, [f64(g) for g in grads], ref_m, ref_v, wds, lr, 0.9, 0.95, 1e-8, step)
        gpu.adamw_step(dp, [gpu.asarray(g) for g in grads], dm, dv, wds, lr, 0.9, 0.95, 1e-8, step)
    for p, rp, m, rm, v, rv in zip(dp, ref_p, dm, ref_m, dv, ref_v):
        close(gpu, p, rp, dtype)
        close(gpu, m, rm, dtype)
        close(gpu, v, rv, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("copy_dtype", [ml_dtypes.bfloat16, np.float16], ids=["bf16", "fp16"])
def test_adamw_step_writes_the_kept_copies(gpu, rng, copy_dtype):
    """fp32 master weights with compute-dtype copies: the kernel writes each copy as the cast of its updated
    parameter (bit for bit, round to nearest even) and updates the rest as the CPU reference; a parameter
    without a copy in the same call is updated alone (its copy pointer is 0)."""
    params = [rand(s, np.float32, rng) for s in ADAM_SIZES]
    wds = [0.1 if len(s) > 1 else 0.0 for s in ADAM_SIZES]
    ref_p = [f64(p) for p in params]
    ref_m = [np.zeros_like(p) for p in ref_p]
    ref_v = [np.zeros_like(p) for p in ref_p]
    dp = [gpu.asarray(p) for p in params]
    dm = [gpu.zeros(p.shape, np.float32) for p in params]
    dv = [gpu.zeros(p.shape, np.float32) for p in params]
    dc = [None if i == 2 else gpu.asarray(rand(s, copy_dtype, rng)) for i, s in enumerate(ADAM_SIZES)]
    untouched = gpu.to_numpy(dp[2]).copy()
    for step in range(1, 3):
        grads = [rand(s, np.float32, rng) for s in ADAM_SIZES]
        cpu.adamw_step(ref_p, [f64(g) for g in grads], ref_m, ref_v, wds, 1e-2, 0.9, 0.95, 1e-8, step)
        gpu.adamw_step(dp, [gpu.asarray(g) for g in grads], dm, dv, wds, 1e-2, 0.9, 0.95, 1e-8, step, copies=dc)
    for p, rp, c in zip(dp, ref_p, dc):
        close(gpu, p, rp, np.float32)
        if c is not None:
            assert np.array_equal(gpu.to_numpy(c).view(np.uint16),
                                  gpu.to_numpy(p).astype(copy_dtype).view(np.uint16))
    assert not np.array_equal(gpu.to_numpy(dp[2]), untouched)


@pytest.mark.cuda
def test_adamw_step_on_views_of_one_flat_buffer(gpu, rng):
    sizes = [5, 1000, 3, 4096]
    flat = rand((sum(sizes),), np.float32, rng)
    grads = rand((sum(sizes),), np.float32, rng)
    dflat, dgrads = gpu.asarray(flat), gpu.asarray(grads)
    offs = np.cumsum([0] + sizes)
    views = [dflat[a:b] for a, b in zip(offs, offs[1:])]
    gviews = [dgrads[a:b] for a, b in zip(offs, offs[1:])]
    ms = [gpu.zeros((s,), np.float32) for s in sizes]
    vs = [gpu.zeros((s,), np.float32) for s in sizes]
    gpu.adamw_step(views, gviews, ms, vs, [0.1] * 4, 1e-3, 0.9, 0.999, 1e-8, 1)
    rp = [f64(flat[a:b]) for a, b in zip(offs, offs[1:])]
    cpu.adamw_step(rp, [f64(grads[a:b]) for a, b in zip(offs, offs[1:])],
                   [np.zeros(s) for s in sizes], [np.zeros(s) for s in sizes], [0.1] * 4, 1e-3, 0.9, 0.999, 1e-8, 1)
    close(gpu, dflat, np.concatenate(rp), np.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_adamw_step_with_fused_clip(gpu, rng, dtype, max_norm):
    """The clip read from the norm's device scalar inside the kernel equals scaling first."""
    sizes = ADAM_SIZES + [(50304, 768)]
    params = [rand(s, dtype, rng) for s in sizes]
    grads = [rand(s, dtype, rng, 3.0) for s in sizes]
    wds = [0.1 if len(s) > 1 else 0.0 for s in sizes]
    dp = [gpu.asarray(p) for p in params]
    dm = [gpu.zeros(p.shape, dtype) for p in params]
    dv = [gpu.zeros(p.shape, dtype) for p in params]
    dg = [gpu.asarray(g) for g in grads]
    norm = gpu.grad_norm(dg)
    ref_norm = math.sqrt(sum(float(np.sum(f64(g) ** 2)) for g in grads))
    close(gpu, norm, np.asarray(ref_norm), np.float32, factor=10)
    ref_p, ref_m, ref_v = [f64(p) for p in params], [np.zeros(s) for s in sizes], [np.zeros(s) for s in sizes]
    cpu.adamw_step(ref_p, [f64(g) for g in grads], ref_m, ref_v, wds, 1e-2, 0.9, 0.95, 1e-8, 1,
                   clip_norm=np.asarray(ref_norm), max_norm=max_norm)
    gpu.adamw_step(dp, dg, dm, dv, wds, 1e-2, 0.9, 0.95, 1e-8, 1, clip_norm=norm, max_norm=max_norm)
    for p, rp, m, rm, v, rv in zip(dp, ref_p, dm, ref_m, dv, ref_v):
        close(gpu, p, rp, dtype)
        close(gpu, m, rm, dtype)
        close(gpu, v, rv, dtype)
    for got, g in zip(dg, grads):  # the gradients are read, not rewritten
        assert np.array_equal(gpu.to_numpy(got).astype(np.float64), f64(g))


@pytest.mark.cuda
def test_adamw_fused_clip_propagates_nan(gpu, rng):
    p, g = gpu.asarray(rand((1000,), np.float32, rng)), gpu.asarray(rand((1000,), np.float32, rng))
    m, v = gpu.zeros((1000,), np.float32), gpu.zeros((1000,), np.float32)
    nan = gpu.asarray(np.asarray(np.nan, dtype=np.float32))
    gpu.adamw_step([p], [g], [m], [v], [0.0], 1e-3, 0.9, 0.95, 1e-8, 1, clip_norm=nan, max_norm=1.0)
    assert np.isnan(gpu.to_numpy(p)).all()


@pytest.mark.cuda
def test_grad_norm_of_unaligned_views_is_deterministic(gpu, rng):
    """Views at odd offsets of one flat buffer take the scalar path; 148 GPT-2-sized tensors the
    vector path; the norm is bit-identical when repeated (fixed-order finish in the last block)."""
    sizes = [5, 1000, 3, 4096, 70001]
    flat = rand((sum(sizes),), np.float32, rng)
    d = gpu.asarray(flat)
    offs = np.cumsum([0] + sizes)
    views = [d[a:b] for a, b in zip(offs, offs[1:])]
    close(gpu, gpu.grad_norm(views), np.asarray(np.linalg.norm(f64(flat))), np.float32, factor=10)
    big = [gpu.asarray(rand(s, np.float32, rng)) for s in [(50304, 768), (1024, 768)] + [(768, 3072)] * 6]
    first, second = gpu.to_numpy(gpu.grad_norm(big)), gpu.to_numpy(gpu.grad_norm(big))
    assert first.tobytes() == second.tobytes()
    ref = math.sqrt(sum(float(np.sum(gpu.to_numpy(b).astype(np.float64) ** 2)) for b in big))
    close(gpu, first, np.asarray(ref), np.float32, factor=10)


@pytest.mark.cuda
def test_optimizer_fused_clip_equals_clip_then_step(gpu, rng):
    import kiln.optim as optim
    shapes = [(64, 33), (33,), (1000, 8)]
    init = [rand(s, np.float32, rng) for s in shapes]
    grads = [rand(s, np.float32, rng, 5.0) for s in shapes]
    results = []
    for fused in (True, False):
        ps = [kiln.tensor(a, device="cuda", requires_grad=True) for a in init]
        opt = optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        for _ in range(2):
            for p, g in zip(ps, grads):
                p.grad = kiln.tensor(g, device="cuda")
            norm = opt.clip_grad_norm_(1.0) if fused else optim.clip_grad_norm_(ps, 1.0)
            opt.step()
        results.append(([p.numpy() for p in ps], float(norm.numpy())))
    (a, na), (b, nb) = results
    assert na == nb
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=DTYPE_IDS)
def test_grad_norm_and_scale(gpu, rng, dtype):
    grads = [rand(s, dtype, rng) for s in ADAM_SIZES]
    dg = [gpu.asarray(g) for g in grads]
    norm = gpu.grad_norm(dg)
    assert norm.shape == () and norm.dtype == np.float32
    ref = math.sqrt(sum(float(np.sum(f64(g) ** 2)) for g in grads))
    close(gpu, norm, np.asarray(ref), np.float32, factor=10)
    factor = gpu.asarray(np.asarray(0.37, dtype=np.float32))
    gpu.scale_(dg, factor)
    for got, g in zip(dg, grads):
        close(gpu, got, f64(g) * 0.37, dtype)


@pytest.mark.cuda
def test_grad_norm_mixed_dtypes(gpu, rng):
    a, b = rand((1000,), np.float32, rng), rand((77,), ml_dtypes.bfloat16, rng)
    norm = gpu.grad_norm([gpu.asarray(a), gpu.asarray(b)])
    close(gpu, norm, np.asarray(np.sqrt(np.sum(f64(a) ** 2) + np.sum(f64(b) ** 2))), np.float32, factor=10)
