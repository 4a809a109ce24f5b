"""GELU (GPT-2's tanh form) forward and backward: one elementwise kernel each, 16-byte packs."""

from __future__ import annotations

from kiln.backend.cpu import gelu as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import THREADS, aligned16, cdiv, contiguous, cpu_fallback, ctype, get_kernel, i64

register_family("gelu.cu", [f"gelu_fwd<{t}>" for t in FLOAT_CTYPES] + [f"gelu_bwd<{t}>" for t in FLOAT_CTYPES])


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


