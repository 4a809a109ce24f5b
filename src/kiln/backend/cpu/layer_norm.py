"""Layer normalisation over the last axis, forward and fused backward, and the residual add
fused with the LayerNorm that follows it (add_layer_norm_fwd / add_layer_norm_bwd).

In-place passes and einsum row reductions: NumPy temporaries, not arithmetic, set the time.
"""

import numpy as np

from kiln.backend.cpu.compute import upcast


def _row_dot(a, b):
    """sum over the last axis of a * b, without the product array: [N, 1]."""
    return np.einsum("ij,ij->i", a, b)[:, None]


def layer_norm_fwd(x, weight, bias, eps, out_dtype=None):
    """(y, mean, rstd) for y = (x - mean) * rstd * weight + bias over the last axis of x[N, C]; y in
    out_dtype (default x's)."""
    xf = upcast(x)
    c = xf.shape[-1]
    mean = xf.mean(axis=-1, keepdims=True)
    y = xf - mean
    var = _row_dot(y, y)
    var /= c
    rstd = 1.0 / np.sqrt(var + eps)
    y *= rstd
    if weight is not None:
        y *= upcast(weight)
    if bias is not None:
        y += upcast(bias)
    return y.astype(out_dtype or x.dtype, copy=False), mean[:, 0], rstd[:, 0]


def _dx_compute(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None):
    """(dx in the compute dtype, dweight, dbias): the LayerNorm backward before dx is rounded; dweight and
    dbias in param_grad_dtype (default the weight's)."""
    g = upcast(grad)
    xhat = upcast(x) - mean[:, None]
    xhat *= rstd[:, None]
    pdtype = param_grad_dtype or (weight.dtype if weight is not None else x.dtype)  # no weight: no dw/db either
    dw = np.einsum("ij,ij->j", g, xhat).astype(pdtype, copy=False) if need_dw else None
    db = g.sum(axis=0).astype(pdtype, copy=False) if need_db else None
    gw = g * upcast(weight) if weight is not None else g
    c = x.shape[-1]
    # dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), built in xhat's buffer
    proj = _row_dot(gw, xhat)
    proj /= c
    xhat *= -proj
    xhat += gw
    xhat -= gw.sum(axis=-1, keepdims=True) / c
    xhat *= rstd[:, None]
    return xhat, dw, db


def layer_norm_bwd(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None):
    """(dx, dweight, dbias), the whole backward in one pass over rows; dweight and dbias in
    param_grad_dtype (default the weight's: float32 for a bf16 copy of fp32 master weights)."""
    dx, dw, db = _dx_compute(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype)
    return dx.astype(x.dtype, copy=False), dw, db


def add_layer_norm_fwd(x, y, weight, bias, eps, out_dtype=None):
    """(s, h, mean, rstd) for s = x + y (rounded to x's dtype, as a separate add stores it) and
    h = layer_norm(s) in out_dtype (default x's) over the last axis of x[N, C] and y[N, C] (y of x's
    dtype or narrower)."""
    s = np.add(x, y.astype(x.dtype, copy=False))
    h, mean, rstd = layer_norm_fwd(s, weight, bias, eps, out_dtype)
    return s, h, mean, rstd


def add_layer_norm_bwd(grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None,
                       branch_dtype=None):
    """(dx, dy, dweight, dbias) with dx = grad_s + layer_norm_bwd(grad_h), added before dx is rounded.

    dx is the gradient of both x and y, in s's dtype; dy is y's in branch_dtype (default s's): dx itself, or
    dx rounded to nearest even into a narrower branch dtype (bit for bit what a cast of dx stores). grad_s
    may be None (the sum was not used); grad_h may not; grad_h may be narrower than s (the LayerNorm's
    output was)."""
    dx, dw, db = _dx_compute(grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype)
    if grad_s is not None:
        dx += upcast(grad_s)
    dx = dx.astype(s.dtype, copy=False)
    dy = dx if branch_dtype is None or np.dtype(branch_dtype) == dx.dtype else dx.astype(branch_dtype)
    return dx, dy, dw, db
