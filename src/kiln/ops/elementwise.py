"""Elementwise arithmetic with broadcasting in both directions: add ... tanh, and comparisons."""

from __future__ import annotations

import numbers

from kiln.autograd import Fresh, Function
from kiln.backend import array_module
from kiln.errors import DTypeError, ShapeError


def unbroadcast(grad, shape):
    """Sum `grad` down to `shape`, undoing NumPy broadcasting (leading axes and size-1 axes)."""
    if tuple(grad.shape) == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad


def scalar_array(like, value):
    """A Python number as a 0-d array of `like`'s dtype, refusing a float for an integer tensor.

    Made by a fill (on CUDA a kernel taking the value as an argument), not copied from host
    memory, so that a step using it can be recorded as a CUDA graph."""
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        if not isinstance(value, bool):
            raise DTypeError(f"expected a Tensor or a number, got {type(value).__name__}")
    elif not like.dtype.is_floating and not isinstance(value, numbers.Integral):
        raise DTypeError(f"a float scalar ({value}) with a {like.dtype} tensor; convert the tensor "
                         "with .to(kiln.float32) first")
    return like.backend.xp.full((), value, dtype=like.dtype.np)


def _operands(x, y):
    from kiln.tensor import Tensor
    if not isinstance(x, Tensor):
        x = Tensor._wrap(scalar_array(y, x), y.device)
    if not isinstance(y, Tensor):
        y = Tensor._wrap(scalar_array(x, y), x.device)
    if x.dtype is not y.dtype:
        raise DTypeError(f"dtype mismatch: {x.dtype} and {y.dtype}; convert one with .to() first")
    try:
        x.backend.xp.broadcast_shapes(x.shape, y.shape)
    except ValueError:
        raise ShapeError(f"shapes {x.shape} and {y.shape} do not broadcast") from None
    return x, y


class Add(Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.shapes = (x.shape, y.shape)
        return x.backend.add(x.data, y.data)  # a residual add: one vector kernel on the GPU

    @staticmethod
    def backward(ctx, g):
        nx, ny = ctx.needs_input_grad
        return (unbroadcast(g, ctx.shapes[0]) if nx else None,
                unbroadcast(g, ctx.shapes[1]) if ny else None)


class Sub(Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.shapes = (x.shape, y.shape)
        return x.data - y.data

    @staticmethod
    def backward(ctx, g):
        nx, ny = ctx.needs_input_grad
        return (unbroadcast(g, ctx.shapes[0]) if nx else None,
                unbroadcast(-g, ctx.shapes[1]) if ny else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              y if ctx.needs_input_grad[0] else None)
        ctx.shapes = (x.shape, y.shape)
        return x.data * y.data

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved
        nx, ny = ctx.needs_input_grad
        return (unbroadcast(g * y, ctx.shapes[0]) if nx else None,
                unbroadcast(g * x, ctx.shapes[1]) if ny else None)


class Div(Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, y)
        ctx.shapes = (x.shape, y.shape)
        return x.data / y.data

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved
        nx, ny = ctx.needs_input_grad
        return (unbroadcast(g / y, ctx.shapes[0]) if nx else None,
                unbroadcast(-g * x / (y * y), ctx.shapes[1]) if ny else None)


class Neg(Function):
    @staticmethod
    def forward(ctx, x):
        return -x.data

    @staticmethod
    def backward(ctx, g):
        return -g


class Pow(Function):
    """x ** y; the gradient for y uses log(x), so it is defined only where x > 0."""

    @staticmethod
    def forward(ctx, x, y):
        out = x.data ** y.data
        ctx.save_for_backward(x, y, Fresh(out) if ctx.needs_input_grad[1] else None)
        ctx.shapes = (x.shape, y.shape)
        return out

    @staticmethod
    def backward(ctx, g):
        x, y, out = ctx.saved
        nx, ny = ctx.needs_input_grad
        xp = array_module(g)
        return (unbroadcast(g * y * x ** (y - 1), ctx.shapes[0]) if nx else None,
                unbroadcast(g * out * xp.log(x), ctx.shapes[1]) if ny else None)


class Exp(Function):
    @staticmethod
    def forward(ctx, x):
        out = x.backend.xp.exp(x.data)
        ctx.save_for_backward(Fresh(out))
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * out


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.backend.xp.log(x.data)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        return g / x


class Sqrt(Function):
    @staticmethod
    def forward(ctx, x):
        out = x.backend.xp.sqrt(x.data)
        ctx.save_for_backward(Fresh(out))
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g / (2 * out)


class Tanh(Function):
    @staticmethod
    def forward(ctx, x):
        out = x.backend.xp.tanh(x.data)
        ctx.save_for_backward(Fresh(out))
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved
        return g * (1 - out * out)


def add(x, y):
    return Add.apply(*_operands(x, y))


def sub(x, y):
    return Sub.apply(*_operands(x, y))


def mul(x, y):
    return Mul.apply(*_operands(x, y))


def div(x, y):
    return Div.apply(*_operands(x, y))


def neg(x):
    return Neg.apply(x)


def pow(x, y):
    return Pow.apply(*_operands(x, y))


def exp(x):
    return Exp.apply(x)


def log(x):
    return Log.apply(x)


def sqrt(x):
    return Sqrt.apply(x)


def tanh(x):
    return Tanh.apply(x)


def compare(x, y, name: str):
    """An elementwise comparison as a bool tensor (not differentiable)."""
    from kiln.tensor import Tensor
    x, y = _operands(x, y)
    return Tensor._wrap(getattr(x.backend.xp, name)(x.data, y.data), x.device)


def where(cond, x, y):
    """x where cond else y, differentiable in x and y."""
    from kiln.tensor import Tensor
    x, y = _operands(x, y)
    c = cond.data if isinstance(cond, Tensor) else cond
    return Where.apply(x, y, c)


class Where(Function):
    @staticmethod
    def forward(ctx, x, y, c):
        ctx.c = c
        ctx.shapes = (x.shape, y.shape)
        return x.backend.xp.where(c, x.data, y.data)

    @staticmethod
    def backward(ctx, g):
        nx, ny = ctx.needs_input_grad
        zero = g.dtype.type(0)
        xp = array_module(g)
        return (unbroadcast(xp.where(ctx.c, g, zero), ctx.shapes[0]) if nx else None,
                unbroadcast(xp.where(ctx.c, zero, g), ctx.shapes[1]) if ny else None)
