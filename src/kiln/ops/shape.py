"""Shape ops: reshape/view, transpose/permute, indexing (slices and integer arrays), cat, split.

reshape, transpose, permute, basic slicing and split return views that share the input's
version counter.
"""

from __future__ import annotations

import numpy as np

from kiln.autograd import Function
from kiln.backend import array_module
from kiln.errors import ShapeError


class Reshape(Function):
    is_view = True

    @staticmethod
    def forward(ctx, x, shape):
        ctx.in_shape = x.shape
        try:
            return x.data.reshape(shape)
        except ValueError:
            raise ShapeError(f"cannot reshape a tensor of shape {x.shape} ({x.numel()} elements) "
                             f"into {tuple(shape)}") from None

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.in_shape)


class Permute(Function):
    is_view = True

    @staticmethod
    def forward(ctx, x, dims):
        ctx.dims = dims
        return x.data.transpose(dims)

    @staticmethod
    def backward(ctx, g):
        return g.transpose(np.argsort(ctx.dims))


def reshape(x, shape):
    return Reshape.apply(x, tuple(shape))


def _dim(x, d):
    if not -x.ndim <= d < x.ndim:
        raise ShapeError(f"dim {d} is out of range for a tensor of shape {x.shape}")
    return d % x.ndim


def transpose(x, dim0, dim1):
    dims = list(range(x.ndim))
    a, b = _dim(x, dim0), _dim(x, dim1)
    dims[a], dims[b] = dims[b], dims[a]
    return Permute.apply(x, tuple(dims))


def permute(x, dims):
    dims = tuple(_dim(x, d) for d in dims)
    if sorted(dims) != list(range(x.ndim)):
        raise ShapeError(f"permute needs each of the {x.ndim} dims once, got {dims}")
    return Permute.apply(x, dims)


def array_index(index):
    """An index with Tensors replaced by their arrays."""
    from kiln.tensor import Tensor
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index


def _is_basic(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, slice, type(None), type(Ellipsis))) and not isinstance(i, bool)
               for i in items)


class BasicIndex(Function):
    is_view = True

    @staticmethod
    def forward(ctx, x, index):
        ctx.meta = (x.shape, index)
        try:
            return x.data[index]
        except IndexError as e:
            raise ShapeError(f"index {index!r} for a tensor of shape {x.shape}: {e}") from None

    @staticmethod
    def backward(ctx, g):
        shape, index = ctx.meta
        dx = array_module(g).zeros(shape, dtype=g.dtype)
        dx[index] = g
        return dx


class GatherIndex(Function):
    """Integer-array (advanced) indexing: a copy; repeated indices add up in the backward."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.meta = (x.shape, index)
        ctx.backend = x.backend
        try:
            return x.data[index]
        except IndexError as e:
            raise ShapeError(f"index out of range for a tensor of shape {x.shape}: {e}") from None

    @staticmethod
    def backward(ctx, g):
        shape, index = ctx.meta
        dx = ctx.backend.xp.zeros(shape, dtype=g.dtype)
        ctx.backend.scatter_add(dx, index, g)
        return dx


def getitem(x, index):
    index = array_index(index)
    if _is_basic(index):
        return BasicIndex.apply(x, index)
    return GatherIndex.apply(x, index)


class Cat(Function):
    @staticmethod
    def forward(ctx, *args):
        *tensors, axis = args
        ctx.meta = (axis, [t.shape[axis] for t in tensors])
        return tensors[0].backend.xp.concatenate([t.data for t in tensors], axis=axis)

    @staticmethod
    def backward(ctx, g):
        axis, sizes = ctx.meta
        xp = array_module(g)
        parts = xp.split(g, np.cumsum(sizes)[:-1].tolist(), axis=axis)
        return tuple(p if need else None for p, need in zip(parts, ctx.needs_input_grad))


def cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise ShapeError("cat needs at least one tensor")
    axis = _dim(tensors[0], dim)
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype is not first.dtype:
            from kiln.errors import DTypeError
            raise DTypeError(f"cat: dtype mismatch {first.dtype} and {t.dtype}")
        if t.ndim != first.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape))
                                       if i != axis):
            raise ShapeError(f"cat along dim {dim}: shapes {first.shape} and {t.shape} differ elsewhere")
    return Cat.apply(*tensors, axis)


class Split(Function):
    is_view = True

    @staticmethod
    def forward(ctx, x, sizes, axis):
        ctx.axis = axis
        xp = x.backend.xp
        return tuple(xp.split(x.data, np.cumsum(sizes)[:-1].tolist(), axis=axis))

    @staticmethod
    def backward(ctx, *grads):
        return array_module(grads[0]).concatenate(grads, axis=ctx.axis)


def split(x, split_size, dim=0):
    """Views of x along dim: chunks of split_size (the last may be smaller) or of the listed sizes."""
    axis = _dim(x, dim)
    n = x.shape[axis]
    if isinstance(split_size, int):
        if split_size <= 0:
            raise ShapeError(f"split size must be positive, got {split_size}")
        sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else [])
    else:
        sizes = list(split_size)
        if sum(sizes) != n:
            raise ShapeError(f"split sizes {sizes} do not add up to {n}, the size of dim {dim}")
    return list(Split.apply(x, sizes, axis))
