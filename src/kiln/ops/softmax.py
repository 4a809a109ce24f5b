"""Softmax and log-softmax along one axis."""

from __future__ import annotations

from kiln.autograd import Function
from kiln.ops.elementwise import Fresh
from kiln.ops.shape import _dim, transpose


class Softmax(Function):
    @staticmethod
    def forward(ctx, x):
        y = x.backend.softmax_fwd(x.data)
        ctx.save_for_backward(Fresh(y))
        ctx.backend = x.backend
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        return ctx.backend.softmax_bwd(g, y)


class LogSoftmax(Function):
    @staticmethod
    def forward(ctx, x):
        y = x.backend.log_softmax_fwd(x.data)
        ctx.save_for_backward(Fresh(y))
        ctx.backend = x.backend
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        return ctx.backend.log_softmax_bwd(g, y)


def _along(fn, x, dim):
    d = _dim(x, dim)
    if d == x.ndim - 1:
        return fn.apply(x)
    return transpose(fn.apply(transpose(x, d, -1)), d, -1)


def softmax(x, dim=-1):
    return _along(Softmax, x, dim)


def log_softmax(x, dim=-1):
    return _along(LogSoftmax, x, dim)
