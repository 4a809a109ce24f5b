"""Softmax and log-softmax along one axis."""

from __future__ import annotations

from kiln.autograd import Fresh, Function
from kiln.ops.shape import _dim, transpose


class _RowSoftmax(Function):
    """softmax or log_softmax over the last axis; the backward needs only the saved output."""

    kernel = ""

    @classmethod
    def forward(cls, ctx, x):
        y = getattr(x.backend, cls.kernel + "_fwd")(x.data)
        ctx.save_for_backward(Fresh(y))
        ctx.backend = x.backend
        return y

    @classmethod
    def backward(cls, ctx, g):
        (y,) = ctx.saved
        return getattr(ctx.backend, cls.kernel + "_bwd")(g, y)


class Softmax(_RowSoftmax):
    kernel = "softmax"


class LogSoftmax(_RowSoftmax):
    kernel = "log_softmax"


def _along(fn, x, dim):
    d = _dim(x, dim)
    if d == x.ndim - 1:
        return fn.apply(x)
    return transpose(fn.apply(transpose(x, d, -1)), d, -1)


def softmax(x, dim=-1):
    return _along(Softmax, x, dim)


def log_softmax(x, dim=-1):
    return _along(LogSoftmax, x, dim)
