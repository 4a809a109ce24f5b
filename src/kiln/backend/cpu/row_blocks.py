"""CPU kernels by blocks of rows, so that their temporaries stay in cache.

A kernel written as NumPy passes (GELU: a dozen) over arrays larger than a core's L2 cache reads and
writes each pass through the slower caches or memory, and each fresh temporary of that size is new pages
to fault in; run on blocks of about GRAIN_BYTES a row array, every pass after the first finds its block
in L2. gelu.py, layer_norm.py and attention.py run so. An element's arithmetic does not depend on its
neighbours', so elementwise and row-wise results are the same bits as over the whole array at once; a
sum over rows (a weight gradient) adds the blocks' partial sums in block order (add_in_order). A/B on 2
cores (benchmarks/results/cpu_kernels/row-blocks-ab-2026-12-07/): at GPT-2 124M's B4 T1024, GELU fwd+bwd
0.48x the time, LayerNorm 0.70x, attention 0.61x; a 6-layer 768-wide T1024 step 0.78x; the `tiny`
preset's step unchanged (its arrays fit L2 already). Running the blocks on a second thread as well gained
nothing on that machine.
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cpu.compute import upcast

GRAIN_BYTES = 256 << 10  # a block: about this many bytes of one float32 row array


def row_blocks(rows: int, row_bytes: int) -> list[slice]:
    """Consecutive slices covering range(rows), each of about GRAIN_BYTES at row_bytes a row (one row at
    least)."""
    per = max(1, GRAIN_BYTES // max(1, row_bytes))
    return [slice(i, min(rows, i + per)) for i in range(0, rows, per)]


def _rows(a):
    """a as rows of its last axis (a 0-d or 1-d array: one row); a view where a is contiguous."""
    return a.reshape(-1, a.shape[-1]) if a.ndim >= 2 else a.reshape(1, -1)


def by_row_blocks(kernel, out_dtype, first, *rest):
    """kernel(first, *rest) for an elementwise kernel of arrays of one shape, computed in the compute dtype
    block by block and stored into a new array of that shape in out_dtype."""
    out = np.empty(first.shape, out_dtype)
    if out.size == 0:
        return out
    rows, outs = [_rows(a) for a in (first, *rest)], _rows(out)
    for s in row_blocks(outs.shape[0], 4 * outs.shape[1]):
        outs[s] = kernel(*[upcast(r[s]) for r in rows])
    return out


def add_in_order(partials: list):
    """Blocks' partial sums added in block order (a fixed order: the same bits on every run)."""
    total = partials[0].copy()
    for p in partials[1:]:
        total += p
    return total
