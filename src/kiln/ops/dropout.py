"""Dropout with an explicit, seeded generator."""

from __future__ import annotations

from kiln.autograd import Function
from kiln.errors import ConfigError


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p, generator):
        y, mask = x.backend.dropout_fwd(x.data, p, generator.native)
        ctx.mask = mask
        return y

    @staticmethod
    def backward(ctx, g):
        return g * ctx.mask


def dropout(x, p: float, training: bool = True, generator=None):
    """Zero each element with probability p and scale the rest by 1/(1-p); identity when not training."""
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    from kiln.random import default_generator
    return Dropout.apply(x, p, generator if generator is not None else default_generator(x.device))
