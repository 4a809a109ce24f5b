"""The host heap after the first step: what a step frees stays in the process for the next one.

NumPy takes each array from malloc, and glibc serves an allocation of 128 KiB or more (a threshold that
only grows as such blocks are freed) with a fresh mmap, and trims the heap's free top back to the system:
every step of a CPU training then faults its temporaries' pages in again. Once the first step has shown
the step's sizes (end_warmup, the Trainer's cue for the GPU's caching allocator too), this sets glibc's
mmap threshold to its maximum (32 MiB on 64-bit) and the trim threshold to 1 GiB, so freed blocks are
reused as they are. The tiny preset's CPU step: median 117.6 -> 90.6 ms over five interleaved rounds,
peak RSS unchanged (2 cores, 2026-12-07: benchmarks/results/cpu_train/cpu-heap-ab-2026-12-07.log).
Nothing to do off glibc (no mallopt).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30


def _mallopt():
    """glibc's mallopt, or None where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None), "mallopt", None)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Set the thresholds above; False where the C library has no mallopt or refused one."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim_set = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)  # set whether or not the first was taken
    return bool(mmap_set and trim_set)
