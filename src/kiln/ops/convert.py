"""Conversions that stay in the graph: dtype casts, device moves, copies."""

from __future__ import annotations

from kiln.autograd import Function


class ToDType(Function):
    fresh_grads = True  # the cast back is a new array: AccumulateGrad may keep it without a copy

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.src = x.dtype.np
        ctx.backend = x.backend
        return x.backend.cast(x.data, dtype.np)

    @staticmethod
    def backward(ctx, g):
        return ctx.backend.cast(g, ctx.src)


class ToDevice(Function):
    @staticmethod
    def forward(ctx, x, device):
        ctx.src_backend = x.backend
        ctx.out_device = device
        return device.backend.asarray(x.data)

    @staticmethod
    def backward(ctx, g):
        return ctx.src_backend.asarray(g)


class Clone(Function):
    @staticmethod
    def forward(ctx, x):
        return x.data.copy()

    @staticmethod
    def backward(ctx, g):
        return g


def to_dtype(x, dtype):
    return ToDType.apply(x, dtype)


def to_device(x, device):
    return ToDevice.apply(x, device)


def clone(x):
    return Clone.apply(x)


def contiguous(x):
    """x itself when its memory is already C-contiguous, else a contiguous copy."""
    return x if x.data.flags.c_contiguous else Clone.apply(x)
