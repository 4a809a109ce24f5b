"""The CPU kernels run by blocks of rows (kiln.backend.cpu.row_blocks): the blocks cover the rows once, in
order, and a kernel's result does not depend on how its rows were blocked: GELU and LayerNorm's forward
and dx bit for bit, LayerNorm's weight gradients and attention to rounding."""

import numpy as np
import pytest

from kiln.backend.cpu import attention, gelu, layer_norm, row_blocks


def test_blocks_cover_the_rows_in_order_and_follow_the_shape_only():
    blocks = row_blocks.row_blocks(1000, 1024)  # 256 rows a block at 256 KiB
    assert [(b.start, b.stop) for b in blocks] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert row_blocks.row_blocks(3, 1 << 30) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a row each at least
    assert row_blocks.row_blocks(0, 8) == []


@pytest.fixture
def tiny_grain(monkeypatch):
    """Blocks of a few rows, so that every kernel below runs many of them."""
    monkeypatch.setattr(row_blocks, "GRAIN_BYTES", 96)


def test_blocked_kernels_equal_the_whole_array_ones(tiny_grain, monkeypatch):
    rng = np.random.default_rng(0)
    x, g, gs = (rng.standard_normal((50, 24)).astype(np.float32) for _ in range(3))
    w, b = rng.standard_normal(24).astype(np.float32), rng.standard_normal(24).astype(np.float32)
    blocked = (gelu.gelu_fwd(x), gelu.gelu_bwd(g, x), *layer_norm.layer_norm_fwd(x, w, b, 1e-5))
    _, mean, rstd = blocked[2:]
    dx, dy, dw, db = layer_norm.add_layer_norm_bwd(gs, g, x, w, mean, rstd, True, True)
    monkeypatch.setattr(row_blocks, "GRAIN_BYTES", 1 << 30)  # one block: the kernels over all rows at once
    whole = (gelu.gelu_fwd(x), gelu.gelu_bwd(g, x), *layer_norm.layer_norm_fwd(x, w, b, 1e-5))
    for a, c in zip(blocked, whole):
        np.testing.assert_array_equal(a, c)
    wdx, _, wdw, wdb = layer_norm.add_layer_norm_bwd(gs, g, x, w, mean, rstd, True, True)
    np.testing.assert_array_equal(dx, wdx)
    assert dy is dx
    np.testing.assert_allclose(dw, wdw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, wdb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,offset,tq,tk", [(True, 0, 20, 20), (True, 7, 9, 16), (False, 0, 12, 18)])
def test_blocked_attention_equals_one_block(tiny_grain, monkeypatch, causal, offset, tq, tk):
    """At 96 bytes a grain every block is a few query rows of one head, each reading only the keys its
    rows see; against the whole computation in float64."""
    rng = np.random.default_rng(1)
    q, g = (rng.standard_normal((2, 3, tq, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, tk, 8)) for _ in range(2))
    assert len(attention._blocks(6, tq, tk, causal, offset)) > 6
    out, lse = attention.attention_fwd(q, k, v, 0.35, causal, offset)
    grads = attention.attention_bwd(g, q, k, v, out, lse, 0.35, None, causal, offset)
    monkeypatch.setattr(row_blocks, "GRAIN_BYTES", 1 << 30)
    assert len(attention._blocks(6, tq, tk, causal, offset)) == 1
    wout, wlse = attention.attention_fwd(q, k, v, 0.35, causal, offset)
    np.testing.assert_allclose(out, wout, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, wlse, rtol=0, atol=1e-13)
    for a, c in zip(grads, attention.attention_bwd(g, q, k, v, wout, wlse, 0.35, None, causal, offset)):
        np.testing.assert_allclose(a, c, rtol=0, atol=1e-13)
