"""Causal scaled-dot-product attention, fused: softmax(q k^T * scale + causal mask) v.

`scaled_dot_product_attention` takes q, k, v [B, H, T, D]; `causal_self_attention` takes the
packed [B, T, 3 * H * D] that a GPT's c_attn produces and returns [B, T, H * D]: the kernels
read q, k, v and write dq, dk, dv as strided views of the packed buffers, so no permute copies
happen in either direction."""

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

    def release(self) -> None:
        super().release()
        self.meta = None  # the output and LSE go with the saved tensors, not with the graph's last reference


def _heads(a, n_head: int):
    """q, k, v: [B, H, T, D] views of a packed [B, T, 3 * H * D] array."""
    b, t, c3 = a.shape
    d = c3 // (3 * n_head)
    return tuple(a.reshape(b, t, 3, n_head, d)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


class PackedCausalAttention(Function):
    @staticmethod
    def forward(ctx, qkv, n_head, scale):
        b, t, c3 = qkv.shape
        backend = qkv.backend
        out, lse = backend.attention_fwd(*_heads(qkv.data, n_head), scale)
        ctx.save_for_backward(qkv)
        ctx.meta = (out, lse, n_head, scale, backend)
        # out is [B, H, T, D]; laid out [B, T, H, D] (the CUDA kernels), this is a view, not a copy
        return out.transpose(0, 2, 1, 3).reshape(b, t, c3 // 3)

    @staticmethod
    def backward(ctx, g):
        (qkv,) = ctx.saved
        out, lse, n_head, scale, backend = ctx.meta
        b, t, c = g.shape
        dqkv = backend.xp.empty(qkv.shape, dtype=qkv.dtype)
        grad = g.reshape(b, t, n_head, c // n_head).transpose(0, 2, 1, 3)
        backend.attention_bwd(grad, *_heads(qkv, n_head), out, lse, scale, into=_heads(dqkv, n_head))
        return dqkv

    def release(self) -> None:
        super().release()
        self.meta = None  # the output and LSE go with the saved tensors, not with the graph's last reference


def causal_self_attention(qkv, n_head: int, scale=None):
    """Causal attention of the q, k, v packed in qkv [B, T, 3 * H * D] (q first, then k, then v,
    each [H, D] along the last axis: c_attn's output); returns [B, T, H * D], heads side by side."""
    if qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        raise ShapeError(f"causal_self_attention needs qkv [B, T, 3 * n_head * head_dim] with n_head={n_head}, "
                         f"got {qkv.shape}")
    if not qkv.dtype.is_floating:
        raise DTypeError(f"attention needs a floating dtype, got {qkv.dtype}")
    d = qkv.shape[-1] // (3 * n_head)
    return PackedCausalAttention.apply(qkv, n_head, 1.0 / math.sqrt(d) if scale is None else scale)


def scaled_dot_product_attention(q, k, v, scale=None):
    """Causal attention over q, k, v of shape [B, H, T, D]; scale defaults to 1/sqrt(D)."""
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise ShapeError(f"attention needs q, k, v of one shape [B, H, T, D], got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if not (q.dtype is k.dtype is v.dtype) or not q.dtype.is_floating:
        raise DTypeError(f"attention needs q, k, v of one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return CausalAttention.apply(q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
