"""Statistics of a tensor against its reference: what the precision logger keeps instead of the
tensors themselves (shape, dtype, L2, max-abs, relative error, cosine, a content hash)."""

from __future__ import annotations

import hashlib

import numpy as np

# Relative error (||kiln - ref|| / ||ref||) above which an op counts as diverged, per precision.
# fp64 and fp32 sit a few orders above the rounding a GPT step accumulates (measured on the CPU:
# fp64 ~1e-14, fp32 ~1e-6 forward, ~1e-5 for the deepest gradients); tf32 and bf16 round every
# GEMM operand to 10 and 7 mantissa bits (2^-11 = 4.9e-4, 2^-8 = 3.9e-3 per element).
TOLERANCE = {"fp64": 1e-10, "fp32": 1e-4, "tf32": 2e-2, "bf16": 5e-2}


def content_hash(arr: np.ndarray) -> str:
    """The first 16 hex digits of the sha256 of the array's bytes (C order): equal bits, equal hash."""
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]


def compare_arrays(a: np.ndarray, b: np.ndarray) -> dict:
    """kiln's array a against the reference's b (same shape): a's description and the distances."""
    if a.shape != b.shape:
        return {"shape": list(a.shape), "ref_shape": list(b.shape), "rel_err": float("inf"),
                "dtype": str(a.dtype), "ref_dtype": str(b.dtype)}
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    d = x - y
    nx, ny, nd = (float(np.linalg.norm(v)) for v in (x, y, d))
    if ny > 0:
        rel = nd / ny
    else:
        rel = 0.0 if nd == 0 else float("inf")
    cos = float(x @ y / (nx * ny)) if nx > 0 and ny > 0 else float(nx == ny)
    return {"shape": list(a.shape), "dtype": str(a.dtype), "ref_dtype": str(b.dtype), "l2": nx, "ref_l2": ny,
            "max_abs": float(np.abs(x).max(initial=0.0)), "max_abs_diff": float(np.abs(d).max(initial=0.0)),
            "rel_err": rel, "cosine": cos, "hash": content_hash(a), "ref_hash": content_hash(b)}
