"""Layer normalisation over the last axis, with affine weight and bias."""

from __future__ import annotations

from kiln.autograd import Function
from kiln.errors import ShapeError


class LayerNorm(Function):
    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        c = x.shape[-1]
        x2 = x.data.reshape(-1, c)
        y, mean, rstd = x.backend.layer_norm_fwd(x2, weight.data, None if bias is None else bias.data, eps)
        ctx.save_for_backward(x, weight)
        ctx.meta = (mean, rstd, x.backend, bias is not None)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved
        mean, rstd, backend, has_bias = ctx.meta
        c = x.shape[-1]
        need = ctx.needs_input_grad
        dx, dw, db = backend.layer_norm_bwd(g.reshape(-1, c), x.reshape(-1, c), w, mean, rstd,
                                            need[1], has_bias and need[2])
        dx = dx.reshape(x.shape) if need[0] else None
        return (dx, dw, db) if has_bias else (dx, dw)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance)."""
    c = x.shape[-1] if x.ndim else 0
    if weight.shape != (c,) or (bias is not None and bias.shape != (c,)):
        raise ShapeError(f"layer_norm over the last axis of {x.shape} needs weight and bias of shape "
                         f"({c},), got {weight.shape} and {None if bias is None else bias.shape}")
    if bias is None:
        return LayerNorm.apply(x, weight, None, eps)
    return LayerNorm.apply(x, weight, bias, eps)
