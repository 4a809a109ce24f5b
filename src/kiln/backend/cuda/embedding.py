"""Embedding lookup and its deterministic backward (stable sort of the indices, one block per run)."""

from __future__ import annotations

from kiln.backend.cpu import embedding as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import get_kernel, i32, i64
from kiln.backend.cuda.launch import as_index, cdiv, contiguous, cpu_fallback, ctype, idx_ctype


def embedding_fwd(weight, idx):
    """out[..., C] = weight[idx[...]]; an index outside [0, V) gives a row of NaN."""
    t = ctype(weight.dtype)
    if t is None:
        return cpu_fallback(cpu.embedding_fwd, weight, idx)
    weight = contiguous(weight)
    flat = as_index(idx).reshape(-1)
    v, c = weight.shape
    n = flat.size
    out = rt.cupy().empty((n, c), dtype=weight.dtype)
    get_kernel("embedding.cu", f"embedding_fwd<{t}, {idx_ctype(flat.dtype)}>")(
        (cdiv(n, 8),), (256,), (weight, flat, out, i32(n), i32(c), i64(v)))
    return out.reshape(tuple(idx.shape) + (c,))


def embedding_bwd(grad, idx, num_embeddings):
    """dweight[V, C]: grad rows summed by index in index order, with no atomics (deterministic)."""
    t = ctype(grad.dtype)
    if t is None:
        return cpu_fallback(cpu.embedding_bwd, grad, idx, num_embeddings)
    cp = rt.cupy()
    c = grad.shape[-1]
    g = contiguous(grad).reshape(-1, c)
    flat = as_index(idx).reshape(-1)
    n = flat.size
    dweight = cp.zeros((num_embeddings, c), dtype=grad.dtype)
    if n == 0:
        return dweight
    order = cp.argsort(flat, kind="stable").astype(cp.int64, copy=False)
    get_kernel("embedding.cu", f"embedding_bwd<{t}, {idx_ctype(flat.dtype)}>")(
        (n,), (128,), (g, flat, order, dweight, i32(n), i32(c), i64(num_embeddings)))
    return dweight
