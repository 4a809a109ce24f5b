"""Layer normalisation over the last axis, forward and fused backward, and the residual add
fused with the LayerNorm that follows it (add_layer_norm_fwd / add_layer_norm_bwd).

In-place passes and einsum row reductions: NumPy temporaries, not arithmetic, set the time. Run by
blocks of rows (row_blocks.py), each block's passes in cache; the weight and bias gradients add the
blocks' column sums in block order (the same bits on every run).
"""

import numpy as np

from kiln.backend.cpu.compute import compute_dtype, upcast
from kiln.backend.cpu.row_blocks import add_in_order, row_blocks


def _row_dot(a, b):
    """sum over the last axis of a * b, without the product array: [N, 1]."""
    return np.einsum("ij,ij->i", a, b)[:, None]


def _row_sum(a):
    """sum over the last axis: [N, 1]. einsum's loop, not a.sum(axis=-1): NumPy's reduction over a short
    contiguous last axis (GPT-2's 768, the tiny preset's 128) took 2-3x einsum's time on a 2-core AVX2 host
    (benchmarks/results/cpu_kernels/layer-norm-einsum-ab-2026-12-08/reductions.log)."""
    return np.einsum("ij->i", a)[:, None]


def _normalize(xf, weight, bias, eps, out=None):
    """(y, mean, rstd) of rows xf in the compute dtype; y in `out` when given (of that dtype)."""
    c = xf.shape[-1]
    mean = _row_sum(xf)
    mean /= c
    y = np.subtract(xf, mean, out=out)
    var = _row_dot(y, y)
    var /= c
    rstd = 1.0 / np.sqrt(var + eps)
    y *= rstd
    if weight is not None:
        y *= weight
    if bias is not None:
        y += bias
    return y, mean[:, 0], rstd[:, 0]


def _forward(x, y, weight, bias, eps, out_dtype):
    """(s, h, mean, rstd): s = x + y rounded to x's dtype (None when y is None, and h normalises x itself),
    h = layer_norm(s) in out_dtype (default x's), block by block."""
    n, c = x.shape
    cdt = compute_dtype(x.dtype)
    s = None if y is None else np.empty(x.shape, x.dtype)
    h = np.empty(x.shape, out_dtype or x.dtype)
    mean, rstd = np.empty(n, cdt), np.empty(n, cdt)
    w = upcast(weight) if weight is not None else None
    b = upcast(bias) if bias is not None else None
    in_place = h.dtype == cdt  # h built in its own rows, else in a scratch array rounded into them
    for r in row_blocks(n, 4 * c):
        xr = x[r]
        if y is not None:
            xr = np.add(xr, y[r].astype(x.dtype, copy=False), out=s[r])
        y_r, mean[r], rstd[r] = _normalize(upcast(xr), w, b, eps, out=h[r] if in_place else None)
        if not in_place:
            h[r] = y_r
    return s, h, mean, rstd


def layer_norm_fwd(x, weight, bias, eps, out_dtype=None):
    """(y, mean, rstd) for y = (x - mean) * rstd * weight + bias over the last axis of x[N, C]; y in
    out_dtype (default x's)."""
    _, h, mean, rstd = _forward(x, None, weight, bias, eps, out_dtype)
    return h, mean, rstd


def _backward(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype, grad_s=None, branch_dtype=None):
    """(dx, dy, dweight, dbias): dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)) (+ grad_s, added before
    dx is rounded to x's dtype), dy = dx rounded to branch_dtype (dx itself when None or x's dtype); dweight
    and dbias in param_grad_dtype (default the weight's), each the blocks' column sums added in block order."""
    n, c = x.shape
    dx = np.empty(x.shape, x.dtype)
    dy = dx if branch_dtype is None or np.dtype(branch_dtype) == dx.dtype else np.empty(x.shape, branch_dtype)
    w = upcast(weight) if weight is not None else None
    in_place = dx.dtype == compute_dtype(x.dtype)  # dx built in its own rows, else in a scratch array rounded into them
    dws, dbs = [], []
    for r in row_blocks(n, 4 * c):
        g = upcast(grad[r])
        xhat = np.subtract(upcast(x[r]), mean[r, None], out=dx[r] if in_place else None)
        xhat *= rstd[r, None]
        if need_dw:
            dws.append(np.einsum("ij,ij->j", g, xhat))
        if need_db:
            dbs.append(g.sum(axis=0))
        gw = g * w if w is not None else g
        proj = _row_dot(gw, xhat)
        proj /= c
        xhat *= -proj  # dx, built in xhat's buffer
        xhat += gw
        xhat -= _row_sum(gw) / c
        xhat *= rstd[r, None]
        if grad_s is not None:
            xhat += upcast(grad_s[r])
        if not in_place:
            dx[r] = xhat
        if dy is not dx:
            dy[r] = dx[r]
    pdtype = param_grad_dtype or (weight.dtype if weight is not None else x.dtype)  # no weight: no dw/db either
    none = np.zeros(c, compute_dtype(x.dtype))  # the column sums of no rows
    dw = add_in_order(dws or [none]).astype(pdtype, copy=False) if need_dw else None
    db = add_in_order(dbs or [none]).astype(pdtype, copy=False) if need_db else None
    return dx, dy, dw, db


def layer_norm_bwd(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None):
    """(dx, dweight, dbias), the whole backward in one pass over rows; dweight and dbias in
    param_grad_dtype (default the weight's: float32 for a bf16 copy of fp32 master weights)."""
    dx, _, dw, db = _backward(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype)
    return dx, dw, db


def add_layer_norm_fwd(x, y, weight, bias, eps, out_dtype=None):
    """(s, h, mean, rstd) for s = x + y (rounded to x's dtype, as a separate add stores it) and
    h = layer_norm(s) in out_dtype (default x's) over the last axis of x[N, C] and y[N, C] (y of x's
    dtype or narrower)."""
    return _forward(x, y, weight, bias, eps, out_dtype)


def add_layer_norm_bwd(grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None,
                       branch_dtype=None):
    """(dx, dy, dweight, dbias) with dx = grad_s + layer_norm_bwd(grad_h), added before dx is rounded.

    dx is the gradient of both x and y, in s's dtype; dy is y's in branch_dtype (default s's): dx itself, or
    dx rounded to nearest even into a narrower branch dtype (bit for bit what a cast of dx stores). grad_s
    may be None (the sum was not used); grad_h may not; grad_h may be narrower than s (the LayerNorm's
    output was)."""
    return _backward(grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype, grad_s, branch_dtype)
