"""Softmax and log-softmax over the last axis, forward and backward from the saved output."""

from __future__ import annotations

from kiln.backend.cpu import softmax as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import contiguous, cpu_fallback, ctype, get_kernel, i32

THREADS = 256  # one block per row (kSmThreads)
register_family("softmax.cu", [f"{k}<{t}>" for k in ("softmax_fwd", "softmax_bwd", "log_softmax_fwd", "log_softmax_bwd")
                               for t in FLOAT_CTYPES], defines={"KILN_SM_THREADS": THREADS})


def _rows(kernel: str, fallback, out_like, *arrays):
    t = ctype(out_like.dtype)
    if t is None:
        return cpu_fallback(fallback, *arrays)
    shape = out_like.shape
    c = shape[-1] if shape else 1
    flat = [contiguous(a.astype(out_like.dtype, copy=False)).reshape(-1, c) for a in arrays]
    out = rt.cupy().empty(flat[0].shape, dtype=out_like.dtype)
    n = flat[0].shape[0]
    if n and c:
        get_kernel("softmax.cu", f"{kernel}<{t}>")((n,), (THREADS,), (*flat, out, i32(c)))
    return out.reshape(shape)


def softmax_fwd(x):
    return _rows("softmax_fwd", cpu.softmax_fwd, x, x)


def log_softmax_fwd(x):
    return _rows("log_softmax_fwd", cpu.log_softmax_fwd, x, x)


def softmax_bwd(grad, y):
    """dx = y * (g - sum(g * y))."""
    return _rows("softmax_bwd", cpu.softmax_bwd, y, grad, y)


def log_softmax_bwd(grad, y):
    """dx = g - exp(y) * sum(g)."""
    return _rows("log_softmax_bwd", cpu.log_softmax_bwd, y, grad, y)
