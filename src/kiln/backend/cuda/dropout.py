"""Dropout on the GPU: one kernel (kernels/random.cu) draws the keep mask from kiln's Philox generator
and applies it; the CPU backend's twin is kiln.backend.cpu.dropout."""

from __future__ import annotations

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.launch import cdiv, contiguous, ctype, f32, get_kernel, i64
from kiln.backend.cuda.random import rng_uniform


def dropout_fwd(x, p, gen):
    """(y, mask): mask is 0 or 1/(1-p) in x's dtype, y = x * mask (the backward is grad * mask)."""
    cp = rt.cupy()
    scale = 1.0 / (1.0 - p)
    t = ctype(x.dtype)
    if t is None:
        keep = rng_uniform(gen, x.shape, np.float32) >= p
        mask = keep.astype(x.dtype) * x.dtype.type(scale)
        return x * mask, mask
    x = contiguous(x)
    y, mask = cp.empty_like(x), cp.empty_like(x)
    n = x.size
    if n:
        off = gen.take(n)
        get_kernel("random.cu", f"dropout_fwd<{t}>")(
            (cdiv(cdiv(n, 4), 256),), (256,),
            (x, y, mask, i64(n), f32(p), f32(scale), np.uint64(gen.seed), np.uint64(off)))
    return y, mask
