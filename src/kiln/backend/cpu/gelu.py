"""GELU in GPT-2's tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

Written as in-place passes over one or two scratch arrays: NumPy's temporaries, not tanh,
were most of the time (a fresh array per operator); run by blocks of rows (row_blocks.py), so
that those arrays stay in cache between the passes.
"""

import math

import numpy as np

from kiln.backend.cpu.compute import upcast
from kiln.backend.cpu.row_blocks import by_row_blocks

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def _inner_tanh(xf):
    """tanh(K x (1 + C x^2)) as a new array."""
    t = np.multiply(xf, xf)
    t *= _K * _C
    t += _K
    t *= xf
    return np.tanh(t, out=t)


def _gelu(xf):
    y = _inner_tanh(xf)
    y += 1.0
    y *= xf
    y *= 0.5
    return y


def _gelu_grad(xf, g):
    """g * d gelu / dx = g * (0.5 (1 + t) + 0.5 x (1 - t^2) K (1 + 3 C x^2))."""
    t = _inner_tanh(xf)
    s = np.multiply(xf, xf)
    s *= 1.5 * _K * _C
    s += 0.5 * _K
    s *= xf                      # 0.5 K x (1 + 3 C x^2)
    s *= 1.0 - t * t
    t += 1.0
    t *= 0.5
    t += s
    t *= g
    return t


def gelu_fwd(x):
    return by_row_blocks(_gelu, x.dtype, x)


def gelu_bwd(grad, x):
    """grad * gelu'(x), in x's dtype."""
    return by_row_blocks(_gelu_grad, x.dtype, x, grad)


def gelu_bwd_bias(grad, x, dbias_dtype=None):
    """(gelu_bwd(grad, x), dbias) for x [rows, C]: dbias[c] = sum over rows of dx[:, c] as stored, the bias
    gradient of the layer whose output x is (the CUDA kernel makes it in the same pass as dx), in
    dbias_dtype (default x's: float32 for a bf16 copy of an fp32 bias)."""
    dx = gelu_bwd(grad, x)
    return dx, upcast(dx).sum(axis=0).astype(dx.dtype if dbias_dtype is None else dbias_dtype)
