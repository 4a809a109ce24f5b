"""Embedding lookup and its deterministic backward (kiln's own stable counting sort, then segmented sums).

The backward launches the five phases of `embedding_bwd<T, I>` (kernels/embedding.cu): a
stable counting sort of the positions by index (tile ranks, prefix over tiles and indices,
scatter), then fixed-length segments of the sorted order summed one block each, runs that
cross segments combined in order. No float atomics, no Thrust/CUB, no host sync, no
shape-dependent host work beyond a few integer sizes: deterministic and capturable.
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cpu import embedding as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, INDEX_CTYPES, register_family
from kiln.backend.cuda.launch import as_index, cdiv, contiguous, cpu_fallback, ctype, get_kernel, i32, i64, idx_ctype
from kiln.errors import ShapeError

EMB_THREADS = 256
EMB_TILE = 1024             # positions per rank tile (phase 0)
EMB_SEG = 32                # sorted slots per segment (phases 3, 4)
EMB_MAX_V_BLOCKS = 4096     # phase-1 blocks whose offsets sit in shared memory
EMB_MAX_V = EMB_MAX_V_BLOCKS * EMB_THREADS - 1  # keys, one of them the out-of-range key

register_family("embedding.cu", [f"embedding_fwd<{t}, {i}>" for t in FLOAT_CTYPES for i in INDEX_CTYPES]
                + [f"embedding_bwd<{t}, {i}>" for t in FLOAT_CTYPES for i in INDEX_CTYPES],
                defines={"KILN_EMB_THREADS": EMB_THREADS, "KILN_EMB_TILE": EMB_TILE, "KILN_EMB_SEG": EMB_SEG,
                         "KILN_EMB_MAX_V_BLOCKS": EMB_MAX_V_BLOCKS})


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


def embedding_bwd(grad, idx, num_embeddings, into=None):
    """dweight[V, C]: grad rows summed by index in position order, with no atomics (deterministic); with
    `into` (a [V, C] array), the sums added to its rows in place, and `into` returned: no zeroed [V, C]
    array and no add of one (a tied weight's gradient, which GPT-2's LM head writes first).

    An index outside [0, V) contributes nothing."""
    t = ctype(grad.dtype)
    c = grad.shape[-1]
    if into is not None and into.shape != (num_embeddings, c):
        raise ShapeError(f"embedding_bwd into an array of shape {into.shape}, not the weight's ({num_embeddings}, {c})")
    if t is None or num_embeddings > EMB_MAX_V or grad.size >= 2 ** 31 * max(c, 1):
        fresh = cpu_fallback(cpu.embedding_bwd, grad, idx, num_embeddings)
        return fresh if into is None else _add_into(into, fresh)
    if into is not None and (into.dtype != grad.dtype or not into.flags.c_contiguous):
        return _add_into(into, embedding_bwd(grad, idx, num_embeddings))
    cp = rt.cupy()
    g = contiguous(grad).reshape(-1, c)
    flat = as_index(idx).reshape(-1)
    n = flat.size
    dweight = cp.zeros((num_embeddings, c), dtype=grad.dtype) if into is None else into
    if n == 0 or c == 0:
        return dweight
    v1 = num_embeddings + 1
    ntiles, nblocks_v, nseg = cdiv(n, EMB_TILE), cdiv(v1, EMB_THREADS), cdiv(n, EMB_SEG)
    ints = cp.empty((ntiles * v1 + 3 * n + nblocks_v,), dtype=np.int32)
    a, b = ntiles * v1, ntiles * v1 + n
    tile_count, rank, sorted_pos, sorted_key = ints[:a], ints[a:b], ints[b:b + n], ints[b + n:b + 2 * n]
    block_total = ints[b + 2 * n:]
    partial = cp.empty((nseg * 2 * c,), dtype=np.float32)
    kernel = get_kernel("embedding.cu", f"embedding_bwd<{t}, {idx_ctype(flat.dtype)}>")
    rest = (g, flat, dweight, i32(n), i32(c), i64(num_embeddings), tile_count, rank, block_total,
            i32(nblocks_v), sorted_pos, sorted_key, partial, i32(into is not None))
    for phase, blocks in enumerate((ntiles, nblocks_v, cdiv(n, EMB_THREADS), nseg, nseg)):
        kernel((blocks,), (EMB_THREADS,), (i32(phase),) + rest)
    return dweight


def _add_into(into, fresh):
    rt.stream()  # CuPy's add below on kiln's stream
    into += fresh.astype(into.dtype, copy=False)
    return into
