import numpy as np
import pytest

import kiln
from kiln.errors import DTypeError, ShapeError
from kiln.nn import functional as F
from tests.gradcheck import gradcheck, randn


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 2)), ((2, 1, 3, 4), (3, 4, 2)),
                                   ((4,), (4, 3)), ((2, 3, 4), (4,))])
def test_matmul_batched_broadcast_and_vectors(sa, sb):
    a, b = randn(*sa), randn(*sb)
    np.testing.assert_allclose((kiln.tensor(a) @ kiln.tensor(b)).numpy(), a @ b, rtol=1e-12)
    gradcheck(lambda x, y: x @ y, a, b)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    x, w, b = randn(2, 3, 4), randn(5, 4), randn(5)
    ref = x @ w.T + (b if bias else 0)
    args = (x, w, b) if bias else (x, w)
    np.testing.assert_allclose(F.linear(*[kiln.tensor(a) for a in args]).numpy(), ref, rtol=1e-12)
    gradcheck(lambda *t: F.linear(*t), *args)


def test_bf16_linear_rounds_once_after_the_bias():
    """A bf16 linear is the fp32 x @ W^T + b rounded once to bf16, as a GEMM's bias epilogue (cuBLASLt, and
    oneDNN under torch.autocast) writes it; rounding the product and again after the bias add (kiln's CPU
    backend before 2026-12-05) differs in many elements and moved bf16 training away from fp32."""
    import ml_dtypes
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((64, 48), (40, 48), (40,)))
    f32 = [a.astype(np.float32) for a in (x, w, b)]
    once = (f32[0] @ f32[1].T + f32[2]).astype(ml_dtypes.bfloat16)
    twice = (f32[0] @ f32[1].T).astype(ml_dtypes.bfloat16) + b
    y = F.linear(*[kiln.tensor(a) for a in (x, w, b)])
    assert y.dtype is kiln.bfloat16
    np.testing.assert_array_equal(y.numpy().view(np.uint16), once.view(np.uint16))
    assert (once != twice).mean() > 0.05  # the test tells the two apart


def test_matmul_errors():
    with pytest.raises(ShapeError, match="do not fit"):
        kiln.randn(2, 3) @ kiln.randn(4, 2)
    with pytest.raises(DTypeError, match="mismatch"):
        kiln.randn(2, 3) @ kiln.randn(3, 2, dtype="float64")
    with pytest.raises(ShapeError, match="does not fit a weight"):
        F.linear(kiln.randn(2, 3), kiln.randn(4, 5))


def test_linear_gelu_is_gelu_of_linear_and_its_backward_checks():
    x, w, b = randn(2, 3, 5), randn(4, 5), randn(4)
    kx, kw, kb = (kiln.tensor(a, requires_grad=True) for a in (x, w, b))
    fused = F.linear_gelu(kx, kw, kb)
    ref = F.gelu(F.linear(kiln.tensor(x), kiln.tensor(w), kiln.tensor(b)))
    assert fused.shape == (2, 3, 4)
    assert np.allclose(fused.numpy(), ref.numpy(), rtol=1e-14, atol=1e-14)
    gradcheck(F.linear_gelu, randn(3, 5), randn(4, 5), randn(4))
    with pytest.raises(ShapeError, match="linear_gelu"):
        F.linear_gelu(kiln.randn(2, 5), kiln.randn(4, 5), kiln.randn(3))


def test_norm_linear_is_linear_of_the_norm_keeps_the_normed_input_and_its_backward_checks():
    s, lw, lb, w, b = randn(2, 3, 5), randn(5), randn(5), randn(4, 5), randn(4)
    ks, klw, klb, kw, kb = (kiln.tensor(a, requires_grad=True) for a in (s, lw, lb, w, b))
    x = F.layer_norm(ks, klw, klb)
    fused = F.norm_linear(x, kw, kb, ks, klw, klb)
    assert np.array_equal(fused.numpy(), F.linear(x, kw, kb).numpy())
    saved = [item[0] for item in fused.grad_fn._saved if item is not None]
    assert not any(a is x.data for a in saved) and any(a is ks.data for a in saved)  # s, not x

    def normed(s, w, b, lw, lb):
        return F.norm_linear(F.layer_norm(s, lw, lb), w, b, s, lw, lb)
    gradcheck(normed, s, w, b, lw, lb)
    gradcheck(lambda s, w, lw: F.norm_linear(F.layer_norm(s, lw), w, None, s, lw), randn(3, 5), randn(4, 5), randn(5))
    with pytest.raises(ShapeError, match="norm_linear"):
        F.norm_linear(x, kw, kb, ks[0], klw, klb)


def test_gelu_linear_is_linear_of_gelu_keeps_only_its_input_and_its_backward_checks():
    pre, w, b = randn(2, 3, 5), randn(4, 5), randn(4)
    kp, kw, kb = (kiln.tensor(a, requires_grad=True) for a in (pre, w, b))
    fused = F.gelu_linear(kp, kw, kb)
    ref = F.linear(F.gelu(kiln.tensor(pre)), kiln.tensor(w), kiln.tensor(b))
    assert fused.shape == (2, 3, 4)
    assert np.array_equal(fused.numpy(), ref.numpy())
    saved = [item[0] for item in fused.grad_fn._saved]
    assert len(saved) == 2 and saved[0] is kp.data and saved[1] is kw.data  # pre and the weight, no gelu(pre)
    gradcheck(F.gelu_linear, randn(3, 5), randn(4, 5), randn(4))
    gradcheck(F.gelu_linear, randn(3, 5), randn(4, 5))
    with pytest.raises(ShapeError, match="gelu_linear"):
        F.gelu_linear(kiln.randn(2, 5), kiln.randn(4, 5), kiln.randn(3))


def test_linear_gelu_linear_is_the_mlp_and_its_backward_checks():
    x, w1, b1, w2, b2 = randn(2, 3, 5), randn(8, 5), randn(8), randn(4, 8), randn(4)
    fused = F.linear_gelu_linear(*(kiln.tensor(a) for a in (x, w1, b1, w2, b2)))
    ref = F.linear(F.linear_gelu(*(kiln.tensor(a) for a in (x, w1, b1))), kiln.tensor(w2), kiln.tensor(b2))
    assert fused.shape == (2, 3, 4)
    assert np.array_equal(fused.numpy(), ref.numpy())
    gradcheck(F.linear_gelu_linear, randn(3, 5), randn(8, 5), randn(8), randn(4, 8), randn(4))
    gradcheck(F.linear_gelu_linear, randn(3, 5), randn(8, 5), randn(8), randn(4, 8))
    with pytest.raises(ShapeError, match="linear_gelu_linear"):
        F.linear_gelu_linear(kiln.randn(2, 5), kiln.randn(8, 5), kiln.randn(8), kiln.randn(4, 7))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_mlp_gives_the_gradients_of_its_layers(dtype):
    """F.linear_gelu_linear against c_fc.forward_gelu then c_proj, the same weights: the same output bits; in
    fp32 the same gradients to rounding; in bf16 the GELU's input gradient is the GEMM's fp32 product through
    gelu' rounded once (as cuBLASLt's DGELU epilogue makes it), not the bf16 product's, so within bf16's step."""
    from kiln.nn import GPT, preset
    model = GPT(preset("tiny", n_layer=1, n_embd=32, block_size=8), generator=kiln.Generator(1))
    mlp = model.h[0].mlp
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)

    def run(fused):
        mlp.fused = fused
        model.zero_grad()
        kx = kiln.tensor(x, requires_grad=True)
        xin = kx.to(dtype)
        y = mlp(xin)
        (y.to("float32") * kiln.tensor(rng_out)).sum().backward()
        return y.numpy(), kx.grad.numpy(), {n: p.grad.numpy() for n, p in mlp.named_parameters()}
    rng_out = np.random.default_rng(1).standard_normal((2, 8, 32)).astype(np.float32)
    (y_f, dx_f, g_f), (y_u, dx_u, g_u) = run(True), run(False)
    mlp.fused = True
    assert type(mlp(kiln.tensor(x, requires_grad=True).to(dtype)).grad_fn).__name__ == "LinearGELULinear"
    assert np.array_equal(np.asarray(y_f, np.float32), np.asarray(y_u, np.float32))
    tol = 1e-5 if dtype == "float32" else 2e-2
    for a, b in [(dx_f, dx_u)] + [(g_f[n], g_u[n]) for n in g_f]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b)
