"""embedding, layer_norm, add_layer_norm, gelu, softmax, log_softmax, cross_entropy, attention, dropout:
finite differences in float64 and PyTorch CPU as the reference."""

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import kiln
from kiln.errors import ConfigError, DTypeError, KilnError, ShapeError
from kiln.nn import functional as F
from tests.gradcheck import gradcheck, randn


def rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def test_embedding():
    rng = np.random.default_rng()
    w = randn(7, 3)
    idx = rng.integers(0, 7, (2, 5))
    np.testing.assert_array_equal(F.embedding(kiln.tensor(idx), kiln.tensor(w)).numpy(), w[idx])
    gradcheck(lambda t: F.embedding(kiln.tensor(idx), t), w)
    with pytest.raises(ShapeError, match="index 7 is out of range for 7"):
        F.embedding(kiln.tensor([7]), kiln.tensor(w))
    with pytest.raises(DTypeError, match="integers"):
        F.embedding(kiln.tensor([1.0]), kiln.tensor(w))


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(bias):
    x, w, b = randn(2, 3, 6) * 3 + 1, randn(6), randn(6)
    args = (x, w, b) if bias else (x, w)
    ref = TF.layer_norm(torch.tensor(x), (6,), torch.tensor(w), torch.tensor(b) if bias else None, 1e-5)
    assert rel(F.layer_norm(*[kiln.tensor(a) for a in args]).numpy(), ref.numpy()) < 1e-13
    gradcheck(lambda *t: F.layer_norm(*t), *args)


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
    with pytest.raises(DTypeError, match="dtype mismatch"):
        F.add_layer_norm(x, kiln.randn(2, 4).to(kiln.bfloat16), w)
    with pytest.raises(ShapeError, match="weight and bias of shape"):
        F.add_layer_norm(x, x, kiln.randn(3))


def test_gelu_is_the_tanh_form():
    x = randn(4, 9) * 2
    ref = TF.gelu(torch.tensor(x), approximate="tanh").numpy()
    assert rel(F.gelu(kiln.tensor(x)).numpy(), ref) < 1e-14
    gradcheck(F.gelu, x)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_and_log_softmax(dim):
    x = randn(3, 4, 5) * 3
    t = torch.tensor(x)
    assert rel(F.softmax(kiln.tensor(x), dim).numpy(), torch.softmax(t, dim).numpy()) < 1e-14
    assert rel(F.log_softmax(kiln.tensor(x), dim).numpy(), torch.log_softmax(t, dim).numpy()) < 1e-14
    gradcheck(lambda a: F.softmax(a, dim), x)
    gradcheck(lambda a: F.log_softmax(a, dim), x)


@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_matches_pytorch_and_finite_differences(ignore):
    rng = np.random.default_rng()
    logits = randn(2, 6, 11) * 2
    tgt = rng.integers(0, 11, (2, 6))
    if ignore:
        tgt[0, :3] = -100
    lt = torch.tensor(logits, requires_grad=True)
    ref = TF.cross_entropy(lt.view(-1, 11), torch.tensor(tgt).view(-1), ignore_index=-100)
    ref.backward()
    x = kiln.tensor(logits, requires_grad=True)
    loss = F.cross_entropy(x, kiln.tensor(tgt))
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 1e-12 * abs(ref.item())
    assert rel(x.grad.numpy(), lt.grad.numpy()) < 1e-12
    gradcheck(lambda a: F.cross_entropy(a, kiln.tensor(tgt)), logits)


def test_cross_entropy_bad_targets():
    with pytest.raises(KilnError, match="target 5 is outside the vocabulary"):
        F.cross_entropy(kiln.randn(2, 5), kiln.tensor([1, 5]))
    with pytest.raises(ShapeError, match="targets of shape"):
        F.cross_entropy(kiln.randn(2, 5), kiln.tensor([1, 2, 3]))


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


def test_dropout_is_seeded_scaled_and_its_backward_is_the_mask():
    x = kiln.tensor(np.abs(randn(200, 50)) + 1.0, requires_grad=True)
    a = F.dropout(x, 0.3, generator=kiln.Generator(7))
    b = F.dropout(x, 0.3, generator=kiln.Generator(7))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    kept = a.numpy() != 0
    assert abs(kept.mean() - 0.7) < 0.02
    np.testing.assert_allclose(a.numpy()[kept], x.numpy()[kept] / 0.7, rtol=1e-6)
    a.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), kept / 0.7, rtol=1e-6)
    assert F.dropout(x, 0.3, training=False) is x
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        F.dropout(x, 1.0)
