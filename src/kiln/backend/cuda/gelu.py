"""GELU (GPT-2's tanh form) forward and backward: one elementwise kernel each, 16-byte packs; the
backward with the bias gradient of the layer before it (column sums of dx) in the same pass."""

from __future__ import annotations

from kiln.backend.cpu import gelu as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import (
    COLUMN_PART_THREADS,
    THREADS,
    aligned16,
    cdiv,
    column_parts,
    column_sum_finish,
    column_sum_finish_kernels,
    contiguous,
    cpu_fallback,
    ctype,
    get_kernel,
    i32,
    i64,
)

register_family("gelu.cu", [f"gelu_fwd<{t}>" for t in FLOAT_CTYPES] + [f"gelu_bwd<{t}>" for t in FLOAT_CTYPES]
                + [f"gelu_bwd_bias_part<{t}, {v}>" for t in FLOAT_CTYPES for v in ("true", "false")]
                + column_sum_finish_kernels(FLOAT_CTYPES))


_MAX_BLOCKS = 1 << 20


def _grid(n: int, n_vec: int, pack: int) -> int:
    work = max(n_vec, n - n_vec * pack, 1)
    return min(cdiv(work, THREADS), _MAX_BLOCKS)


def gelu_fwd(x):
    t = ctype(x.dtype)
    if t is None:
        return cpu_fallback(cpu.gelu_fwd, x)
    x = contiguous(x)
    y = rt.cupy().empty_like(x)
    n = x.size
    if n == 0:
        return y
    pack = 16 // x.dtype.itemsize
    n_vec = n // pack if aligned16(x, y) else 0
    get_kernel("gelu.cu", f"gelu_fwd<{t}>")((_grid(n, n_vec, pack),), (THREADS,), (x, y, i64(n), i64(n_vec)))
    return y


def gelu_bwd(grad, x):
    t = ctype(x.dtype)
    if t is None:
        return cpu_fallback(cpu.gelu_bwd, grad, x)
    x = contiguous(x)
    grad = contiguous(grad.astype(x.dtype, copy=False))
    dx = rt.cupy().empty_like(x)
    n = x.size
    if n == 0:
        return dx
    pack = 16 // x.dtype.itemsize
    n_vec = n // pack if aligned16(x, grad, dx) else 0
    get_kernel("gelu.cu", f"gelu_bwd<{t}>")((_grid(n, n_vec, pack),), (THREADS,),
                                            (grad, x, dx, i64(n), i64(n_vec)))
    return dx




def gelu_bwd_bias(grad, x, dbias_dtype=None):
    """(gelu_bwd(grad, x), dbias) for x [rows, C]: dbias[c] = the sum over rows of dx[:, c] as stored (the
    bias gradient of the layer whose output x is), made in the same pass as dx: per-part fp32 sums, then
    one small kernel adds the parts in a fixed order (deterministic) and writes dbias_dtype (default x's)."""
    t = ctype(x.dtype)
    to = ctype(x.dtype if dbias_dtype is None else dbias_dtype)
    if t is None or to is None or x.ndim != 2:
        return cpu_fallback(cpu.gelu_bwd_bias, grad, x, dbias_dtype)
    cp = rt.cupy()
    x = contiguous(x)
    grad = contiguous(grad.astype(x.dtype, copy=False))
    rows, c = x.shape
    dx = cp.empty_like(x)
    db = cp.empty((c,), dtype=x.dtype if dbias_dtype is None else dbias_dtype)
    if rows == 0 or c == 0:
        db[...] = 0
        return dx, db
    pack = 16 // x.dtype.itemsize
    vec = c % pack == 0 and aligned16(x, grad, dx)
    grid, per_part, parts = column_parts(rows, c, pack if vec else 1)
    partial = cp.empty((parts, c), dtype=cp.float32)
    get_kernel("gelu.cu", f"gelu_bwd_bias_part<{t}, {'true' if vec else 'false'}>")(
        grid, (COLUMN_PART_THREADS,), (grad, x, dx, partial, i32(rows), i32(c), i32(per_part)))
    column_sum_finish("gelu.cu", partial, parts, c, (db,))
    return dx, db
