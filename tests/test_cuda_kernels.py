"""Every CUDA kernel against the CPU backend in float64, on fresh random inputs.

Tolerances are relative, ||gpu - ref|| / ||ref||: float32 <= 1e-5, bfloat16 <= 1e-2,
float16 <= 2e-3. The inputs are rounded to the tested dtype first, so the reference sees
exactly the values the kernel sees. Every array a kernel wrapper allocates is poisoned with
NaN (the `gpu` fixture wraps CuPy's empty/empty_like), so an element a kernel forgets to
write fails the comparison. Run on a GPU machine with `pytest -m cuda`.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.backend import cpu

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU with CuPy")]

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): 1e-5, BF16: 1e-2, np.dtype(np.float16): 2e-3}
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


class _PoisonedXP:
    """CuPy, except that empty/empty_like return NaN-filled (floats) or 0x5a-filled arrays."""

    def __init__(self, xp):
        self._xp = xp

    def __getattr__(self, name):
        return getattr(self._xp, name)

    @staticmethod
    def _poison(a):
        if np.dtype(a.dtype).kind in "fV" or a.dtype == BF16:
            a.fill(np.nan)
        elif a.dtype.kind in "iu":
            a.fill(0x5a)
        return a

    def empty(self, shape, dtype=float, order="C"):
        return self._poison(self._xp.empty(shape, dtype=dtype, order=order))

    def empty_like(self, a, dtype=None, order="K", subok=None, shape=None):
        return self._poison(self._xp.empty_like(a, dtype=dtype, shape=shape))


@pytest.fixture
def gpu(monkeypatch):
    from kiln.backend.cuda import device
    backend = kiln.backend.get_backend("cuda")
    real = device.cupy
    monkeypatch.setattr(device, "cupy", lambda: _PoisonedXP(real()))
    return backend


def rand(shape, dtype, rng, scale=1.0):
    """Standard normal draws rounded to dtype (never zeros)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def rel(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), "non-finite values (an unwritten, poisoned element?)"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0))


def close(gpu, got, ref, dtype, factor=1.0):
    host = gpu.to_numpy(got) if not isinstance(got, np.ndarray) else got
    err = rel(host, ref)
    assert err <= TOL[np.dtype(dtype)] * factor, f"relative error {err:.3g} > {TOL[np.dtype(dtype)] * factor:.3g}"


@pytest.fixture
def rng():
    return np.random.default_rng()


# --- GELU ---------------------------------------------------------------------------------

GELU_SHAPES = [(7,), (3, 1001), (4, 64, 3072), pytest.param((16, 1024, 3072), marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", GELU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gelu(gpu, rng, shape, dtype):
    x, g = rand(shape, dtype, rng), rand(shape, dtype, rng)
    close(gpu, gpu.gelu_fwd(gpu.asarray(x)), cpu.gelu_fwd(f64(x)), dtype)
    close(gpu, gpu.gelu_bwd(gpu.asarray(g), gpu.asarray(x)), cpu.gelu_bwd(f64(g), f64(x)), dtype)


def test_gelu_unaligned_view(gpu, rng):
    x = rand((1027,), np.float32, rng)
    xd = gpu.asarray(x)[1:]  # 4 bytes past a 16-byte boundary: the scalar path
    close(gpu, gpu.gelu_fwd(xd), cpu.gelu_fwd(f64(x[1:])), np.float32)


# --- LayerNorm ----------------------------------------------------------------------------

LN_SHAPES = [(5, 768), (37, 100), (64, 1024), (9, 2048), (33, 1536), (3, 5000),
             pytest.param((16384, 768), marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("affine", ["weight_bias", "weight_only", "none"])
def test_layer_norm(gpu, rng, shape, dtype, affine):
    n, c = shape
    x = rand(shape, dtype, rng, 2.0) + np.asarray(0.5, dtype)
    w = rand((c,), dtype, rng) if affine != "none" else None
    b = rand((c,), dtype, rng) if affine == "weight_bias" else None
    g = rand(shape, dtype, rng)
    eps = 1e-5
    y, mean, rstd = gpu.layer_norm_fwd(gpu.asarray(x), None if w is None else gpu.asarray(w),
                                       None if b is None else gpu.asarray(b), eps)
    ry, rmean, rrstd = cpu.layer_norm_fwd(f64(x), f64(w), f64(b), eps)
    close(gpu, y, ry, dtype)
    close(gpu, mean, rmean, np.float32, factor=10)
    close(gpu, rstd, rrstd, np.float32, factor=10)
    need_dw, need_db = w is not None, b is not None
    dx, dw, db = gpu.layer_norm_bwd(gpu.asarray(g), gpu.asarray(x), None if w is None else gpu.asarray(w),
                                    mean, rstd, need_dw, need_db)
    rdx, rdw, rdb = cpu.layer_norm_bwd(f64(g), f64(x), f64(w), rmean, rrstd, need_dw, need_db)
    close(gpu, dx, rdx, dtype, factor=10 if dtype == np.float32 else 1)
    if need_dw:
        close(gpu, dw, rdw, dtype, factor=10 if dtype == np.float32 else 1)
    else:
        assert dw is None
    if need_db:
        close(gpu, db, rdb, dtype, factor=10 if dtype == np.float32 else 1)
    else:
        assert db is None


def test_layer_norm_backward_is_deterministic(gpu, rng):
    x, g, w = rand((4096, 768), np.float32, rng), rand((4096, 768), np.float32, rng), rand((768,), np.float32, rng)
    xd, gd, wd = gpu.asarray(x), gpu.asarray(g), gpu.asarray(w)
    _, mean, rstd = gpu.layer_norm_fwd(xd, wd, wd, 1e-5)
    first = [gpu.to_numpy(a) for a in gpu.layer_norm_bwd(gd, xd, wd, mean, rstd, True, True)]
    again = [gpu.to_numpy(a) for a in gpu.layer_norm_bwd(gd, xd, wd, mean, rstd, True, True)]
    for a, b in zip(first, again):
        assert np.array_equal(a, b)


# --- residual add + LayerNorm -------------------------------------------------------------

# 256 ... 1024: the register kernels forward and backward (the backward stages ds in shared
# memory by cp.async); 1536 ... 3072: the register forward only; 4096: the generic forward
# (add_layer_norm_fwd_reg stops at 3072) and backward; 100, 5000: generic. 3000 rows of 768:
# more rows than the backward's 256 blocks x 8 warps, so warps loop over rows (and reuse
# their shared-memory slot of ds).
ALN_SHAPES = [(5, 768), (11, 256), (13, 512), (37, 100), (64, 1024), (9, 2048), (33, 1536), (6, 3072),
              (3, 5000), (7, 4096), (3000, 768), pytest.param((16384, 768), marks=pytest.mark.slow)]


def _add_layer_norm_case(gpu, rng, shape, dtype, affine, with_ds, x_dev=None, y_dev=None):
    n, c = shape
    x = rand(shape, dtype, rng, 2.0) + np.asarray(0.5, dtype)
    y = rand(shape, dtype, rng)
    w = rand((c,), dtype, rng) if affine != "none" else None
    b = rand((c,), dtype, rng) if affine == "weight_bias" else None
    gs = rand(shape, dtype, rng) if with_ds else None
    gh = rand(shape, dtype, rng)
    eps = 1e-5
    xd = gpu.asarray(x) if x_dev is None else x_dev(x)
    yd = gpu.asarray(y) if y_dev is None else y_dev(y)
    s, h, mean, rstd = gpu.add_layer_norm_fwd(xd, yd, None if w is None else gpu.asarray(w),
                                              None if b is None else gpu.asarray(b), eps)
    # s is x + y in fp32 rounded once to the dtype, bit for bit what the `add` kernel stores
    s_ref = (x.astype(np.float32) + y.astype(np.float32)).astype(dtype)
    assert np.array_equal(gpu.to_numpy(s), s_ref)
    ry, rmean, rrstd = cpu.layer_norm_fwd(f64(s_ref), f64(w), f64(b), eps)
    close(gpu, h, ry, dtype)
    close(gpu, mean, rmean, np.float32, factor=10)
    close(gpu, rstd, rrstd, np.float32, factor=10)
    need_dw, need_db = w is not None, b is not None
    dx, dw, db = gpu.add_layer_norm_bwd(None if gs is None else gpu.asarray(gs), gpu.asarray(gh), s,
                                        None if w is None else gpu.asarray(w), mean, rstd, need_dw, need_db)
    rdx, rdw, rdb = cpu.add_layer_norm_bwd(f64(gs), f64(gh), f64(s_ref), f64(w), rmean, rrstd, need_dw, need_db)
    factor = 10 if dtype == np.float32 else 1
    close(gpu, dx, rdx, dtype, factor=factor)
    if need_dw:
        close(gpu, dw, rdw, dtype, factor=factor)
    else:
        assert dw is None
    if need_db:
        close(gpu, db, rdb, dtype, factor=factor)
    else:
        assert db is None


@pytest.mark.parametrize("shape", ALN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("affine", ["weight_bias", "weight_only", "none"])
@pytest.mark.parametrize("with_ds", [True, False], ids=["ds", "no_ds"])
def test_add_layer_norm(gpu, rng, shape, dtype, affine, with_ds):
    _add_layer_norm_case(gpu, rng, shape, dtype, affine, with_ds)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_layer_norm_unaligned_views(gpu, rng, dtype):
    """Rows that start 2 elements past a 16-byte boundary take the generic kernels."""
    def unaligned(a):
        flat = gpu.asarray(np.concatenate([np.zeros(2, a.dtype), a.ravel()]))
        return flat[2:].reshape(a.shape)
    _add_layer_norm_case(gpu, rng, (19, 768), dtype, "weight_bias", True, x_dev=unaligned)
    _add_layer_norm_case(gpu, rng, (19, 768), dtype, "weight_bias", True, y_dev=unaligned)


def test_add_layer_norm_backward_is_deterministic(gpu, rng):
    x, y = rand((4096, 768), np.float32, rng), rand((4096, 768), np.float32, rng)
    gs, gh, w = rand((4096, 768), np.float32, rng), rand((4096, 768), np.float32, rng), rand((768,), np.float32, rng)
    wd, gsd, ghd = gpu.asarray(w), gpu.asarray(gs), gpu.asarray(gh)
    s, _, mean, rstd = gpu.add_layer_norm_fwd(gpu.asarray(x), gpu.asarray(y), wd, wd, 1e-5)
    first = [gpu.to_numpy(a) for a in gpu.add_layer_norm_bwd(gsd, ghd, s, wd, mean, rstd, True, True)]
    again = [gpu.to_numpy(a) for a in gpu.add_layer_norm_bwd(gsd, ghd, s, wd, mean, rstd, True, True)]
    for a, b in zip(first, again):
        assert np.array_equal(a, b)


# --- softmax ------------------------------------------------------------------------------

SM_SHAPES = [(4, 10), (3, 5, 1000), (2, 1023), (8, 1024), pytest.param((64, 50304), marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", SM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_softmax(gpu, rng, shape, dtype, kind):
    x, g = rand(shape, dtype, rng, 3.0), rand(shape, dtype, rng)
    fwd, bwd = getattr(gpu, f"{kind}_fwd"), getattr(gpu, f"{kind}_bwd")
    rfwd, rbwd = getattr(cpu, f"{kind}_fwd"), getattr(cpu, f"{kind}_bwd")
    y = fwd(gpu.asarray(x))
    ry = rfwd(f64(x))
    close(gpu, y, ry, dtype)
    # The backward from the kernel's own (rounded) output, as autograd would call it.
    yh = gpu.to_numpy(y)
    close(gpu, bwd(gpu.asarray(g), y), rbwd(f64(g), f64(yh)), dtype, factor=2)


# --- cross-entropy ------------------------------------------------------------------------

CE_SHAPES = [(37, 1000), (5, 50304), (64, 1023), pytest.param((1024, 50304), marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", CE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tdtype", [np.int64, np.int32])
def test_cross_entropy(gpu, rng, shape, dtype, tdtype):
    n, v = shape
    logits = rand(shape, dtype, rng, 2.0)
    targets = rng.integers(0, v, size=n).astype(tdtype)
    targets[rng.random(n) < 0.2] = -100
    targets[0] = 3  # at least one valid target
    loss, lse = gpu.cross_entropy_fwd(gpu.asarray(logits), gpu.asarray(targets), -100)
    rloss, rlse = cpu.cross_entropy_fwd(f64(logits), targets, -100)
    assert loss.shape == () and loss.dtype == np.float32
    close(gpu, loss, rloss, np.float32, factor=10)
    close(gpu, lse, rlse, np.float32, factor=10)
    grad = np.asarray(rng.uniform(0.5, 2.0), dtype=dtype)
    dl = gpu.cross_entropy_bwd(gpu.asarray(grad), gpu.asarray(logits), gpu.asarray(targets), lse, -100)
    rdl = cpu.cross_entropy_bwd(f64(grad), f64(logits), targets, rlse, -100)
    # fp16 dlogits at a 50304 vocabulary are mostly fp16 subnormals (p ~ 1e-8 < 6.1e-5): their
    # rounding alone measured 3.0e-3 relative on the H200, so fp16 gets twice its usual bound.
    close(gpu, dl, rdl, dtype, factor=10 if dtype == np.float32 else 2 if dtype == np.float16 else 1)


def test_cross_entropy_all_ignored_is_nan(gpu, rng):
    logits = rand((4, 10), np.float32, rng)
    loss, _ = gpu.cross_entropy_fwd(gpu.asarray(logits), gpu.asarray(np.full(4, -100, np.int64)), -100)
    assert np.isnan(gpu.to_numpy(loss))


# --- embedding ----------------------------------------------------------------------------

EMB_CASES = [((7,), 11, 5), ((3, 17), 50, 768), ((4, 33), 1000, 100), ((3, 700), 300, 33),
             ((2, 1500), 64, 768), pytest.param((16, 1024), 50304, 768, marks=pytest.mark.slow)]


@pytest.mark.parametrize("idx_shape,vocab,dim", EMB_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding(gpu, rng, idx_shape, vocab, dim, dtype):
    w = rand((vocab, dim), dtype, rng)
    idx = rng.integers(0, min(vocab, 40), size=idx_shape)  # many repeats
    out = gpu.embedding_fwd(gpu.asarray(w), gpu.asarray(idx))
    assert np.array_equal(gpu.to_numpy(out).astype(np.float64), f64(w)[idx])
    g = rand(idx_shape + (dim,), dtype, rng)
    dw = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
    close(gpu, dw, cpu.embedding_bwd(f64(g), idx, vocab), dtype)
    again = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
    assert np.array_equal(gpu.to_numpy(dw).astype(np.float64), gpu.to_numpy(again).astype(np.float64))


@pytest.mark.parametrize("dist", ["zipf", "one_index", "all_distinct", "out_of_range"])
@pytest.mark.parametrize("idx_dtype", [np.int64, np.int32])
def test_embedding_bwd_skewed_indices(gpu, rng, dist, idx_dtype):
    """Real text's skew (runs longer than a segment, across rank tiles), one index only, and
    out-of-range indices (dropped), at GPT-2's shapes; bit-identical when repeated."""
    n, vocab, dim = 16 * 1024, 50304, 768
    if dist == "zipf":
        idx = np.minimum(rng.zipf(1.2, n) - 1, vocab - 1)
    elif dist == "one_index":
        idx = np.full(n, 17)
    elif dist == "all_distinct":
        idx = rng.permutation(vocab)[:n]
    else:
        idx = rng.integers(-5, vocab + 5, n)
    idx = idx.astype(idx_dtype)
    g = rand((n, dim), np.float32, rng)
    dw = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
    keep = (idx >= 0) & (idx < vocab)
    close(gpu, dw, cpu.embedding_bwd(f64(g)[keep], idx[keep], vocab), np.float32)
    again = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
    assert np.array_equal(gpu.to_numpy(dw), gpu.to_numpy(again))


# --- attention ----------------------------------------------------------------------------

ATT_SHAPES = [(1, 1, 3, 64), (2, 3, 65, 64), (1, 2, 200, 128), (1, 1, 33, 32), (2, 2, 100, 48),
              (4, 12, 256, 64),
              pytest.param((4, 12, 1024, 64), marks=pytest.mark.slow),
              pytest.param((1, 2, 2048, 128), marks=pytest.mark.slow),
              pytest.param((1, 1, 16384, 64), marks=pytest.mark.slow)]


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


# --- AdamW, gradient norm, scaling --------------------------------------------------------

ADAM_SIZES = [(1,), (3,), (70001,), (768, 3), (33, 65), (16384 + 5,)]


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


def test_adamw_fused_clip_propagates_nan(gpu, rng):
    p, g = gpu.asarray(rand((1000,), np.float32, rng)), gpu.asarray(rand((1000,), np.float32, rng))
    m, v = gpu.zeros((1000,), np.float32), gpu.zeros((1000,), np.float32)
    nan = gpu.asarray(np.asarray(np.nan, dtype=np.float32))
    gpu.adamw_step([p], [g], [m], [v], [0.0], 1e-3, 0.9, 0.95, 1e-8, 1, clip_norm=nan, max_norm=1.0)
    assert np.isnan(gpu.to_numpy(p)).all()


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


def test_grad_norm_mixed_dtypes(gpu, rng):
    a, b = rand((1000,), np.float32, rng), rand((77,), ml_dtypes.bfloat16, rng)
    norm = gpu.grad_norm([gpu.asarray(a), gpu.asarray(b)])
    close(gpu, norm, np.asarray(np.sqrt(np.sum(f64(a) ** 2) + np.sum(f64(b) ** 2))), np.float32, factor=10)


# --- random numbers and dropout -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_rng_statistics_and_state(gpu, dtype):
    gen = gpu.new_generator(1234)
    state = gpu.generator_state(gen)
    n = gpu.to_numpy(gpu.rng_normal(gen, (1000, 1001), dtype)).astype(np.float64)
    u = gpu.to_numpy(gpu.rng_uniform(gen, (1000, 1001), dtype)).astype(np.float64)
    assert abs(n.mean()) < 5e-3 and abs(n.std() - 1.0) < 5e-3
    assert abs(u.mean() - 0.5) < 5e-3 and abs(u.var() - 1 / 12) < 5e-3
    assert u.min() >= 0.0 and (u.max() < 1.0 or dtype != np.float32)
    gpu.set_generator_state(gen, state)
    again = gpu.to_numpy(gpu.rng_normal(gen, (1000, 1001), dtype)).astype(np.float64)
    assert np.array_equal(n, again)
    other = gpu.to_numpy(gpu.rng_normal(gpu.new_generator(1235), (1000, 1001), dtype)).astype(np.float64)
    assert not np.array_equal(n, other)
    import json
    json.dumps(gpu.generator_state(gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dropout(gpu, rng, dtype):
    x = rand((513, 257), dtype, rng)
    gen = gpu.new_generator(7)
    p = 0.3
    y, mask = gpu.dropout_fwd(gpu.asarray(x), p, gen)
    yh, mh = gpu.to_numpy(y).astype(np.float64), gpu.to_numpy(mask).astype(np.float64)
    keep_value = float(np.asarray(1.0 / (1.0 - p), dtype=dtype))
    assert set(np.unique(mh)) <= {0.0, keep_value}
    assert abs((mh == 0).mean() - p) < 0.01
    assert np.array_equal(yh, (x * np.asarray(mh, dtype=dtype)).astype(np.float64))
    y2, _ = gpu.dropout_fwd(gpu.asarray(x), p, gen)
    assert not np.array_equal(gpu.to_numpy(y2).astype(np.float64), yh)  # the generator moved on


# --- arrays -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64, np.int64], ids=str)
def test_asarray_roundtrip(gpu, rng, dtype):
    x = (rng.standard_normal((3, 5)) * 10).astype(dtype)
    d = gpu.asarray(x)
    assert d.dtype == np.dtype(dtype) and d.shape == x.shape
    assert np.array_equal(gpu.to_numpy(d), x)
    assert gpu.to_numpy(gpu.zeros((2, 3), dtype)).sum() == 0
    assert gpu.empty((4,), dtype).shape == (4,)


def test_scatter_add_repeated_indices(gpu, rng):
    dst = rand((10, 4), np.float32, rng)
    idx = np.array([1, 3, 1, 1, 9])
    src = rand((5, 4), np.float32, rng)
    d = gpu.asarray(dst)
    gpu.scatter_add(d, gpu.asarray(idx), gpu.asarray(src))
    ref = f64(dst)
    np.add.at(ref, idx, f64(src))
    close(gpu, d, ref, np.float32)


# --- elementwise add and casts --------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099, 3 * 2**20 + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_and_cast_match_numpy(gpu, rng, n, dtype):
    a, b = rand((n,), dtype, rng), rand((n,), dtype, rng)
    got = gpu.to_numpy(gpu.add(gpu.asarray(a), gpu.asarray(b)))
    assert np.array_equal(got, (a.astype(np.float32) + b.astype(np.float32)).astype(dtype))  # fp32 math, one rounding
    da = gpu.asarray(a)
    gpu.add(da, gpu.asarray(b), out=da)  # in place, as AccumulateGrad does
    assert np.array_equal(gpu.to_numpy(da), got)
    for to in DTYPES:
        if np.dtype(to) != np.dtype(dtype):
            ref = a.astype(np.float32).astype(to)  # round to nearest even, as astype does
            assert np.array_equal(gpu.to_numpy(gpu.cast(gpu.asarray(a), to)), ref, equal_nan=True)


def test_add_and_cast_of_unaligned_and_strided_views(gpu, rng):
    a, b = rand((2, 1001), np.float32, rng), rand((2, 1001), np.float32, rng)
    da, db = gpu.asarray(a), gpu.asarray(b)
    assert np.array_equal(gpu.to_numpy(gpu.add(da[:, 1:], db[:, 1:])), a[:, 1:] + b[:, 1:])  # strided: CuPy
    flat_a, flat_b = gpu.asarray(a.ravel()), gpu.asarray(b.ravel())
    assert np.array_equal(gpu.to_numpy(gpu.add(flat_a[1:], flat_b[1:])), a.ravel()[1:] + b.ravel()[1:])  # scalar loop
    assert np.array_equal(gpu.to_numpy(gpu.cast(flat_a[3:], BF16)), a.ravel()[3:].astype(BF16))
