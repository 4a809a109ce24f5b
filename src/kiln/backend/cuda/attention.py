"""Causal attention, fused (online softmax, flash-attention style), forward and backward.

q, k, v are [B, H, T, D] with D in ATTENTION_HEAD_DIMS (compile-time specialised); other head
dims and float64 run the CPU reference on a host copy. float32 runs on the CUDA cores (strict
fp32); bfloat16 and float16 run the tensor-core kernels (`*_tc`: mma.sync, fp32 accumulation),
64 query (or key) rows per block.
"""

from __future__ import annotations

from kiln.backend.cpu import attention as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import ATTENTION_HEAD_DIMS, f32, get_kernel, i32, i64
from kiln.backend.cuda.launch import cdiv, contiguous, cpu_fallback, ctype
from kiln.errors import ShapeError


TC_ROWS = 64  # kTcRows in attention.cu


def _tensor_cores(t: str) -> bool:
    return t != "float"


def block_rows(d: int) -> tuple[int, int, int]:
    """float32 kernels' (query rows per forward block, keys per dK/dV block, query rows per dQ block): AttnShape."""
    return (16 if d >= 128 else 32, 8 if d >= 128 else (32 if d >= 64 else 16), 8 if d >= 128 else 32)


def _usable(q) -> bool:
    return ctype(q.dtype) is not None and q.ndim == 4 and q.shape[-1] in ATTENTION_HEAD_DIMS


def _check(q):
    b, h = q.shape[0], q.shape[1]
    if b * h > 65535:
        raise ShapeError(f"attention on the GPU takes at most 65535 (batch x heads), got {b} x {h}")


def attention_fwd(q, k, v, scale):
    """(out [B, H, T, D] in q's dtype, lse [B, H, T] float32) for causal attention."""
    if not _usable(q):
        return cpu_fallback(cpu.attention_fwd, q, k, v, scale)
    _check(q)
    cp = rt.cupy()
    t = ctype(q.dtype)
    q, k, v = (contiguous(a.astype(q.dtype, copy=False)) for a in (q, k, v))
    b, h, n_t, d = q.shape
    out = cp.empty_like(q)
    lse = cp.empty((b, h, n_t), dtype=cp.float32)
    if _tensor_cores(t):
        name, bq = f"attention_fwd_tc<{t}, {d}>", TC_ROWS
    else:
        name, bq = f"attention_fwd<{t}, {d}>", block_rows(d)[0]
    get_kernel("attention.cu", name)((cdiv(n_t, bq), b * h), (128,), (q, k, v, out, lse, i32(n_t), f32(scale)))
    return out, lse


def attention_bwd(grad, q, k, v, out, lse, scale):
    """(dq, dk, dv) recomputed from q, k, v, out and lse."""
    if not _usable(q):
        return cpu_fallback(cpu.attention_bwd, grad, q, k, v, out, lse, scale)
    _check(q)
    cp = rt.cupy()
    t = ctype(q.dtype)
    q, k, v, out, grad = (contiguous(a.astype(q.dtype, copy=False)) for a in (q, k, v, out, grad))
    lse = contiguous(lse.astype(cp.float32, copy=False))
    b, h, n_t, d = q.shape
    rows = b * h * n_t
    delta = cp.empty((b, h, n_t), dtype=cp.float32)
    get_kernel("attention.cu", f"attention_bwd_delta<{t}, {d}>")((cdiv(rows, 8),), (256,),
                                                                (grad, out, delta, i64(rows)))
    dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
    if _tensor_cores(t):
        suffix, bk, bq = "_tc", TC_ROWS, TC_ROWS
    else:
        (_, bk, bq), suffix = block_rows(d), ""
    get_kernel("attention.cu", f"attention_bwd_dkdv{suffix}<{t}, {d}>")(
        (cdiv(n_t, bk), b * h), (128,), (q, k, v, grad, lse, delta, dk, dv, i32(n_t), f32(scale)))
    get_kernel("attention.cu", f"attention_bwd_dq{suffix}<{t}, {d}>")(
        (cdiv(n_t, bq), b * h), (128,), (q, k, v, grad, lse, delta, dq, i32(n_t), f32(scale)))
    return dq, dk, dv
