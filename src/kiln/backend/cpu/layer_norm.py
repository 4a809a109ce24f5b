"""Layer normalisation over the last axis, forward and fused backward."""

import numpy as np

from kiln.backend.cpu.compute import upcast


def layer_norm_fwd(x, weight, bias, eps):
    """(y, mean, rstd) for y = (x - mean) * rstd * weight + bias over the last axis of x[N, C]."""
    xf = upcast(x)
    mean = xf.mean(axis=-1, keepdims=True)
    xc = xf - mean
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    y = xc * rstd
    if weight is not None:
        y = y * upcast(weight)
    if bias is not None:
        y = y + upcast(bias)
    return y.astype(x.dtype, copy=False), mean[:, 0], rstd[:, 0]


def layer_norm_bwd(grad, x, weight, mean, rstd, need_dw, need_db):
    """(dx, dweight, dbias), the whole backward in one pass over rows."""
    g = upcast(grad)
    xhat = (upcast(x) - mean[:, None]) * rstd[:, None]
    dw = (g * xhat).sum(axis=0).astype(weight.dtype, copy=False) if need_dw else None
    db = g.sum(axis=0).astype(weight.dtype, copy=False) if need_db else None
    gw = g * upcast(weight) if weight is not None else g
    c = x.shape[-1]
    dx = rstd[:, None] * (gw - gw.sum(axis=-1, keepdims=True) / c
                          - xhat * ((gw * xhat).sum(axis=-1, keepdims=True) / c))
    return dx.astype(x.dtype, copy=False), dw, db
