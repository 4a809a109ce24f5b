"""GELU in GPT-2's tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

Computed as x s with s = sigmoid(2u) = 1 / (1 + exp(-2u)), u the tanh's argument: 0.5 (1 + tanh u) is
sigmoid(2u), the same function. NumPy's float32 exp takes about half the time of its tanh on an AVX2
host without AVX-512 (0.7 against 1.4-1.5 ms for 512K elements:
benchmarks/results/cpu_kernels/gelu-sigmoid-ab-2026-12-08/ufuncs.log), and x s has no
cancellation where 1 + tanh u had one (x well below 0, tanh u near -1). Written as in-place passes over
one or two scratch arrays (NumPy's temporaries were most of the time: a fresh array per operator) and run
by blocks of rows (row_blocks.py), so that those arrays stay in cache between the passes.
"""

import math

import numpy as np

from kiln.backend.cpu.compute import upcast
from kiln.backend.cpu.row_blocks import by_row_blocks

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def _sigmoid_2u(xf):
    """sigmoid(2u) = 0.5 (1 + tanh u), u = K x (1 + C x^2), as a new array."""
    s = np.multiply(xf, xf)
    s *= -2.0 * _K * _C
    s -= 2.0 * _K
    s *= xf                      # -2u
    with np.errstate(over="ignore"):  # exp(-2u) = inf for x below about -10: s = 1 / inf = 0, as tanh u = -1 gave
        np.exp(s, out=s)
    s += 1.0
    return np.reciprocal(s, out=s)


def _gelu(xf):
    y = _sigmoid_2u(xf)
    y *= xf
    return y


def _gelu_grad(xf, g):
    """g * d gelu / dx = g * s (1 + q (1 - s)), s = sigmoid(2u), q = 2 K x (1 + 3 C x^2) (= 2 u' x)."""
    s = _sigmoid_2u(xf)
    q = np.multiply(xf, xf)
    q *= 6.0 * _K * _C
    q += 2.0 * _K
    q *= xf
    w = np.subtract(1.0, s, dtype=s.dtype)
    w *= q
    w += 1.0
    w *= s
    w *= g
    return w


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
