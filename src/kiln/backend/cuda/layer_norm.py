"""LayerNorm over the last axis: register-resident kernels for common widths, generic otherwise.

The backward writes dx and per-block partial sums of dweight/dbias that a second kernel adds
in a fixed order, so dweight/dbias are deterministic (no atomics).

add_layer_norm_fwd/_bwd fuse the residual add before a LayerNorm: one kernel reads x and y and
writes s = x + y and layer_norm(s); the backward kernel adds the gradient of s into dx as it
stores it (the gradient of both x and y), so neither the add nor autograd's gradient sum of the
residual stream is a kernel of its own. A branch y narrower than the residual gets its gradient from
the same pass (the `_dy` kernels store dx and dx rounded to y's dtype), not from a cast kernel.

The kernels are templated over (R, T): R the LayerNorm input's type (the residual stream, its
gradient, the affine weights), T the sublayer side's (the branch y, the output h and its gradient).
R = T, or autocast's fp32 residual under bf16/fp16 sublayers (out_dtype), with no conversion pass.
"""

from __future__ import annotations

from kiln.backend.cpu import layer_norm as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import (
    aligned16,
    cdiv,
    column_sum_finish,
    column_sum_finish_kernels,
    contiguous,
    cpu_fallback,
    ctype,
    f32,
    get_kernel,
    i32,
)

_ROWS_PER_BLOCK = 8  # one warp per row, 8 warps per block (kLnWarps in layer_norm.cu)
# LayerNorm widths compiled with the row held in registers; others take the generic kernel.
LAYER_NORM_WIDTHS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)
# The backward holds four row-sized register arrays, so it is specialised only up to 1024.
LAYER_NORM_BWD_WIDTHS = (256, 512, 768, 1024)
# The forward of the residual add fused with a LayerNorm (add_layer_norm_fwd_reg) also holds the
# row, plus a second input in flight: at 4096 the fp16 instantiation spills (224 bytes), so
# 4096 takes the generic kernel. Its backward is layer_norm_bwd_reg's, widths as above.
ADD_LAYER_NORM_WIDTHS = tuple(c for c in LAYER_NORM_WIDTHS if c <= 3072)


# (R, T): the residual side's type and the sublayer side's: one dtype, or an fp32 residual under
# bf16/fp16 sublayers (autocast's policy)
TYPE_PAIRS = tuple((t, t) for t in FLOAT_CTYPES) + (("float", "__nv_bfloat16"), ("float", "__half"))


def _instantiations():
    # layer_norm_* and add_layer_norm_* (the residual add fused with the LayerNorm after it);
    # dweight/dbias of both go through layer_norm_dwdb_*.
    out = []
    for r, t in TYPE_PAIRS:
        rt_ = f"{r}, {t}"
        for c in LAYER_NORM_WIDTHS:
            if c % (32 * (16 // (4 if t == "float" else 2))) == 0:
                out.append(f"layer_norm_fwd_reg<{rt_}, {c}>")
                if c in ADD_LAYER_NORM_WIDTHS:
                    out.append(f"add_layer_norm_fwd_reg<{rt_}, {c}>")
                if c in LAYER_NORM_BWD_WIDTHS:
                    out += [f"layer_norm_bwd_reg<{rt_}, {c}>", f"add_layer_norm_bwd_reg<{rt_}, {c}>"]
                    if r != t:  # the branch's gradient in T from the same pass (a narrower branch only)
                        out += [f"layer_norm_bwd_dy_reg<{rt_}, {c}>", f"add_layer_norm_bwd_dy_reg<{rt_}, {c}>"]
        out += [f"layer_norm_fwd_any<{rt_}>", f"layer_norm_bwd_any<{rt_}>", f"add_layer_norm_fwd_any<{rt_}>",
                f"add_layer_norm_bwd_any<{rt_}>", f"layer_norm_dwdb_any<{rt_}>"]
        if r != t:
            out += [f"layer_norm_bwd_dy_any<{rt_}>", f"add_layer_norm_bwd_dy_any<{rt_}>"]
    return out + column_sum_finish_kernels(FLOAT_CTYPES)


register_family("layer_norm.cu", _instantiations(), defines={"KILN_LN_WARPS": _ROWS_PER_BLOCK})
_MAX_BWD_BLOCKS = 256
_constants: dict = {}


def _constant(value: float, c: int, dtype):
    """A cached device vector of `value` (ones for a missing weight, zeros for a missing bias)."""
    key = (value, c, str(dtype), rt.device_id())
    a = _constants.get(key)
    if a is None:
        cp = rt.cupy()
        a = cp.full((c,), value, dtype=dtype)
        _constants[key] = a
    return a


def _reg_ok(c: int, dtype, widths) -> bool:
    """Whether the register kernels take width c; dtype: the sublayer side's (16 bytes of it a lane)."""
    return c in widths and c % (32 * (16 // dtype.itemsize)) == 0


def _types(x_dtype, t_dtype):
    """'R, T' of the kernels for a residual side of x_dtype and a sublayer side of t_dtype, or None when no
    kernel is instantiated for the pair."""
    pair = (ctype(x_dtype), ctype(t_dtype))
    return f"{pair[0]}, {pair[1]}" if pair in TYPE_PAIRS else None


def layer_norm_fwd(x, weight, bias, eps, out_dtype=None):
    """(y, mean, rstd) for x[N, C], y in out_dtype (default x's); mean and rstd are float32 [N]."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    t = _types(x.dtype, out_dtype)
    if t is None:
        return cpu_fallback(cpu.layer_norm_fwd, x, weight, bias, eps, out_dtype)
    cp = rt.cupy()
    x = contiguous(x)
    n, c = x.shape
    w = _constant(1.0, c, x.dtype) if weight is None else contiguous(weight.astype(x.dtype, copy=False))
    b = _constant(0.0, c, x.dtype) if bias is None else contiguous(bias.astype(x.dtype, copy=False))
    y = cp.empty(x.shape, dtype=out_dtype)
    mean = cp.empty((n,), dtype=cp.float32)
    rstd = cp.empty((n,), dtype=cp.float32)
    grid = (cdiv(n, _ROWS_PER_BLOCK),)
    if _reg_ok(c, y.dtype, LAYER_NORM_WIDTHS) and aligned16(x, y, w, b):
        get_kernel("layer_norm.cu", f"layer_norm_fwd_reg<{t}, {c}>")(
            grid, (256,), (x, w, b, y, mean, rstd, i32(n), f32(eps)))
    else:
        get_kernel("layer_norm.cu", f"layer_norm_fwd_any<{t}>")(
            grid, (256,), (x, w, b, y, mean, rstd, i32(n), i32(c), f32(eps)))
    return y, mean, rstd


def layer_norm_bwd(grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None):
    """(dx, dweight, dbias); dweight/dbias are None unless asked for, in param_grad_dtype (default the
    weight's: float32 for a bf16 copy of fp32 master weights, written by the finish kernel as is)."""
    if ctype(x.dtype) is None:
        return cpu_fallback(cpu.layer_norm_bwd, grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype)
    dx, _, dw, db = _bwd(None, grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype)
    return dx, dw, db


def add_layer_norm_fwd(x, y, weight, bias, eps, out_dtype=None):
    """(s, h, mean, rstd) for s = x + y and h = layer_norm(s) in out_dtype (default x's), x and y [N, C],
    y of x's dtype or narrower."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    t = _types(x.dtype, out_dtype)
    if t is None:
        return cpu_fallback(cpu.add_layer_norm_fwd, x, y, weight, bias, eps, out_dtype)
    cp = rt.cupy()
    x = contiguous(x)
    y = contiguous(y.astype(out_dtype, copy=False))
    n, c = x.shape
    w = _constant(1.0, c, x.dtype) if weight is None else contiguous(weight.astype(x.dtype, copy=False))
    b = _constant(0.0, c, x.dtype) if bias is None else contiguous(bias.astype(x.dtype, copy=False))
    s = cp.empty_like(x)
    h = cp.empty(x.shape, dtype=out_dtype)
    mean = cp.empty((n,), dtype=cp.float32)
    rstd = cp.empty((n,), dtype=cp.float32)
    grid = (cdiv(n, _ROWS_PER_BLOCK),)
    if _reg_ok(c, h.dtype, ADD_LAYER_NORM_WIDTHS) and aligned16(x, y, s, h, w, b):
        get_kernel("layer_norm.cu", f"add_layer_norm_fwd_reg<{t}, {c}>")(
            grid, (256,), (x, y, w, b, s, h, mean, rstd, i32(n), f32(eps)))
    else:
        get_kernel("layer_norm.cu", f"add_layer_norm_fwd_any<{t}>")(
            grid, (256,), (x, y, w, b, s, h, mean, rstd, i32(n), i32(c), f32(eps)))
    return s, h, mean, rstd


def add_layer_norm_bwd(grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None,
                       branch_dtype=None):
    """(dx, dy, dweight, dbias) with dx = grad_s + layer_norm_bwd(grad_h) (rounded once): the gradient
    of both addends of s = x + y. grad_s None: dx is the LayerNorm's alone (the plain kernels). dy is y's
    in branch_dtype (default s's): dx itself, or for a narrower y dx rounded to it, stored by the kernel
    that stores dx when grad_h is in that dtype (the `_dy` kernels), not by a cast after."""
    if ctype(s.dtype) is None:
        return cpu_fallback(cpu.add_layer_norm_bwd, grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db,
                            param_grad_dtype, branch_dtype)
    return _bwd(grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype, branch_dtype)


def _bwd(grad_s, grad, x, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None, dy_dtype=None):
    """The LayerNorm backward of grad at x (plus grad_s into dx unless it is None); grad in x's dtype or in
    the narrower one of its output (kernels <R, T> for R x's type, T grad's). (dx, dy, dweight, dbias): dy is
    dx in dy_dtype (default x's: dx itself), from the `_dy` kernels when that is T and narrower than R."""
    if _types(x.dtype, grad.dtype) is None:  # a gradient in neither dtype: taken as x's
        grad = grad.astype(x.dtype)
    t = _types(x.dtype, grad.dtype)
    cp = rt.cupy()
    x = contiguous(x)
    n, c = x.shape
    g = contiguous(grad)
    ds = None if grad_s is None else contiguous(grad_s.astype(x.dtype, copy=False))
    add = "" if ds is None else "add_"
    head = () if ds is None else (ds,)
    w = _constant(1.0, c, x.dtype) if weight is None else contiguous(weight.astype(x.dtype, copy=False))
    mean = contiguous(mean.astype(cp.float32, copy=False))
    rstd = contiguous(rstd.astype(cp.float32, copy=False))
    dx = cp.empty_like(x)
    dy_dtype = x.dtype if dy_dtype is None else cp.dtype(dy_dtype)
    dy = cp.empty(x.shape, dtype=dy_dtype) if dy_dtype != x.dtype and dy_dtype == g.dtype else None
    name, tail = (f"{add}layer_norm_bwd", ()) if dy is None else (f"{add}layer_norm_bwd_dy", (dy,))
    parts, partial = 0, None
    if _reg_ok(c, g.dtype, LAYER_NORM_BWD_WIDTHS) and aligned16(g, x, w, dx, ds, dy):
        parts = max(1, min(cdiv(n, _ROWS_PER_BLOCK), _MAX_BWD_BLOCKS))
        partial = cp.empty((2 * parts, c), dtype=cp.float32)
        get_kernel("layer_norm.cu", f"{name}_reg<{t}, {c}>")(
            (parts,), (256,), (*head, g, x, w, mean, rstd, dx, *tail, partial, i32(n)))
    else:
        get_kernel("layer_norm.cu", f"{name}_any<{t}>")(
            (cdiv(n, _ROWS_PER_BLOCK),), (256,), (*head, g, x, w, mean, rstd, dx, *tail, i32(n), i32(c)))
        if need_dw or need_db:
            rows_per_chunk = max(64, cdiv(n, 256))
            parts = max(1, cdiv(n, rows_per_chunk))
            partial = cp.empty((2 * parts, c), dtype=cp.float32)
            get_kernel("layer_norm.cu", f"layer_norm_dwdb_any<{t}>")(
                (cdiv(c, 32), parts), (256,), (g, x, mean, rstd, partial, i32(n), i32(c), i32(rows_per_chunk)))
    dw = db = None
    if need_dw or need_db:
        pdtype = param_grad_dtype if param_grad_dtype is not None else x.dtype if weight is None else weight.dtype
        # the sums are fp32: the finish writes the parameters' dtype directly, or x's and converts
        # (float64 weights over float32 activations)
        finish_dtype = pdtype if ctype(pdtype) is not None else x.dtype
        dw = cp.empty((c,), dtype=finish_dtype) if need_dw else None
        db = cp.empty((c,), dtype=finish_dtype) if need_db else None
        column_sum_finish("layer_norm.cu", partial, parts, c, (dw, db))
        if finish_dtype != pdtype:
            dw = None if dw is None else dw.astype(pdtype)
            db = None if db is None else db.astype(pdtype)
    if dy is None:  # y of x's dtype (dx serves it), or a dy_dtype no kernel writes (grad in neither dtype)
        dy = dx if dy_dtype == x.dtype else dx.astype(dy_dtype)
    return dx, dy, dw, db
