"""kiln's device generator: counter-based Philox-4x32-10, its state two integers (kernels/random.cu,
whose dropout kernel, drawing from the same generator, dropout.py launches).

State is (seed, offset): offset counts the 4-value groups drawn so far, so a stream is
reproducible, the state is JSON-serialisable, and no device memory holds generator state.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.compiler import FLOAT_CTYPES, register_family
from kiln.backend.cuda.launch import cdiv, ctype, get_kernel, i64
from kiln.errors import KilnError

register_family("random.cu", [f"philox_uniform<{t}>" for t in FLOAT_CTYPES] + [f"philox_normal<{t}>" for t in FLOAT_CTYPES]
                + [f"dropout_fwd<{t}>" for t in FLOAT_CTYPES])

BIT_GENERATOR = "philox4x32-10"


class PhiloxGenerator:
    """A seed and a counter offset; every draw of n values advances the offset by ceil(n / 4)."""

    __slots__ = ("seed", "offset")

    def __init__(self, seed: int, offset: int = 0):
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.offset = int(offset)

    def take(self, n: int) -> int:
        """The offset for a draw of n values, and advance past it."""
        off = self.offset
        self.offset += cdiv(n, 4)
        return off


def new_generator(seed: int) -> PhiloxGenerator:
    return PhiloxGenerator(seed)


def generator_state(gen) -> dict:
    return {"bit_generator": BIT_GENERATOR, "seed": gen.seed, "offset": gen.offset}


def set_generator_state(gen, state: dict) -> None:
    if not isinstance(state, dict) or state.get("bit_generator") != BIT_GENERATOR:
        got = state.get("bit_generator") if isinstance(state, dict) else type(state).__name__
        raise KilnError(f"a cuda generator state must come from {BIT_GENERATOR!r}, got {got!r}")
    gen.seed = int(state["seed"]) & 0xFFFFFFFFFFFFFFFF
    gen.offset = int(state["offset"])


def _fill(kind: str, gen, shape, dtype):
    cp = rt.cupy()
    dtype = np.dtype(dtype)
    t = ctype(dtype)
    if t is None:  # float64 and others: draw float32 and convert
        return _fill(kind, gen, shape, np.float32).astype(dtype)
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    out = cp.empty(shape, dtype=dtype)
    n = math.prod(shape)
    if n:
        off = gen.take(n)
        get_kernel("random.cu", f"philox_{kind}<{t}>")((cdiv(cdiv(n, 4), 256),), (256,),
                                                       (out, i64(n), np.uint64(gen.seed), np.uint64(off)))
    return out


def rng_normal(gen, shape, dtype):
    """Standard normal samples (Box-Muller on Philox output)."""
    return _fill("normal", gen, shape, dtype)


def rng_uniform(gen, shape, dtype):
    """Uniform samples in [0, 1) (24-bit resolution, as float32)."""
    return _fill("uniform", gen, shape, dtype)
