"""The accumulation dtype of the CPU kernels: float64 stays float64, everything else is float32."""

import numpy as np


def compute_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def upcast(a: np.ndarray) -> np.ndarray:
    """`a` in its compute dtype (no copy when it already is)."""
    return a.astype(compute_dtype(a.dtype), copy=False)
