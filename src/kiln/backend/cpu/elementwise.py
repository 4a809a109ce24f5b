"""Elementwise add, dtype casts and the sum over leading axes that undoes a broadcast (the CUDA backend runs them
as vector kernels, elementwise.cu, and its column sums)."""

import numpy as np


def add(a, b, out=None):
    """a + b (into out when given)."""
    return np.add(a, b, out=out)


def sum_leading(a, n: int):
    """a summed over its first n axes (the gradient of an operand broadcast over them), in a's dtype."""
    return a.sum(axis=tuple(range(n))) if n else a


def cast(x, dtype, out=None):
    """x converted to dtype: a new array, or written into out (of x's shape and that dtype)."""
    if out is None:
        return x.astype(dtype)
    out[...] = x.astype(dtype)
    return out
