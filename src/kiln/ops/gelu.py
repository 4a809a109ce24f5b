"""GELU, tanh approximation (GPT-2's)."""

from __future__ import annotations

from kiln.autograd import Function


class GELU(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.backend = x.backend
        return x.backend.gelu_fwd(x.data)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        return ctx.backend.gelu_bwd(g, x)


def gelu(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return GELU.apply(x)
