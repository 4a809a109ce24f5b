"""Multi-tensor AdamW (with the gradient clip fused in), global gradient norm and in-place scaling.

Each call launches one kernel per dtype group over all its tensors (the paper's Horizontal
Tensor Fusion). A group is described by one small device table (pointers, sizes, the first
chunk of each tensor), built with a few NumPy calls and uploaded in one asynchronous copy
when the set of buffers changes (the gradients are new buffers every step: autograd
allocates them after zero_grad), and looked up in a small LRU cache otherwise: no per-chunk
host table, no device sync. lr and step are host floats (or, in a captured graph, read from a
device buffer written before each replay); the bias corrections are computed on the host; the clip coefficient is computed on the device from the norm's device scalar.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from kiln.backend.cpu import adamw as cpu
from kiln.backend.cuda import allocator, device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import ctype, f32, get_kernel, i32, i64
from kiln.errors import KilnError

# (param, grad, kept copy) types; a group without copies uses the param's type as the third
_ADAMW_TYPES = {("float", "float", "float"), ("float", "float", "__nv_bfloat16"), ("float", "float", "__half"),
                ("__nv_bfloat16", "__nv_bfloat16", "__nv_bfloat16"), ("__half", "__half", "__half"),
                ("float", "__nv_bfloat16", "float"), ("float", "__nv_bfloat16", "__nv_bfloat16")}
THREADS = 256  # threads per block of the multi-tensor kernels (kMtThreads)
CHUNK = THREADS * 4 * 16  # elements per block: 4-element vectors, 16 iterations
register_family("adamw.cu", [f"adamw_multi<{p}, {g}, {c}>" for p, g, c in sorted(_ADAMW_TYPES)]
                + [f"sumsq_multi<{t}>" for t in FLOAT_CTYPES] + ["sumsq_finish", "adamw_set_hyper"]
                + [f"scale_multi<{t}>" for t in FLOAT_CTYPES], defines={"KILN_MT_THREADS": THREADS})
_MAX_TABLES = 16
_ctypes: dict = {}


def _ctype(dtype):
    t = _ctypes.get(dtype, 0)
    if t == 0:
        t = _ctypes[dtype] = ctype(dtype)
    return t


class TensorTable:
    """One device buffer: ptrs [T*K] u64 | sizes [T] i64 | block_start [T+1] i64 | weight decays [T] f32."""

    def __init__(self, buf, ntensors: int, k: int):
        base = rt.ptr(buf)
        self.buf = buf  # keeps the memory alive
        self.ntensors = ntensors
        self.ptrs = np.uint64(base)
        self.sizes = np.uint64(base + 8 * k * ntensors)
        self.block_start = np.uint64(base + 8 * (k + 1) * ntensors)
        self.weight_decays = np.uint64(base + 8 * ((k + 2) * ntensors + 1))
        self.nblocks = 0


def block_starts(sizes, chunk: int = CHUNK) -> np.ndarray:
    """block_start[T + 1]: the first block of each tensor when each is cut into `chunk`-element chunks."""
    counts = -(-np.asarray(sizes, dtype=np.int64) // chunk)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


_tables: OrderedDict = OrderedDict()
_captured_tables: list = []  # tables recorded into CUDA graphs: alive as long as the process
_layouts: dict = {}  # (K, sizes, weight decays) -> (host buffer without pointers, nblocks)


def _layout(k: int, sizes: tuple, weight_decays):
    """The shape-dependent part of a table, computed once per set of shapes."""
    key = (k, sizes, weight_decays)
    got = _layouts.get(key)
    if got is None:
        n = len(sizes)
        host = np.zeros((k + 2) * n + 1 + (n + 1) // 2, dtype=np.uint64)
        host[k * n:(k + 1) * n] = np.asarray(sizes, dtype=np.int64).view(np.uint64)
        starts = block_starts(sizes)
        host[(k + 1) * n:(k + 2) * n + 1] = starts.view(np.uint64)
        host[(k + 2) * n + 1:].view(np.float32)[:n] = weight_decays if weight_decays is not None else 0.0
        got = _layouts[key] = (host, int(starts[-1]))
    return got


def _table(groups, weight_decays=None) -> TensorTable:
    """The table for tensors given as tuples of arrays (param, grad, m, v, kept copy or None) or (array,).

    Cached by buffer addresses; on a miss (new gradient buffers: every eager step) only the
    pointers are written into the cached layout and the buffer is uploaded in one async copy."""
    ptrs = [0 if a is None else a.data.ptr for g in groups for a in g]
    sizes = tuple(g[0].size for g in groups)
    wds = None if weight_decays is None else tuple(weight_decays)
    key = (rt.device_id(), tuple(ptrs), sizes, wds)
    capturing = rt.stream().is_capturing()
    tab = None if capturing else _tables.get(key)  # an eager table may be evicted (freed) while a graph reads it
    if tab is not None:
        _tables.move_to_end(key)
        return tab
    k = len(groups[0])
    layout, nblocks = _layout(k, sizes, wds)
    if capturing:
        # A CUDA graph replays this upload from the same host memory every time: the table
        # keeps its own pinned copy and is never evicted (graph.py, allocator.py).
        cp = rt.cupy()
        import cupyx
        host = cupyx.empty_pinned(layout.shape, dtype=layout.dtype)
        host[...] = layout
        host[:k * len(groups)] = ptrs
        buf = cp.empty(layout.shape, dtype=layout.dtype)
        # the runtime call, not MemoryPointer.copy_from_host_async: CuPy refuses any host-to-device
        # copy while capturing, though one from pinned memory is a valid graph node
        cp.cuda.runtime.memcpyAsync(buf.data.ptr, host.ctypes.data, host.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, rt.stream().ptr)
        tab = TensorTable(buf, len(groups), k)
        tab.host = host
        _captured_tables.append(tab)
    else:
        host = layout.copy()
        host[:k * len(groups)] = ptrs
        tab = TensorTable(rt.cupy().asarray(host), len(groups), k)  # CuPy stages it in pinned memory
        _tables[key] = tab
        if len(_tables) > _MAX_TABLES:
            _tables.popitem(last=False)
    tab.nblocks = nblocks
    return tab


def _fusable(*arrays) -> bool:
    return all(a.flags.c_contiguous and a.size > 0 for a in arrays)


def adamw_hyper(lr, beta1, beta2, step) -> tuple:
    """(lr, step size, 1 / sqrt(bias correction 2)): the per-step scalars of the update, on the host."""
    return lr, lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step)


def adamw_hyper_buffer():
    """A device buffer for adamw_hyper's three scalars, read by a captured adamw_step (hyper=...).

    The host writes it before each replay, so it comes from the eager cache (allocator.host_written):
    a block recycled inside the capture is also some temporary's, which the replay overwrites
    before the update reads it (the graph-replay divergence of 2026-12-03)."""
    with allocator.host_written():
        return rt.cupy().empty((3,), dtype=np.float32)  # not zeros: a fill here would be recorded into the graph


def adamw_set_hyper(buf, lr, beta1, beta2, step) -> None:
    """Write adamw_hyper(...) into buf on kiln's stream (a kernel with scalar arguments: no host memory)."""
    get_kernel("adamw.cu", "adamw_set_hyper")((1,), (1,), (buf, *(f32(x) for x in adamw_hyper(lr, beta1, beta2, step))))


def adamw_step(params, grads, exp_avgs, exp_avg_sqs, weight_decays, lr, beta1, beta2, eps, step,
               clip_norm=None, max_norm=0.0, copies=None, hyper=None):
    """One AdamW update of every parameter, in place, torch.optim.AdamW's arithmetic, in fp32.

    clip_norm: the global gradient norm as a 0-d float32 device array, or None; when given,
    every gradient is read as g * min(1, max_norm / (clip_norm + 1e-6)) (torch's clip),
    computed on the device, so clipping costs no pass and no sync of its own.
    copies: per parameter, its kept copy in a compute dtype (or None), written by the same
    kernel from the updated value (round to nearest even, as a cast): the bf16 weights of the
    next forward cost 2 bytes a parameter here instead of a cast's 6.
    hyper: a device buffer from adamw_hyper_buffer(); the kernel then reads lr, the step size
    and the bias correction from it instead of the host floats, so a captured CUDA graph can
    replay the step with each step's values (written by adamw_set_hyper before the replay).
    """
    _, step_size, inv_bc2_sqrt = adamw_hyper(lr, beta1, beta2, step)
    groups: dict = {}
    rest = []
    copies = [None] * len(params) if copies is None else copies
    for p, g, m, v, wd, c in zip(params, grads, exp_avgs, exp_avg_sqs, weight_decays, copies):
        tp = _ctype(p.dtype)
        types = (tp, _ctype(g.dtype), tp if c is None else _ctype(c.dtype))
        if types in _ADAMW_TYPES and m.dtype == p.dtype and v.dtype == p.dtype and _fusable(p, g, m, v) \
                and (c is None or (c.shape == p.shape and _fusable(c))):
            groups.setdefault(types, []).append(((p, g, m, v, c), wd))
        elif p.size:
            rest.append((p, g, m, v, wd, c))
    if clip_norm is not None:
        clip_norm = rt.cupy().asarray(clip_norm, dtype=np.float32).reshape(())
    norm_arg = np.uint64(0) if clip_norm is None else clip_norm
    for (tp, tg, tc), items in groups.items():
        tab = _table([t for t, _ in items], [float(wd) for _, wd in items])
        get_kernel("adamw.cu", f"adamw_multi<{tp}, {tg}, {tc}>")(
            (tab.nblocks,), (THREADS,),
            (tab.ptrs, tab.sizes, tab.block_start, i32(tab.ntensors), tab.weight_decays, i64(CHUNK),
             norm_arg, f32(max_norm), f32(lr), f32(beta1), f32(beta2), f32(eps), f32(step_size),
             f32(inv_bc2_sqrt), np.uint64(0) if hyper is None else hyper))
    if rest and hyper is not None:
        raise KilnError("a captured AdamW step needs every parameter contiguous and in float32, bfloat16 "
                        f"or float16; {len(rest)} are not")
    if rest:  # float64 or non-contiguous: CuPy elementwise ops with the CPU backend's arithmetic
        *arrays, cs = zip(*rest)
        cpu.adamw_step(*arrays, lr, beta1, beta2, eps, step, clip_norm=clip_norm, max_norm=max_norm, copies=cs)


class _Reduction:
    """Per-device scratch of grad_norm: the partial sums and the finished-blocks counter (kept at 0)."""

    def __init__(self):
        self.partial = None
        self.counter = rt.cupy().zeros((1,), dtype=np.uint32)

    def partials(self, n: int):
        if self.partial is None or self.partial.size < n:
            self.partial = rt.cupy().empty((max(n, 1024),), dtype=np.float32)
        return self.partial


_reductions: dict = {}


def grad_norm(grads):
    """The L2 norm of all gradients together, a 0-d float32 device array (float64 if all are float64).

    One read of every gradient; the last block to finish sums the per-chunk partials in a
    fixed order (deterministic), so there is no second launch.
    """
    cp = rt.cupy()
    if grads and all(g.dtype == np.float64 for g in grads):
        return cp.sqrt(sum(cp.vdot(g.ravel(), g.ravel()) for g in grads))
    groups: dict = {}
    rest = []
    for g in grads:
        t = _ctype(g.dtype)
        if t is not None and _fusable(g):
            groups.setdefault(t, []).append((g,))
        elif g.size:
            rest.append(g)
    tables = {t: _table(items) for t, items in groups.items()}
    kernel_blocks = sum(tab.nblocks for tab in tables.values())
    total = kernel_blocks + len(rest)
    out = cp.empty((), dtype=cp.float32)
    if total == 0:
        out[...] = 0
        return out
    dev = rt.device_id()
    red = _reductions.get(dev)
    if red is None:
        red = _reductions[dev] = _Reduction()
    partial = red.partials(total)
    offset = kernel_blocks
    for g in rest:  # written before the kernels run: the finishing block reads them too
        gf = g.astype(cp.float32).ravel()
        partial[offset] = cp.dot(gf, gf)
        offset += 1
    if not tables:
        get_kernel("adamw.cu", "sumsq_finish")((1,), (1024,), (partial, i32(total), out))
        return out
    offset = 0
    for t, tab in tables.items():
        get_kernel("adamw.cu", f"sumsq_multi<{t}>")(
            (tab.nblocks,), (THREADS,),
            (tab.ptrs, tab.sizes, tab.block_start, i32(tab.ntensors), i64(CHUNK), partial, i32(offset),
             i32(total), red.counter, np.uint32(kernel_blocks), out))
        offset += tab.nblocks
    return out


class GradNormParts:
    """grad_norm of gradients that come one at a time and are dropped (AdamW in backward), bit for bit.

    grad_norm's kernel writes one partial sum per chunk of every gradient (the gradients grouped by
    dtype, in order) and its last block adds the partials in a fixed order. Here each gradient's chunks
    are written by the same kernel, alone, at the places grad_norm would give them, into a zeroed
    buffer; every launch's last block adds the whole buffer into `out`, so after the last gradient
    `out` holds grad_norm's sum. (A parameter that gets no gradient leaves zeros where grad_norm would
    have moved the next ones up: the same norm, maybe not the same last bit.) Float64 gradients, or
    ones without a kernel dtype, are summed by CuPy instead, in order."""

    def __init__(self, params):
        cp = rt.cupy()
        self.exact = all(_ctype(p.dtype) is not None and p.size > 0 for p in params) and \
            not all(p.dtype == np.float64 for p in params)
        if not self.exact:
            self.sumsqs = [None] * len(params)
            self.dtype = np.float64 if all(p.dtype == np.float64 for p in params) else np.float32
            return
        groups: dict = {}  # ctype -> [(index, size)], in first-seen order, as grad_norm groups them
        for i, p in enumerate(params):
            groups.setdefault(_ctype(p.dtype), []).append((i, p.size))
        self.offsets = [0] * len(params)
        total = 0
        for members in groups.values():
            starts = block_starts([size for _, size in members])
            for (i, _), start in zip(members, starts[:-1]):
                self.offsets[i] = total + int(start)
            total += int(starts[-1])
        self.total = total
        self.partial = cp.zeros((total,), dtype=np.float32)
        self.out = cp.zeros((), dtype=np.float32)

    def add(self, index: int, grad) -> None:
        if not self.exact:
            cp = rt.cupy()
            flat = grad.ravel().astype(cp.float64 if self.dtype == np.float64 else cp.float32)
            self.sumsqs[index] = cp.vdot(flat, flat)
            return
        dev = rt.device_id()
        red = _reductions.get(dev)
        if red is None:
            red = _reductions[dev] = _Reduction()
        tab = _table([(grad,)])
        get_kernel("adamw.cu", f"sumsq_multi<{_ctype(grad.dtype)}>")(
            (tab.nblocks,), (THREADS,),
            (tab.ptrs, tab.sizes, tab.block_start, i32(1), i64(CHUNK), self.partial, i32(self.offsets[index]),
             i32(self.total), red.counter, np.uint32(tab.nblocks), self.out))

    def norm(self):
        if self.exact:
            return self.out
        cp = rt.cupy()
        terms = [s for s in self.sumsqs if s is not None]
        total = sum(terms[1:], terms[0]) if terms else cp.zeros((), dtype=self.dtype)
        return cp.sqrt(total).astype(self.dtype)


def grad_norm_parts(params):
    """A GradNormParts for gradients shaped as these parameter arrays, in this order."""
    return GradNormParts(params)


def scale_(arrays, factor):
    """Multiply every array in place by a 0-d (device) factor, with no host sync."""
    cp = rt.cupy()
    f = cp.asarray(factor, dtype=cp.float32).reshape(())
    groups: dict = {}
    for a in arrays:
        t = _ctype(a.dtype)
        if t is not None and _fusable(a):
            groups.setdefault(t, []).append((a,))
        elif a.size:
            a *= f.astype(a.dtype)
    for t, items in groups.items():
        tab = _table(items)
        get_kernel("adamw.cu", f"scale_multi<{t}>")(
            (tab.nblocks,), (THREADS,), (tab.ptrs, tab.sizes, tab.block_start, i32(tab.ntensors), i64(CHUNK), f))
