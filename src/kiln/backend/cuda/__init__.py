"""The CUDA backend: CuPy arrays and kiln's own kernels, exporting kiln.backend.interface (as `cpu` does).

Kernels are NVRTC-compiled CUDA C++ from `kernels/` (compiler.py), GEMMs go to cuBLASLt
through kiln's ctypes binding (cublaslt.py), device memory comes from kiln's caching
allocator (allocator.py), and everything runs on one kiln stream (device.py). Results agree
with the CPU backend to a stated tolerance (tests/test_op_<family>.py, test_cuda_gemm.py).
Importing this module needs neither a GPU nor CuPy; `ensure_available()` checks both.
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cuda.adamw import (
    adamw_hyper_buffer,
    adamw_set_hyper,
    adamw_step,
    grad_norm,
    grad_norm_parts,
    scale_,
)
from kiln.backend.cuda.allocator import end_warmup, memory_stats, observe_allocations, release_unused
from kiln.backend.cuda.attention import attention_bwd, attention_fwd
from kiln.backend.cuda.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from kiln.backend.cuda.cublaslt import (
    PRECISIONS,
    get_matmul_precision,
    set_matmul_precision,
)
from kiln.backend.cuda.device import device_name, ensure_available, range_pop, range_push, stream, synchronize
from kiln.backend.cuda.dropout import dropout_fwd
from kiln.backend.cuda.elementwise import add, cast
from kiln.backend.cuda.embedding import embedding_bwd, embedding_fwd
from kiln.backend.cuda.gelu import gelu_bwd, gelu_bwd_bias, gelu_fwd
from kiln.backend.cuda.graph import capture
from kiln.backend.cuda.layer_norm import (
    add_layer_norm_bwd,
    add_layer_norm_fwd,
    layer_norm_bwd,
    layer_norm_fwd,
)
from kiln.backend.cuda.lm_head import lm_head_xent_bwd, lm_head_xent_fwd
from kiln.backend.cuda.matmul import linear_bwd, linear_fwd, linear_gelu_bwd, linear_gelu_fwd, matmul
from kiln.backend.cuda.random import generator_state, new_generator, rng_normal, rng_uniform, set_generator_state
from kiln.backend.cuda.softmax import (
    log_softmax_bwd,
    log_softmax_fwd,
    softmax_bwd,
    softmax_fwd,
)
from kiln.backend.cuda.streams import (
    copy_async,
    elapsed_ms,
    event,
    new_stream,
    on_device,
    pinned_empty,
    use_stream,
)
from kiln.backend.interface import FACTS, exports

try:
    import cupy as xp
except ImportError:  # ensure_available() says so; the module still imports
    xp = None

name = "cuda"
host_memory = False  # arrays live in device memory: batches and checkpoints are copied across
captures_graphs = True  # a step can be recorded once and replayed as a CUDA graph (kiln.graph)
MATMUL_PRECISIONS = PRECISIONS

__all__ = [*exports(captures_graphs=True), *FACTS]


def asarray(data, dtype=None):
    """A device array from a NumPy/CuPy array, list or scalar (host data is copied to the device)."""
    stream()
    if isinstance(data, xp.ndarray):
        return data if dtype is None or data.dtype == np.dtype(dtype) else data.astype(dtype)
    host = np.asarray(data, dtype=dtype)
    try:
        return xp.asarray(host)
    except (TypeError, ValueError):  # a dtype CuPy cannot take from the host (ml_dtypes): go via float32
        return xp.asarray(host.astype(np.float32)).astype(host.dtype)


def to_numpy(array) -> np.ndarray:
    """A host copy (waits for the work that produces it)."""
    stream()
    try:
        return xp.asnumpy(array)
    except (TypeError, ValueError):
        return xp.asnumpy(array.astype(np.float32)).astype(array.dtype)


def empty(shape, dtype):
    stream()
    return xp.empty(shape, dtype=dtype)


def zeros(shape, dtype):
    stream()
    return xp.zeros(shape, dtype=dtype)


def scatter_add(dst, index, src) -> None:
    """dst[index] += src with repeated indices adding up (atomics: order, so low bits, may vary)."""
    stream()
    if dst.dtype in (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64):
        xp.add.at(dst, index, src.astype(dst.dtype, copy=False) if hasattr(src, "astype") else src)
        return
    acc = dst.astype(np.float32)  # no atomics in this dtype: accumulate in float32
    xp.add.at(acc, index, src.astype(np.float32) if hasattr(src, "astype") else src)
    dst[...] = acc.astype(dst.dtype)
