"""embedding, layer_norm, gelu, softmax, log_softmax, cross_entropy, attention, dropout:
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
