"""Softmax cross-entropy from logits, mean over targets that are not ignore_index.

The forward saves only the per-row log-sum-exp; the backward recomputes the softmax from it,
as the fused GPU kernel does, so no [N, V] probability matrix is kept between the two.
"""

import numpy as np

from kiln.backend.cpu.compute import upcast
from kiln.errors import KilnError


def _check_targets(targets, valid, vocab):
    bad = valid & ((targets < 0) | (targets >= vocab))
    if bad.any():
        value = int(targets[bad][0])
        raise KilnError(f"cross_entropy target {value} is outside the vocabulary [0, {vocab})")


def cross_entropy_fwd(logits, targets, ignore_index):
    """(loss as a 0-d array, lse[N]) for logits[N, V] and integer targets[N]."""
    lf = upcast(logits)
    n, vocab = lf.shape
    valid = targets != ignore_index
    _check_targets(targets, valid, vocab)
    safe = np.where(valid, targets, 0)
    m = lf.max(axis=1)
    lse = m + np.log(np.exp(lf - m[:, None]).sum(axis=1))
    picked = lf[np.arange(n), safe]
    losses = np.where(valid, lse - picked, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = losses.sum() / valid.sum()
    return np.asarray(loss, dtype=lf.dtype), lse


def cross_entropy_bwd(grad, logits, targets, lse, ignore_index):
    """dlogits = (softmax(logits) - onehot(targets)) * grad / count, zero on ignored rows."""
    lf = upcast(logits)
    n = lf.shape[0]
    valid = targets != ignore_index
    p = np.exp(lf - lse[:, None])
    p[np.arange(n), np.where(valid, targets, 0)] -= 1.0
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = upcast(grad) / valid.sum()
    p *= np.where(valid, scale, 0.0)[:, None]
    return p.astype(logits.dtype, copy=False)
