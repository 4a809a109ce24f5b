"""Fused softmax cross-entropy: forward and backward without a host sync.

The number of valid targets never leaves the device: the forward divides by it in
`cross_entropy_mean`, the backward recounts it (a tiny kernel over N targets) and scales by
grad / count. Targets outside [0, V) give a NaN loss rather than a device-side range check.
"""

from __future__ import annotations

from kiln.backend.cpu import cross_entropy as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, INDEX_CTYPES, register_family
from kiln.backend.cuda.launch import as_index, contiguous, cpu_fallback, ctype, get_kernel, i32, i64, idx_ctype

ROW_THREADS = 512  # one block per row (kCeThreads)
BLOCK_SHARED_OVERHEAD = 2048  # a block's static shared memory (the reductions') and the driver's reserve, rounded up
register_family("cross_entropy.cu", [f"cross_entropy_fwd<{t}, {i}>" for t in FLOAT_CTYPES for i in INDEX_CTYPES]
                + [f"cross_entropy_bwd<{t}, {i}>" for t in FLOAT_CTYPES for i in INDEX_CTYPES]
                + [f"cross_entropy_fused<{t}, {i}>" for t in FLOAT_CTYPES for i in INDEX_CTYPES]  # lm_head.py
                + [f"cross_entropy_count<{i}>" for i in INDEX_CTYPES] + ["cross_entropy_mean"],
                defines={"KILN_CE_THREADS": ROW_THREADS})


def kept_row_bytes(vocab: int, itemsize: int) -> int:
    """The dynamic shared memory to launch cross_entropy_fused with: the row's logits, kept from its first
    pass for its second (two passes over the logits, not three), where two such blocks fit one SM (GPT-2's
    50304 bf16 logits: 100.6 KB of an H100's 228); else 0, and the kernel reads the row twice."""
    row = vocab * itemsize
    fits = row <= rt.attribute("MaxSharedMemoryPerBlockOptin") and \
        2 * (row + BLOCK_SHARED_OVERHEAD) <= rt.attribute("MaxSharedMemoryPerMultiprocessor")
    return row if fits else 0


def cross_entropy_fwd(logits, targets, ignore_index):
    """(loss as a 0-d float32 array, lse[N] float32) for logits[N, V] and integer targets[N]."""
    t = ctype(logits.dtype)
    if t is None:
        return cpu_fallback(cpu.cross_entropy_fwd, logits, targets, ignore_index)
    cp = rt.cupy()
    logits = contiguous(logits)
    targets = as_index(targets)
    n, v = logits.shape
    lse = cp.empty((n,), dtype=cp.float32)
    rows = cp.empty((2 * n,), dtype=cp.float32)
    loss = cp.empty((), dtype=cp.float32)
    it = idx_ctype(targets.dtype)
    get_kernel("cross_entropy.cu", f"cross_entropy_fwd<{t}, {it}>")(
        (n,), (ROW_THREADS,), (logits, targets, lse, rows, i32(n), i32(v), i64(ignore_index)))
    get_kernel("cross_entropy.cu", "cross_entropy_mean")((1,), (1024,), (rows, i32(n), loss))
    return loss, lse


def cross_entropy_bwd(grad, logits, targets, lse, ignore_index):
    """dlogits = (softmax(logits) - onehot(targets)) * grad / count, zero on ignored rows."""
    t = ctype(logits.dtype)
    if t is None:
        return cpu_fallback(cpu.cross_entropy_bwd, grad, logits, targets, lse, ignore_index)
    cp = rt.cupy()
    logits = contiguous(logits)
    targets = as_index(targets)
    lse = contiguous(lse.astype(cp.float32, copy=False))
    n, v = logits.shape
    g = cp.asarray(grad, dtype=cp.float32).reshape(())
    scale = cp.empty((), dtype=cp.float32)
    it = idx_ctype(targets.dtype)
    get_kernel("cross_entropy.cu", f"cross_entropy_count<{it}>")(
        (1,), (1024,), (targets, i32(n), i64(ignore_index), g, scale))
    dlogits = cp.empty_like(logits)
    get_kernel("cross_entropy.cu", f"cross_entropy_bwd<{t}, {it}>")(
        (n,), (ROW_THREADS,), (logits, targets, lse, scale, dlogits, i32(v), i64(ignore_index)))
    return dlogits
