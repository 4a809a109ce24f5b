"""Reductions: sum, mean, max (differentiable) and argmax."""

from __future__ import annotations

import builtins

from kiln.autograd import Function
from kiln.backend import array_module
from kiln.errors import ShapeError


def _axes(x, dim):
    """`dim` (None, an int or a tuple, negatives allowed) as a sorted tuple of axes, checked."""
    if dim is None:
        return tuple(range(x.ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    out = []
    for d in dims:
        if not -x.ndim <= d < builtins.max(x.ndim, 1):
            raise ShapeError(f"dim {d} is out of range for a tensor of shape {x.shape}")
        out.append(d % builtins.max(x.ndim, 1))
    return tuple(sorted(set(out)))


def _expand_back(g, shape, axes, keepdim):
    xp = array_module(g)
    if not keepdim:
        g = xp.expand_dims(g, axes) if axes else g
    return xp.broadcast_to(g, shape)


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axes, keepdim):
        ctx.meta = (x.shape, axes, keepdim)
        return x.data.sum(axis=axes, keepdims=keepdim)

    @staticmethod
    def backward(ctx, g):
        shape, axes, keepdim = ctx.meta
        return _expand_back(g, shape, axes, keepdim)


class Mean(Function):
    @staticmethod
    def forward(ctx, x, axes, keepdim):
        ctx.meta = (x.shape, axes, keepdim)
        return x.data.mean(axis=axes, keepdims=keepdim)

    @staticmethod
    def backward(ctx, g):
        shape, axes, keepdim = ctx.meta
        count = 1
        for a in axes:
            count *= shape[a]
        return _expand_back(g / g.dtype.type(count), shape, axes, keepdim)


class MaxAll(Function):
    """max over every element; the gradient is shared equally among tied maxima."""

    @staticmethod
    def forward(ctx, x):
        out = x.data.max()
        ctx.save_for_backward(x)
        ctx.out = out
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        mask = (x == ctx.out).astype(g.dtype)
        return mask * (g / mask.sum())


class MaxDim(Function):
    """max along one axis; the gradient goes to the first maximum (the argmax), as in PyTorch."""

    @staticmethod
    def forward(ctx, x, axis, keepdim):
        idx = x.data.argmax(axis=axis)
        xp = x.backend.xp
        out = xp.take_along_axis(x.data, xp.expand_dims(idx, axis), axis=axis)
        ctx.meta = (x.shape, axis, keepdim, idx)
        return out if keepdim else out.squeeze(axis)

    @staticmethod
    def backward(ctx, g):
        shape, axis, keepdim, idx = ctx.meta
        xp = array_module(g)
        dx = xp.zeros(shape, dtype=g.dtype)
        gk = g if keepdim else xp.expand_dims(g, axis)
        xp.put_along_axis(dx, xp.expand_dims(idx, axis), gk, axis=axis)
        return dx


def sum(x, dim=None, keepdim=False):
    return Sum.apply(x, _axes(x, dim), keepdim)


def mean(x, dim=None, keepdim=False):
    return Mean.apply(x, _axes(x, dim), keepdim)


def max(x, dim=None, keepdim=False):
    """The largest value (dim=None) or the largest along one axis; values only (argmax for indices)."""
    if dim is None:
        return MaxAll.apply(x)
    (axis,) = _axes(x, dim) if isinstance(dim, int) else (None,)
    if axis is None:
        raise ShapeError(f"max takes one dim, got {dim!r}")
    return MaxDim.apply(x, axis, keepdim)


def argmax(x, dim=None, keepdim=False):
    from kiln.tensor import Tensor
    if dim is None:
        return Tensor._wrap(x.data.argmax(), x.device)
    (axis,) = _axes(x, dim)
    out = x.data.argmax(axis=axis)
    if keepdim:
        out = x.backend.xp.expand_dims(out, axis)
    return Tensor._wrap(out, x.device)
