"""GELU in GPT-2's tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""

import math

import numpy as np

from kiln.backend.cpu.compute import upcast

_K = math.sqrt(2.0 / math.pi)
_C = 0.044715


def gelu_fwd(x):
    xf = upcast(x)
    y = 0.5 * xf * (1.0 + np.tanh(_K * (xf + _C * xf * xf * xf)))
    return y.astype(x.dtype, copy=False)


def gelu_bwd(grad, x):
    xf = upcast(x)
    x2 = xf * xf
    t = np.tanh(_K * xf * (1.0 + _C * x2))
    dydx = 0.5 * (1.0 + t) + 0.5 * xf * (1.0 - t * t) * (_K * (1.0 + 3.0 * _C * x2))
    return (upcast(grad) * dydx).astype(x.dtype, copy=False)
