"""LayerNorm and the residual add fused with it: the ops against PyTorch and finite differences on the CPU; the CUDA kernels against the CPU backend (`cuda`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import kiln
from kiln.backend import cpu
from kiln.errors import DTypeError, ShapeError
from kiln.nn import functional as F
from tests.conftest import BF16, DTYPE_IDS, DTYPES, close, f64, rand, rel
from tests.gradcheck import gradcheck, randn


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(bias):
    x, w, b = randn(2, 3, 6) * 3 + 1, randn(6), randn(6)
    args = (x, w, b) if bias else (x, w)
    ref = TF.layer_norm(torch.tensor(x), (6,), torch.tensor(w), torch.tensor(b) if bias else None, 1e-5)
    assert rel(F.layer_norm(*[kiln.tensor(a) for a in args]).numpy(), ref.numpy()) < 1e-13
    gradcheck(lambda *t: F.layer_norm(*t), *args)


def test_the_cpu_backward_without_a_weight_is_the_backward_with_ones():
    """The CPU reference the CUDA kernels are checked against takes weight None (an affine-free
    LayerNorm); it once read None's dtype, which only the CUDA tests reached."""
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((5, 12)).astype(np.float32), rng.standard_normal((5, 12)).astype(np.float32)
    _, mean, rstd = cpu.layer_norm_fwd(x, None, None, 1e-5)
    dx, dw, db = cpu.layer_norm_bwd(g, x, None, mean, rstd, False, False)
    dx1, _, _ = cpu.layer_norm_bwd(g, x, np.ones(12, np.float32), mean, rstd, False, False)
    assert dw is None and db is None and dx.dtype == np.float32 and np.array_equal(dx, dx1)


@pytest.mark.parametrize("bias", [True, False])
def test_add_layer_norm_matches_pytorch_and_finite_differences(bias):
    x, y, w, b = randn(2, 3, 6) * 3 + 1, randn(2, 3, 6), randn(6), randn(6)
    args = (x, y, w, b) if bias else (x, y, w)
    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    tw, tb = torch.tensor(w, requires_grad=True), torch.tensor(b, requires_grad=True)
    ts = tx + ty
    th = TF.layer_norm(ts, (6,), tw, tb if bias else None, 1e-5)
    kt = [kiln.tensor(a, requires_grad=True) for a in args]
    s, h = F.add_layer_norm(*kt)
    assert rel(s.numpy(), ts.detach().numpy()) < 1e-15
    assert rel(h.numpy(), th.detach().numpy()) < 1e-13
    gs, gh = randn(2, 3, 6), randn(2, 3, 6)
    ((s * kiln.tensor(gs)).sum() + (h * kiln.tensor(gh)).sum()).backward()
    ((ts * torch.tensor(gs)).sum() + (th * torch.tensor(gh)).sum()).backward()
    for k, t in zip(kt, (tx, ty, tw, tb)):
        assert rel(k.grad.numpy(), t.grad.numpy()) < 1e-12
    # both outputs, weighted independently (the gradient of s and of h each reach x and y)
    c = randn(2, 3, 6)
    gradcheck(lambda *t: F.add_layer_norm(*t)[0] * kiln.tensor(c) + F.add_layer_norm(*t)[1], *args)
    # only h used: s's gradient is missing (the last block of a GPT, fused with ln_f)
    gradcheck(lambda *t: F.add_layer_norm(*t)[1], *args)


def test_add_layer_norm_with_only_the_sum_used_passes_its_gradient_through():
    x, y, w, b = (kiln.tensor(a, requires_grad=True) for a in (randn(4, 5), randn(4, 5), randn(5), randn(5)))
    s, _ = F.add_layer_norm(x, y, w, b)
    g = randn(4, 5)
    (s * kiln.tensor(g)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), g)
    np.testing.assert_array_equal(y.grad.numpy(), g)
    assert not np.shares_memory(x.grad.numpy(), y.grad.numpy())
    assert w.grad is None and b.grad is None  # as with x + y and an unused layer_norm in PyTorch


def test_add_layer_norm_of_one_tensor_twice_and_of_a_non_leaf():
    x, w, b = randn(3, 8), randn(8), randn(8)
    gradcheck(lambda a, wt, bt: F.add_layer_norm(a, a, wt, bt)[1], x, w, b)
    gradcheck(lambda a, wt, bt: sum(F.add_layer_norm(a * 2.0, a.tanh(), wt, bt)), x, w, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_layer_norm_is_the_add_then_layer_norm(dtype):
    """The fused forward stores exactly what x + y then layer_norm store (s rounded to the dtype
    before it is normalised); the backward adds ds before rounding dx once, so it is at least as
    close to float64 as the unfused pair."""
    rng = np.random.default_rng()
    x, y, gs, gh = (kiln.tensor(rng.standard_normal((6, 64)), dtype=dtype) for _ in range(4))
    w, b = kiln.tensor(rng.standard_normal(64), dtype=dtype), kiln.tensor(rng.standard_normal(64), dtype=dtype)
    ref = []
    for fused in (True, False):
        ts = [t.detach().requires_grad_() for t in (x, y, w, b)]
        if fused:
            s, h = F.add_layer_norm(*ts)
        else:
            s = ts[0] + ts[1]
            h = F.layer_norm(s, ts[2], ts[3])
        ((s * gs).to(kiln.float32).sum() + (h * gh).to(kiln.float32).sum()).backward()
        ref.append([s.numpy(), h.numpy()] + [t.grad.numpy() for t in ts])
    np.testing.assert_array_equal(ref[0][0], ref[1][0])
    np.testing.assert_array_equal(ref[0][1], ref[1][1])
    tol = 1e-6 if dtype == "float32" else 1e-2
    for a, b in zip(ref[0][2:], ref[1][2:]):
        assert rel(a, b.astype(np.float64)) < tol


def test_add_layer_norm_checks_its_inputs():
    x, w = kiln.randn(2, 4), kiln.randn(4)
    with pytest.raises(ShapeError, match="one shape"):
        F.add_layer_norm(x, kiln.randn(4), w)
    # the branch may be narrower than the residual (bf16 on fp32), never wider
    with pytest.raises(DTypeError, match="a bfloat16 residual with float32 activations; allowed: the same"):
        F.add_layer_norm(x.to(kiln.bfloat16), x, w)
    with pytest.raises(DTypeError, match="a float64 residual with bfloat16 activations"):
        F.add_layer_norm(x.to(kiln.float64), x.to(kiln.bfloat16), w)
    with pytest.raises(DTypeError, match="layer_norm: a bfloat16 residual with float32 activations"):
        F.layer_norm(x.to(kiln.bfloat16), w, out_dtype=kiln.float32)
    with pytest.raises(ShapeError, match="weight and bias of shape"):
        F.add_layer_norm(x, x, kiln.randn(3))


@pytest.mark.parametrize("only_h", [False, True], ids=["s_and_h", "only_h"])
def test_add_layer_norm_of_a_bf16_branch_on_an_fp32_residual_is_autocasts(only_h):
    """torch.autocast's residual add: a bf16 branch output y added to an fp32 residual x promotes to fp32,
    the LayerNorm runs in fp32 and its output is rounded to bf16 where the next GEMM reads it; backward,
    x gets the fp32 gradient and y the same rounded to bf16. The fused op does exactly that."""
    rng = np.random.default_rng()
    n, c = 6, 64
    x = kiln.tensor(rng.standard_normal((n, c)) * 2 + 0.5, dtype="float32", requires_grad=True)
    y = kiln.tensor(rng.standard_normal((n, c)), dtype="bfloat16", requires_grad=True)
    w, b = (kiln.tensor(rng.standard_normal(c), dtype="float32", requires_grad=True) for _ in range(2))
    gs, gh = rng.standard_normal((n, c)).astype(np.float32), rng.standard_normal((n, c)).astype(BF16)
    s, h = F.add_layer_norm(x, y, w, b)
    assert s.dtype is kiln.float32 and h.dtype is kiln.bfloat16
    loss = (h.to(kiln.float32) * kiln.tensor(gh.astype(np.float32))).sum()
    if not only_h:
        loss = loss + (s * kiln.tensor(gs)).sum()
    loss.backward()
    tx, tw, tb = (torch.tensor(t.numpy(), requires_grad=True) for t in (x, w, b))
    ty = torch.tensor(y.numpy().astype(np.float32)).to(torch.bfloat16).requires_grad_()
    ts = tx + ty
    th = TF.layer_norm(ts, (c,), tw, tb, 1e-5).to(torch.bfloat16)
    tloss = (th.float() * torch.tensor(gh.astype(np.float32))).sum() + (0 if only_h else (ts * torch.tensor(gs)).sum())
    tloss.backward()
    assert np.array_equal(s.numpy(), ts.detach().numpy())  # one fp32 add, bit for bit
    # h: one bf16 rounding of the same fp32 LayerNorm (kiln's in float64 before it): at most an ulp apart
    assert rel(h.numpy().astype(np.float64), th.detach().float().numpy()) < 8e-3
    assert x.grad.dtype is kiln.float32 and y.grad.dtype is kiln.bfloat16
    assert rel(x.grad.numpy(), tx.grad.numpy()) < 1e-5
    np.testing.assert_array_equal(y.grad.numpy(), x.grad.numpy().astype(BF16))  # dy is dx rounded once
    assert rel(y.grad.numpy().astype(np.float32), ty.grad.float().numpy()) < 8e-3
    for k, t in ((w, tw), (b, tb)):
        assert k.grad.dtype is kiln.float32 and rel(k.grad.numpy(), t.grad.numpy()) < 1e-5


def test_layer_norm_of_an_fp32_residual_into_bf16():
    """The first block's ln_1 under autocast's policy: the fp32 LayerNorm, its output rounded to bf16;
    the input's gradient stays fp32."""
    rng = np.random.default_rng()
    x = kiln.tensor(rng.standard_normal((5, 32)) * 3, dtype="float32", requires_grad=True)
    w, b = (kiln.tensor(rng.standard_normal(32), dtype="float32") for _ in range(2))
    h = F.layer_norm(x, w, b, out_dtype=kiln.bfloat16)
    full = F.layer_norm(x.detach(), w, b)
    assert h.dtype is kiln.bfloat16
    np.testing.assert_array_equal(h.numpy(), full.numpy().astype(BF16))
    g = rng.standard_normal((5, 32)).astype(BF16)
    (h.to(kiln.float32) * kiln.tensor(g.astype(np.float32))).sum().backward()
    xd = x.detach().requires_grad_()
    (F.layer_norm(xd, w, b) * kiln.tensor(g.astype(np.float32))).sum().backward()
    assert x.grad.dtype is kiln.float32 and rel(x.grad.numpy(), xd.grad.numpy()) < 1e-6



def _round_to_bf16(a32):
    """fp32 -> bf16 by integer arithmetic on the bits, round to nearest even (finite values): a reference
    that does not go through ml_dtypes."""
    bits = a32.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).view(BF16)


@pytest.mark.parametrize("with_ds", [True, False], ids=["ds", "no_ds"])
def test_the_cpu_reference_rounds_the_branch_gradient_to_nearest_even(with_ds):
    """cpu.add_layer_norm_bwd with a bf16 branch: dy is the fp32 dx (unchanged by asking for dy) rounded to
    nearest even, ties included (a million elements hold some exact ties); without branch_dtype dy is dx."""
    rng = np.random.default_rng()
    n, c = 4096, 256
    s, w = rand((n, c), np.float32, rng, 2.0), rand((c,), np.float32, rng)
    gh, gs = rand((n, c), BF16, rng), rand((n, c), np.float32, rng) if with_ds else None
    _, _, mean, rstd = cpu.add_layer_norm_fwd(s, np.zeros_like(s), w, None, 1e-5, BF16)
    dx, dy, dw, _ = cpu.add_layer_norm_bwd(gs, gh, s, w, mean, rstd, True, False, None, BF16)
    dx0, dy0, dw0, _ = cpu.add_layer_norm_bwd(gs, gh, s, w, mean, rstd, True, False)
    assert dy0 is dx0 and np.array_equal(dx, dx0) and np.array_equal(dw, dw0)
    assert dx.dtype == np.float32 and dy.dtype == BF16
    assert np.count_nonzero((dx.view(np.uint32) & 0xFFFF) == 0x8000) > 0  # exact ties are in there
    assert np.array_equal(dy.view(np.uint16), _round_to_bf16(dx).view(np.uint16))


def test_a_bf16_branch_on_an_fp32_residual_gets_the_backward_kernels_gradient_not_a_cast(monkeypatch):
    """bf16 training over the fp32 residual (apply_precision's default): each output projection (attn.c_proj,
    mlp.c_proj) receives as its gradient the very bf16 array the add+LayerNorm backward returned (its dy, made
    in the pass that made dx: the CUDA `_dy` kernels), not a cast of dx made after it; that dy is dx rounded
    to nearest even."""
    from kiln.backend import get_backend
    from kiln.nn import GPT, preset
    from kiln.train import apply_precision
    backend, device = get_backend("cpu"), kiln.device("cpu")
    n_layer = 2
    model = GPT(preset("tiny", n_layer=n_layer, vocab_size=64, block_size=32), generator=kiln.Generator(5))
    rng = np.random.default_rng()
    x, y = (kiln.tensor(rng.integers(0, 64, (4, 32))) for _ in range(2))
    outs, grads_in = [], []
    real_aln, real_linear = backend.add_layer_norm_bwd, backend.linear_bwd

    def add_layer_norm_bwd(*args):
        outs.append(real_aln(*args))
        return outs[-1]

    def linear_bwd(g, *args):
        grads_in.append(g)
        return real_linear(g, *args)
    monkeypatch.setattr(backend, "add_layer_norm_bwd", add_layer_norm_bwd)
    monkeypatch.setattr(backend, "linear_bwd", linear_bwd)
    apply_precision(model, "bf16", device)
    try:
        model(x, y)[1].backward()
    finally:
        backend.set_matmul_precision("fp32")
    assert len(outs) == 2 * n_layer  # ln_2 of each block, then block 1's ln_1 and ln_f
    for dx, dy, _, _ in outs:
        assert dx.dtype == np.float32 and dy.dtype == BF16
        assert np.array_equal(dy.view(np.uint16), _round_to_bf16(dx).view(np.uint16))
        assert sum(np.shares_memory(dy, g) for g in grads_in) == 1  # handed on as it is: no cast between

# --- LayerNorm ----------------------------------------------------------------------------

LN_SHAPES = [(5, 768), (37, 100), (64, 1024), (9, 2048), (33, 1536), (3, 5000),
             pytest.param((16384, 768), marks=pytest.mark.slow)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("affine", ["weight_bias", "weight_only", "none"])
def test_layer_norm_kernels(gpu, rng, shape, dtype, affine):
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


@pytest.mark.cuda
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
    dx, dy, dw, db = gpu.add_layer_norm_bwd(None if gs is None else gpu.asarray(gs), gpu.asarray(gh), s,
                                            None if w is None else gpu.asarray(w), mean, rstd, need_dw, need_db)
    rdx, _, rdw, rdb = cpu.add_layer_norm_bwd(f64(gs), f64(gh), f64(s_ref), f64(w), rmean, rrstd, need_dw, need_db)
    assert dy is dx  # a branch of the residual's dtype: one gradient for both
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


@pytest.mark.cuda
@pytest.mark.parametrize("shape", ALN_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("affine", ["weight_bias", "weight_only", "none"])
@pytest.mark.parametrize("with_ds", [True, False], ids=["ds", "no_ds"])
def test_add_layer_norm(gpu, rng, shape, dtype, affine, with_ds):
    _add_layer_norm_case(gpu, rng, shape, dtype, affine, with_ds)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_layer_norm_unaligned_views(gpu, rng, dtype):
    """Rows that start 2 elements past a 16-byte boundary take the generic kernels."""
    def unaligned(a):
        flat = gpu.asarray(np.concatenate([np.zeros(2, a.dtype), a.ravel()]))
        return flat[2:].reshape(a.shape)
    _add_layer_norm_case(gpu, rng, (19, 768), dtype, "weight_bias", True, x_dev=unaligned)
    _add_layer_norm_case(gpu, rng, (19, 768), dtype, "weight_bias", True, y_dev=unaligned)


@pytest.mark.cuda
def test_add_layer_norm_backward_is_deterministic(gpu, rng):
    x, y = rand((4096, 768), np.float32, rng), rand((4096, 768), np.float32, rng)
    gs, gh, w = rand((4096, 768), np.float32, rng), rand((4096, 768), np.float32, rng), rand((768,), np.float32, rng)
    wd, gsd, ghd = gpu.asarray(w), gpu.asarray(gs), gpu.asarray(gh)
    s, _, mean, rstd = gpu.add_layer_norm_fwd(gpu.asarray(x), gpu.asarray(y), wd, wd, 1e-5)
    first = [gpu.to_numpy(a) for a in gpu.add_layer_norm_bwd(gsd, ghd, s, wd, mean, rstd, True, True)]
    again = [gpu.to_numpy(a) for a in gpu.add_layer_norm_bwd(gsd, ghd, s, wd, mean, rstd, True, True)]
    for a, b in zip(first, again):
        assert np.array_equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("add", [False, True], ids=["layer_norm", "add_layer_norm"])
def test_layer_norm_param_grads_in_fp32(gpu, rng, dtype, add):
    """A bf16 copy of fp32 LayerNorm parameters: dweight and dbias come out of the finish kernel in fp32
    (no bf16 rounding, no cast after), against the float64 reference at fp32's tolerance."""
    n, c = 3000, 768
    x, g = rand((n, c), dtype, rng, 2.0), rand((n, c), dtype, rng)
    w, b = rand((c,), dtype, rng), rand((c,), dtype, rng)
    xd, gd, wd, bd = gpu.asarray(x), gpu.asarray(g), gpu.asarray(w), gpu.asarray(b)
    if add:
        _, _, mean, rstd = gpu.add_layer_norm_fwd(xd, gpu.zeros((n, c), dtype), wd, bd, 1e-5)
        _, _, dw, db = gpu.add_layer_norm_bwd(None, gd, xd, wd, mean, rstd, True, True, np.float32)
    else:
        _, mean, rstd = gpu.layer_norm_fwd(xd, wd, bd, 1e-5)
        _, dw, db = gpu.layer_norm_bwd(gd, xd, wd, mean, rstd, True, True, np.float32)
    _, rdw, rdb = cpu.layer_norm_bwd(f64(g), f64(x), f64(w), f64(gpu.to_numpy(mean)), f64(gpu.to_numpy(rstd)),
                                     True, True)
    assert dw.dtype == np.float32 and db.dtype == np.float32
    close(gpu, dw, rdw, np.float32, factor=10)
    close(gpu, db, rdb, np.float32, factor=10)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(5, 768), (37, 100), (3000, 768), (7, 4096)])
@pytest.mark.parametrize("with_ds", [True, False], ids=["ds", "no_ds"])
def test_fp32_residual_with_a_bf16_branch(gpu, rng, shape, with_ds):
    """autocast's policy on the GPU: fp32 x and s, bf16 y and h (and the gradient of h), fp32 dx, against
    the CPU reference in float64; the plain LayerNorm of the fp32 residual into bf16 likewise."""
    n, c = shape
    x, w, b = rand(shape, np.float32, rng, 2.0) + np.float32(0.5), rand((c,), np.float32, rng), rand((c,), np.float32, rng)
    y, gh = rand(shape, BF16, rng), rand(shape, BF16, rng)
    gs = rand(shape, np.float32, rng) if with_ds else None
    s, h, mean, rstd = gpu.add_layer_norm_fwd(gpu.asarray(x), gpu.asarray(y), gpu.asarray(w), gpu.asarray(b), 1e-5,
                                              BF16)
    s_ref = x + y.astype(np.float32)
    assert s.dtype == np.float32 and h.dtype == BF16 and np.array_equal(gpu.to_numpy(s), s_ref)
    ry, rmean, rrstd = cpu.layer_norm_fwd(f64(s_ref), f64(w), f64(b), 1e-5)
    close(gpu, h, ry, BF16)
    dx, dy, dw, db = gpu.add_layer_norm_bwd(None if gs is None else gpu.asarray(gs), gpu.asarray(gh), s,
                                            gpu.asarray(w), mean, rstd, True, True, None, BF16)
    rdx, _, rdw, rdb = cpu.add_layer_norm_bwd(f64(gs), f64(gh), f64(s_ref), f64(w), rmean, rrstd, True, True)
    assert dx.dtype == np.float32 and dw.dtype == np.float32 and dy.dtype == BF16
    for got, ref in ((dx, rdx), (dw, rdw), (db, rdb)):
        close(gpu, got, ref, np.float32, factor=10)
    assert np.array_equal(gpu.to_numpy(dy), gpu.to_numpy(dx).astype(BF16))  # dx rounded once, as the CPU's
    y1, _, _ = gpu.layer_norm_fwd(gpu.asarray(x), gpu.asarray(w), gpu.asarray(b), 1e-5, BF16)
    assert y1.dtype == BF16
    close(gpu, y1, cpu.layer_norm_fwd(f64(x), f64(w), f64(b), 1e-5)[0], BF16)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(11, 256), (5, 768), (64, 1024), (3000, 768), (37, 100), (7, 4096)])
@pytest.mark.parametrize("branch", [BF16, np.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_ds", [True, False], ids=["ds", "no_ds"])
def test_a_narrower_branchs_gradient_is_stored_by_the_backward_kernel(gpu, rng, shape, branch, with_ds):
    """The `_dy` kernels (register widths 256 ... 1024, the generic one for 100 and 4096): dy, the gradient of
    a bf16/fp16 branch on an fp32 residual, is written in the pass that writes dx, bit for bit the CPU
    reference's round to nearest even of that dx (ml_dtypes' cast; 3000 x 768 holds exact ties), and dx,
    dweight and dbias are bit for bit the kernels' without dy."""
    n, c = shape
    x, w, b = rand(shape, np.float32, rng, 2.0) + np.float32(0.5), rand((c,), np.float32, rng), rand((c,), np.float32, rng)
    y, gh = rand(shape, branch, rng), rand(shape, branch, rng)
    gs = rand(shape, np.float32, rng) if with_ds else None
    gsd, ghd, wd = None if gs is None else gpu.asarray(gs), gpu.asarray(gh), gpu.asarray(w)
    s, _, mean, rstd = gpu.add_layer_norm_fwd(gpu.asarray(x), gpu.asarray(y), wd, gpu.asarray(b), 1e-5, branch)
    dx, dy, dw, db = gpu.add_layer_norm_bwd(gsd, ghd, s, wd, mean, rstd, True, True, None, branch)
    dx0, dy0, dw0, db0 = gpu.add_layer_norm_bwd(gsd, ghd, s, wd, mean, rstd, True, True)
    assert dy0 is dx0 and dy.dtype == branch and dx.dtype == np.float32
    for got, ref in ((dx, dx0), (dw, dw0), (db, db0)):
        assert np.array_equal(gpu.to_numpy(got), gpu.to_numpy(ref))
    dx_host = gpu.to_numpy(dx)
    assert np.array_equal(gpu.to_numpy(dy), dx_host.astype(branch))
    if shape == (3000, 768) and branch == BF16:
        assert np.count_nonzero((dx_host.view(np.uint32) & 0xFFFF) == 0x8000) > 0  # ties to even were taken
    host = [f64(gpu.to_numpy(a)) for a in (s, mean, rstd)]
    rdx, rdy, _, _ = cpu.add_layer_norm_bwd(f64(gs), f64(gh), host[0], f64(w), host[1], host[2], False, False,
                                            None, branch)
    assert rdy.dtype == branch
    close(gpu, dx, rdx, np.float32, factor=10)
    close(gpu, dy, rdx, branch)
