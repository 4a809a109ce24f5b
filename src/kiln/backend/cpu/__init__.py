"""The CPU backend: NumPy arrays and the reference kernels every other backend is tested against.

Kernels compute in float64 for float64 inputs and in float32 otherwise (bfloat16 and float16
inputs are upcast, as a GPU kernel with fp32 accumulation does), and return the input dtype.
"""

from __future__ import annotations

import contextlib

import numpy as np

from kiln.backend.cpu import heap
from kiln.backend.cpu.adamw import adamw_step, grad_norm, grad_norm_parts, scale_
from kiln.backend.cpu.attention import attention_bwd, attention_fwd
from kiln.backend.cpu.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
from kiln.backend.cpu.dropout import dropout_fwd
from kiln.backend.cpu.elementwise import add, cast
from kiln.backend.cpu.embedding import embedding_bwd, embedding_fwd
from kiln.backend.cpu.gelu import gelu_bwd, gelu_bwd_bias, gelu_fwd
from kiln.backend.cpu.layer_norm import (
    add_layer_norm_bwd,
    add_layer_norm_fwd,
    layer_norm_bwd,
    layer_norm_fwd,
)
from kiln.backend.cpu.lm_head import lm_head_xent_bwd, lm_head_xent_fwd
from kiln.backend.cpu.matmul import linear_bwd, linear_fwd, linear_gelu_bwd, linear_gelu_fwd, matmul
from kiln.backend.cpu.softmax import (
    log_softmax_bwd,
    log_softmax_fwd,
    softmax_bwd,
    softmax_fwd,
)
from kiln.backend.cpu.streams import (
    copy_async,
    elapsed_ms,
    event,
    new_stream,
    on_device,
    pinned_empty,
    stream,
    use_stream,
)
from kiln.backend.interface import FACTS, exports
from kiln.errors import ConfigError

xp = np
name = "cpu"
host_memory = True  # arrays are host memory: the loader and checkpoints need no staging copies
captures_graphs = False  # kernels run as they are called: there is no graph to record (kiln.graph)
MATMUL_PRECISIONS = ("fp32", "bf16")  # no tensor cores, so no tf32

__all__ = [*exports(captures_graphs=False), *FACTS]

_matmul_precision = "fp32"


def set_matmul_precision(mode: str) -> None:
    """Recorded only: CPU GEMMs compute in their operands' dtype (the reference; see ops.matmul)."""
    global _matmul_precision
    if mode not in MATMUL_PRECISIONS:
        raise ConfigError(f"unknown CPU matmul precision {mode!r}; allowed: {', '.join(MATMUL_PRECISIONS)}")
    _matmul_precision = mode


def get_matmul_precision() -> str:
    return _matmul_precision


def end_warmup() -> None:
    """The first step is done: from now on the host heap keeps what a step frees for the next one
    (heap.keep_freed_memory: no fresh mmap, no page faults, for every large temporary of every step)."""
    heap.keep_freed_memory()


def memory_stats() -> dict:
    """No allocator statistics on the host."""
    return {}


def release_unused() -> int:
    """Nothing cached to give back (NumPy frees memory itself): 0 bytes released."""
    return 0


def ensure_available() -> None:
    """The CPU is always there."""


def asarray(data, dtype=None):
    """An array of this backend from a host or device array, list or scalar (copies when needed)."""
    if hasattr(data, "get") and not isinstance(data, np.ndarray):  # a CuPy array
        data = data.get()
    return np.asarray(data, dtype=dtype)


def to_numpy(array) -> np.ndarray:
    return array


def empty(shape, dtype):
    return np.empty(shape, dtype=dtype)


def zeros(shape, dtype):
    return np.zeros(shape, dtype=dtype)


def new_generator(seed: int):
    return np.random.Generator(np.random.PCG64(seed))


def generator_state(gen) -> dict:
    return gen.bit_generator.state


def set_generator_state(gen, state: dict) -> None:
    gen.bit_generator.state = state


def rng_normal(gen, shape, dtype):
    return gen.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False) \
        if np.dtype(dtype) != np.float64 else gen.standard_normal(shape)


def rng_uniform(gen, shape, dtype):
    return gen.random(shape, dtype=np.float32).astype(dtype, copy=False) \
        if np.dtype(dtype) != np.float64 else gen.random(shape)


def scatter_add(dst, index, src) -> None:
    """dst[index] += src with repeated indices adding up (the backward of integer indexing)."""
    np.add.at(dst, index, src)


def device_name() -> str:
    """This machine's processor and core count (the key of the profiler's cached ceilings)."""
    import os
    import platform
    return f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}"


def range_push(name: str) -> None:
    """NVTX ranges are a CUDA tool: nothing to mark on the CPU."""


def range_pop() -> None:
    """See range_push."""


@contextlib.contextmanager
def observe_allocations(callback):
    """NumPy allocates for the CPU backend, outside kiln: there is no allocator to observe (yields None)."""
    yield None


def synchronize() -> None:
    """Nothing to wait for: NumPy runs each kernel to completion."""
