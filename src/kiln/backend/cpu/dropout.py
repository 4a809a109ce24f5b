"""Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p)."""

import numpy as np


def dropout_fwd(x, p, gen):
    """(y, mask) where mask holds 0 or 1/(1-p) in x's dtype; the backward is grad * mask."""
    keep = gen.random(x.shape, dtype=np.float32) >= p
    mask = keep.astype(x.dtype) * np.asarray(1.0 / (1.0 - p), dtype=x.dtype)
    return x * mask, mask
