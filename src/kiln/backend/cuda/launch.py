"""Host-side plumbing shared by the kernel wrappers: dtype dispatch, alignment, grids, fallbacks.

A wrapper launches a compiled kernel when the arrays' dtype has an instantiation (float32,
bfloat16, float16); float64 and other dtypes are reference-only on the GPU and run the CPU
backend's kernel on a host copy (correct, slow, and never on a training hot path).
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import CTYPES, IDX_CTYPES

THREADS = 256


def ctype(dtype) -> str | None:
    """The kernels' C++ type for a float dtype, or None when no kernel is instantiated for it."""
    return CTYPES.get(np.dtype(dtype).name)


def idx_ctype(dtype) -> str | None:
    return IDX_CTYPES.get(np.dtype(dtype).name)


def aligned16(*arrays) -> bool:
    """True when every array (None is skipped) starts on a 16-byte boundary (Pack loads are legal)."""
    return all(a is None or rt.ptr(a) % 16 == 0 for a in arrays)


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def contiguous(a):
    """a itself when C-contiguous, else a contiguous copy (kernels index rows densely)."""
    return a if a.flags.c_contiguous else rt.cupy().ascontiguousarray(a)


def as_index(a):
    """An index array the kernels take (int64 or int32), contiguous."""
    cp = rt.cupy()
    a = contiguous(a)
    if idx_ctype(a.dtype) is None:
        a = a.astype(cp.int64)
    return a


def to_host(x):
    if x is None or isinstance(x, (np.ndarray, np.generic, int, float, bool, str)):
        return x
    if hasattr(x, "get") and hasattr(x, "dtype"):
        return x.get()
    if isinstance(x, (list, tuple)):
        return type(x)(to_host(v) for v in x)
    return x


def to_device(x):
    if isinstance(x, np.ndarray):
        return rt.cupy().asarray(x)
    if isinstance(x, tuple):
        return tuple(to_device(v) for v in x)
    if isinstance(x, list):
        return [to_device(v) for v in x]
    return x


def cpu_fallback(fn, *args):
    """Run the CPU backend's `fn` on host copies of the device arrays and bring the results back."""
    return to_device(fn(*[to_host(a) for a in args]))
