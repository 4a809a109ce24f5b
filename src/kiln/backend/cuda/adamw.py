"""Multi-tensor AdamW, global gradient norm and in-place scaling (the paper's Horizontal Tensor Fusion).

Each call launches one kernel per dtype group over all its tensors: a table of device
pointers and sizes plus a chunk table (tensor id, first element) in fixed-size chunks, so
every block does the same work whatever the tensor sizes. Tables are built on the host once
per set of tensors (keyed by their addresses and sizes) and cached on the device, so a
steady-state step uploads nothing. lr and step are host floats; the bias corrections are
computed on the host.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.backend.cpu import adamw as cpu
from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import f32, get_kernel, i32, i64
from kiln.backend.cuda.launch import ctype

CHUNK = 16384  # elements per block: 256 threads x 4 unrolled x 16 iterations
_ADAMW_PAIRS = {("float", "float"), ("__nv_bfloat16", "__nv_bfloat16"), ("__half", "__half"),
                ("float", "__nv_bfloat16")}
_MAX_TABLES = 64


class ChunkTable:
    """Device arrays describing tensors in chunks: ptrs [T*K], sizes [T], wds [T], chunk tensor/start."""

    def __init__(self, ptrs, sizes, weight_decays, chunk_tensor, chunk_start, nchunks):
        self.ptrs, self.sizes, self.weight_decays = ptrs, sizes, weight_decays
        self.chunk_tensor, self.chunk_start, self.nchunks = chunk_tensor, chunk_start, nchunks


def chunk_layout(sizes, chunk: int = CHUNK):
    """(chunk_tensor, chunk_start) host arrays splitting each tensor into chunks of `chunk` elements."""
    tensors, starts = [], []
    for t, n in enumerate(sizes):
        for s in range(0, int(n), chunk):
            tensors.append(t)
            starts.append(s)
    return np.asarray(tensors, dtype=np.int32), np.asarray(starts, dtype=np.int64)


_tables: dict = {}


def _table(groups, weight_decays=None) -> ChunkTable:
    """The cached table for tensors given as tuples of arrays (param, grad, m, v) or (array,)."""
    key = (rt.device_id(), tuple(tuple((rt.ptr(a), a.size) for a in g) for g in groups),
           None if weight_decays is None else tuple(float(w) for w in weight_decays))
    tab = _tables.get(key)
    if tab is not None:
        return tab
    cp = rt.cupy()
    sizes = [g[0].size for g in groups]
    ptrs = np.asarray([rt.ptr(a) for g in groups for a in g], dtype=np.uint64)
    wds = np.asarray(weight_decays if weight_decays is not None else [0.0] * len(groups), dtype=np.float32)
    ct, cs = chunk_layout(sizes)
    tab = ChunkTable(cp.asarray(ptrs), cp.asarray(np.asarray(sizes, dtype=np.int64)), cp.asarray(wds),
                     cp.asarray(ct), cp.asarray(cs), len(ct))
    if len(_tables) >= _MAX_TABLES:
        _tables.clear()
    _tables[key] = tab
    return tab


def _fusable(*arrays) -> bool:
    return all(a.flags.c_contiguous and a.size > 0 for a in arrays)


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, weight_decays, lr, beta1, beta2, eps, step):
    """One AdamW update of every parameter, in place, torch.optim.AdamW's arithmetic, in fp32."""
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    step_size = lr / bias_correction1
    groups: dict = {}
    rest = []
    for p, g, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, weight_decays):
        pair = (ctype(p.dtype), ctype(g.dtype))
        if pair in _ADAMW_PAIRS and m.dtype == p.dtype and v.dtype == p.dtype and _fusable(p, g, m, v):
            groups.setdefault(pair, []).append(((p, g, m, v), wd))
        elif p.size:
            rest.append((p, g, m, v, wd))
    for (tp, tg), items in groups.items():
        tab = _table([t for t, _ in items], [wd for _, wd in items])
        get_kernel("adamw.cu", f"adamw_multi<{tp}, {tg}>")(
            (tab.nchunks,), (256,),
            (tab.ptrs, tab.sizes, tab.weight_decays, tab.chunk_tensor, tab.chunk_start, i64(CHUNK),
             f32(lr), f32(beta1), f32(beta2), f32(eps), f32(step_size), f32(bias_correction2_sqrt)))
    if rest:  # float64 or non-contiguous: CuPy elementwise ops with the CPU backend's arithmetic
        cpu.adamw_step(*zip(*rest), lr, beta1, beta2, eps, step)


def grad_norm(grads):
    """The L2 norm of all gradients together, a 0-d float32 device array (float64 if all are float64)."""
    cp = rt.cupy()
    if grads and all(g.dtype == np.float64 for g in grads):
        return cp.sqrt(sum(cp.vdot(g.ravel(), g.ravel()) for g in grads))
    groups: dict = {}
    rest = []
    for g in grads:
        t = ctype(g.dtype)
        if t is not None and _fusable(g):
            groups.setdefault(t, []).append((g,))
        elif g.size:
            rest.append(g)
    tables = {t: _table(items) for t, items in groups.items()}
    total = sum(tab.nchunks for tab in tables.values()) + len(rest)
    partial = cp.empty((max(total, 1),), dtype=cp.float32)
    if total == 0:
        partial[...] = 0
    offset = 0
    for t, tab in tables.items():
        get_kernel("adamw.cu", f"sumsq_multi<{t}>")(
            (tab.nchunks,), (256,),
            (tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, i64(CHUNK), partial, i32(offset)))
        offset += tab.nchunks
    for g in rest:
        gf = g.astype(cp.float32).ravel()
        partial[offset] = cp.dot(gf, gf)
        offset += 1
    out = cp.empty((), dtype=cp.float32)
    get_kernel("adamw.cu", "sumsq_finish")((1,), (1024,), (partial, i32(max(total, 1)), out))
    return out


def scale_(arrays, factor):
    """Multiply every array in place by a 0-d (device) factor, with no host sync."""
    cp = rt.cupy()
    f = cp.asarray(factor, dtype=cp.float32).reshape(())
    groups: dict = {}
    for a in arrays:
        t = ctype(a.dtype)
        if t is not None and _fusable(a):
            groups.setdefault(t, []).append((a,))
        elif a.size:
            a *= cp.asarray(factor).astype(a.dtype)
    for t, items in groups.items():
        tab = _table(items)
        get_kernel("adamw.cu", f"scale_multi<{t}>")(
            (tab.nchunks,), (256,), (tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, i64(CHUNK), f))
