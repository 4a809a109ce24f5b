"""Elementwise add and dtype casts with 16-byte vector loops (elementwise.cu); CuPy for the rest.

They carry the residual adds, the gradient sums of autograd and the fp32 <-> bf16 casts of a
mixed-precision step; shapes that broadcast, other dtypes and strided arrays go to CuPy.
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import THREADS, aligned16, cdiv, ctype, get_kernel, i64

register_family("elementwise.cu", [f"add<{t}>" for t in FLOAT_CTYPES]
                + [f"cast<{a}, {b}>" for a in FLOAT_CTYPES for b in FLOAT_CTYPES if a != b])


_MAX_BLOCKS = 1 << 16


def _launch(name: str, n: int, arrays) -> None:
    n_vec = n // 8 if aligned16(*arrays) else 0
    work = max(n_vec, n - 8 * n_vec, 1)
    get_kernel("elementwise.cu", name)((min(cdiv(work, THREADS), _MAX_BLOCKS),), (THREADS,), (*arrays, i64(n), i64(n_vec)))


def add(a, b, out=None):
    """a + b (into out when given; out may be a); one vector kernel when all are contiguous, of one
    shape and a kernel dtype."""
    t = ctype(a.dtype)
    if t is None or a.dtype != b.dtype or a.shape != b.shape or not (a.flags.c_contiguous and b.flags.c_contiguous) \
            or (out is not None and (out.dtype != a.dtype or out.shape != a.shape or not out.flags.c_contiguous)):
        return rt.cupy().add(a, b, out=out)
    if out is None:
        out = rt.cupy().empty_like(a)
    if a.size:
        _launch(f"add<{t}>", a.size, (a, b, out))
    return out


def cast(x, dtype, out=None):
    """x converted to dtype (a new array, as astype, or written into out: x's shape, that dtype); one
    vector kernel between float32, bfloat16, float16."""
    dtype = np.dtype(dtype)
    ti, to = ctype(x.dtype), ctype(dtype)
    if ti is None or to is None or not x.flags.c_contiguous or (out is not None and not out.flags.c_contiguous):
        if out is None:
            return x.astype(dtype)
        out[...] = x.astype(dtype)
        return out
    y = rt.cupy().empty(x.shape, dtype=dtype) if out is None else out
    if x.size:
        _launch(f"cast<{ti}, {to}>", x.size, (x, y))
    return y
