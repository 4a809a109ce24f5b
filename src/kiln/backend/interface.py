"""The backend interface: every name a backend module exports, declared once.

`kiln.backend.cpu` (the reference) and `kiln.backend.cuda` export exactly these names
(tests/test_backend_interface.py holds both to it); the profiler wraps every name of KERNELS.
A backend that records CUDA graphs (`captures_graphs`) exports GRAPH_CAPTURE too.
"""

from __future__ import annotations

# Kernels: the named computations kiln.ops, kiln.optim and autograd call, one family per row.
KERNELS = (
    "add", "cast",                                                             # elementwise
    "scatter_add",                                                             # shape (index backward)
    "matmul", "linear_fwd", "linear_bwd", "linear_gelu_fwd", "linear_gelu_bwd",  # matmul
    "embedding_fwd", "embedding_bwd",                                          # embedding
    "layer_norm_fwd", "layer_norm_bwd", "add_layer_norm_fwd", "add_layer_norm_bwd",  # layer_norm
    "gelu_fwd", "gelu_bwd", "gelu_bwd_bias",                                   # gelu
    "softmax_fwd", "softmax_bwd", "log_softmax_fwd", "log_softmax_bwd",        # softmax
    "cross_entropy_fwd", "cross_entropy_bwd",                                  # cross_entropy
    "lm_head_xent_fwd", "lm_head_xent_bwd",                                    # lm_head
    "attention_fwd", "attention_bwd",                                          # attention
    "dropout_fwd",                                                             # dropout
    "adamw_step", "grad_norm", "grad_norm_parts", "scale_",                    # adamw
)

# Arrays: where bytes live and how host data gets there and back.
ARRAYS = ("asarray", "to_numpy", "empty", "zeros")

# Random streams: one generator per device, its state saved in checkpoints.
RANDOM = ("new_generator", "generator_state", "set_generator_state", "rng_normal", "rng_uniform")

# Streams, events, pinned host memory, copies: what staging, async checkpoints, the profiler and
# a communication stream are written with (no-ops and plain copies on the CPU).
STREAMS = ("stream", "new_stream", "use_stream", "event", "elapsed_ms", "pinned_empty", "copy_async",
           "on_device", "synchronize")

# The device: availability, GEMM precision, the caching allocator.
DEVICE = ("ensure_available", "set_matmul_precision", "get_matmul_precision", "memory_stats", "end_warmup",
          "release_unused")

# Profiling: the device's name (the key of its cached ceilings), NVTX ranges (Nsight Systems shows
# kiln's ops; no-ops on the CPU), and every allocation and free of kiln's allocator (kiln.profiler).
PROFILING = ("device_name", "range_push", "range_pop", "observe_allocations")

# Only for backends with captures_graphs: record a step once, replay it (kiln.graph).
GRAPH_CAPTURE = ("capture", "adamw_hyper_buffer", "adamw_set_hyper")

# Plain attributes every backend has: its name, its array module and what its memory can do.
FACTS = ("name", "xp", "host_memory", "captures_graphs", "MATMUL_PRECISIONS")

FUNCTIONS = KERNELS + ARRAYS + RANDOM + STREAMS + DEVICE + PROFILING


def exports(captures_graphs: bool) -> tuple:
    """The callables a backend exports: FUNCTIONS, plus GRAPH_CAPTURE when it records graphs."""
    return FUNCTIONS + (GRAPH_CAPTURE if captures_graphs else ())
