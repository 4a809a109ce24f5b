"""Elementwise add and dtype casts with 16-byte vector loops (elementwise.cu); CuPy for the rest.

They carry the residual adds, the gradient sums of autograd, the token plus position embeddings and the
fp32 <-> bf16 casts of a mixed-precision step; shapes that broadcast otherwise than b over a's leading axes,
other dtypes and strided arrays go to CuPy. sum_leading, the gradient of that broadcast, is kiln's column sums.
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import THREADS, aligned16, cdiv, ctype, get_kernel, i64
from kiln.backend.cuda.matmul import column_sum

register_family("elementwise.cu", [f"add<{t}>" for t in FLOAT_CTYPES]
                + [f"cast<{a}, {b}>" for a in FLOAT_CTYPES for b in FLOAT_CTYPES if a != b])


_MAX_BLOCKS = 1 << 16


def _launch(name: str, n: int, arrays, *extra) -> None:
    n_vec = n // 8 if aligned16(*arrays) else 0
    work = max(n_vec, n - 8 * n_vec, 1)
    get_kernel("elementwise.cu", name)((min(cdiv(work, THREADS), _MAX_BLOCKS),), (THREADS,),
                                       (*arrays, i64(n), i64(n_vec), *extra))


def add(a, b, out=None):
    """a + b (into out when given; out may be a); one vector kernel when all are contiguous, of one dtype
    and a kernel's, and b has a's shape or its trailing axes' (b added to every row of a's leading axes:
    GPT-2's token plus position embeddings, which CuPy's broadcast took 3.7x as long over)."""
    t = ctype(a.dtype)
    m = b.size
    rows = b.ndim <= a.ndim and tuple(a.shape[a.ndim - b.ndim:]) == tuple(b.shape) and (m == a.size or m % 8 == 0)
    if t is None or a.dtype != b.dtype or not rows or not (a.flags.c_contiguous and b.flags.c_contiguous) \
            or (out is not None and (out.dtype != a.dtype or out.shape != a.shape or not out.flags.c_contiguous)):
        return rt.cupy().add(a, b, out=out)
    if out is None:
        out = rt.cupy().empty_like(a)
    if a.size:
        _launch(f"add<{t}>", a.size, (a, b, out), i64(m))
    return out


def sum_leading(a, n: int):
    """a summed over its first n axes (the gradient of an operand broadcast over them): kiln's deterministic
    column sums (matmul.column_sum) over a's [leading, trailing] rows, in a's dtype."""
    if n == 0:
        return a
    out = rt.cupy().zeros(a.shape[n:], dtype=a.dtype)
    if a.size:
        column_sum(a.reshape(-1, out.size), out.reshape(-1))
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
