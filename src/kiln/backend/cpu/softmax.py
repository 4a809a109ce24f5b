"""Softmax and log-softmax over the last axis, numerically stable (max subtracted)."""

import numpy as np

from kiln.backend.cpu.compute import upcast


def softmax_fwd(x):
    xf = upcast(x)
    e = np.exp(xf - xf.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype, copy=False)


def softmax_bwd(grad, y):
    """dx = y * (g - sum(g * y)) from the saved output y."""
    g, yf = upcast(grad), upcast(y)
    return (yf * (g - (g * yf).sum(axis=-1, keepdims=True))).astype(y.dtype, copy=False)


def log_softmax_fwd(x):
    xf = upcast(x)
    s = xf - xf.max(axis=-1, keepdims=True)
    return (s - np.log(np.exp(s).sum(axis=-1, keepdims=True))).astype(x.dtype, copy=False)


def log_softmax_bwd(grad, y):
    """dx = g - exp(y) * sum(g) from the saved output y."""
    g = upcast(grad)
    return (g - np.exp(upcast(y)) * g.sum(axis=-1, keepdims=True)).astype(y.dtype, copy=False)
