"""embedding: the op and its scatter-add backward on the CPU; the CUDA kernels against the CPU backend (`cuda`)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.backend import cpu
from kiln.errors import DTypeError, ShapeError
from kiln.nn import functional as F
from tests.conftest import DTYPE_IDS, DTYPES, close, f64, rand
from tests.gradcheck import gradcheck, randn


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


# --- embedding ----------------------------------------------------------------------------

EMB_CASES = [((7,), 11, 5), ((3, 17), 50, 768), ((4, 33), 1000, 100), ((3, 700), 300, 33),
             ((2, 1500), 64, 768), pytest.param((16, 1024), 50304, 768, marks=pytest.mark.slow)]


@pytest.mark.cuda
@pytest.mark.parametrize("idx_shape,vocab,dim", EMB_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding_kernels(gpu, rng, idx_shape, vocab, dim, dtype):
    w = rand((vocab, dim), dtype, rng)
    idx = rng.integers(0, min(vocab, 40), size=idx_shape)  # many repeats
    out = gpu.embedding_fwd(gpu.asarray(w), gpu.asarray(idx))
    assert np.array_equal(gpu.to_numpy(out).astype(np.float64), f64(w)[idx])
    g = rand(idx_shape + (dim,), dtype, rng)
    dw = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
    close(gpu, dw, cpu.embedding_bwd(f64(g), idx, vocab), dtype)
    again = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
    assert np.array_equal(gpu.to_numpy(dw).astype(np.float64), gpu.to_numpy(again).astype(np.float64))


@pytest.mark.cuda
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


def test_embedding_bwd_into_adds_each_present_row_once_and_keeps_the_others():
    """The CPU reference of the in-place backward: present rows get into + their sums (rounded once), an absent
    row keeps its bits (-0.0 too), out-of-range indices count for nothing."""
    idx = np.array([[3, 1, 3], [9, 1, -2]])
    g = randn(2, 3, 4)
    into = randn(10, 4)
    into[0] = -0.0
    got = cpu.embedding_bwd(g, idx, 10, into=into.copy())
    want = into.copy()
    for row in (1, 3, 9):
        want[row] += g[idx == row].sum(axis=0)
    np.testing.assert_array_equal(got, want)
    assert np.signbit(got[0]).all()
    with pytest.raises(ShapeError, match="not the weight's"):
        cpu.embedding_bwd(g, idx, 10, into=np.zeros((11, 4)))


def test_a_tied_weights_embedding_gradient_is_added_into_the_heads_without_a_weight_sized_add(monkeypatch):
    """wte used by the embedding and by the head (GPT-2's tied weight): the engine hands the embedding's
    DeferredGrad the head's pending gradient array, which the scatter adds into; no add of a [V, C] array."""
    be = kiln.backend.get_backend("cpu")
    adds = []
    real_add = be.add
    monkeypatch.setattr(be, "add", lambda a, b, *args, **kw: adds.append(a.shape) or real_add(a, b, *args, **kw))
    rng = np.random.default_rng()
    w, idx = randn(11, 4), rng.integers(0, 11, (2, 5))
    tw = kiln.tensor(w, requires_grad=True)
    x = F.embedding(kiln.tensor(idx), tw)
    (F.linear(x, tw) ** 2).sum().backward()
    assert (11, 4) not in adds
    import torch
    t = torch.tensor(w, requires_grad=True)
    (torch.nn.functional.linear(torch.nn.functional.embedding(torch.tensor(idx), t), t) ** 2).sum().backward()
    np.testing.assert_allclose(tw.grad.numpy(), t.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("idx_shape,vocab,dim", EMB_CASES[:5])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_embedding_bwd_into_matches_the_cpu_reference(gpu, rng, idx_shape, vocab, dim, dtype):
    """The GPU's in-place backward (the sums added into a given [V, C] array) against the CPU reference, and
    bit for bit what the fresh backward then an add give in fp32."""
    idx = rng.integers(0, min(vocab, 40), size=idx_shape)
    g = rand(idx_shape + (dim,), dtype, rng)
    base = rand((vocab, dim), dtype, rng)
    into = gpu.asarray(base)
    got = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab, into=into)
    assert got is into
    close(gpu, got, cpu.embedding_bwd(f64(g), idx, vocab, into=f64(base)), dtype)
    if np.dtype(dtype) == np.float32:
        fresh = gpu.embedding_bwd(gpu.asarray(g), gpu.asarray(idx), vocab)
        assert np.array_equal(gpu.to_numpy(got), base + gpu.to_numpy(fresh))
