"""Causal scaled-dot-product attention, fused: softmax(q k^T * scale + causal mask) v."""

from __future__ import annotations

import math

from kiln.autograd import Function
from kiln.errors import DTypeError, ShapeError


class CausalAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = q.backend.attention_fwd(q.data, k.data, v.data, scale)
        ctx.save_for_backward(q, k, v)
        ctx.meta = (out, lse, scale, q.backend)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved
        out, lse, scale, backend = ctx.meta
        return backend.attention_bwd(g, q, k, v, out, lse, scale)


def scaled_dot_product_attention(q, k, v, scale=None):
    """Causal attention over q, k, v of shape [B, H, T, D]; scale defaults to 1/sqrt(D)."""
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise ShapeError(f"attention needs q, k, v of one shape [B, H, T, D], got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if not (q.dtype is k.dtype is v.dtype) or not q.dtype.is_floating:
        raise DTypeError(f"attention needs q, k, v of one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return CausalAttention.apply(q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
