"""Causal scaled-dot-product attention, with the flash-attention interface.

The forward returns the output and the per-row log-sum-exp of the scaled scores; the backward
recomputes the probabilities from them, so the [T, T] matrix is not saved between the two.
"""

import numpy as np

from kiln.backend.cpu.compute import upcast


def _causal_scores(q, k, scale):
    t = q.shape[-2]
    s = (upcast(q) @ np.swapaxes(upcast(k), -1, -2)) * scale
    s[..., np.triu(np.ones((t, t), dtype=bool), 1)] = -np.inf
    return s


def attention_fwd(q, k, v, scale):
    """(out, lse) for q, k, v of shape [B, H, T, D], causal."""
    s = _causal_scores(q, k, scale)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    out = (p / denom) @ upcast(v)
    lse = (m + np.log(denom))[..., 0]
    return out.astype(q.dtype, copy=False), lse


def attention_bwd(grad, q, k, v, out, lse, scale):
    """(dq, dk, dv) from the saved inputs, output and log-sum-exp."""
    g = upcast(grad)
    p = np.exp(_causal_scores(q, k, scale) - lse[..., None])
    dv = np.swapaxes(p, -1, -2) @ g
    dp = g @ np.swapaxes(upcast(v), -1, -2)
    delta = (g * upcast(out)).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta) * scale
    dq = ds @ upcast(k)
    dk = np.swapaxes(ds, -1, -2) @ upcast(q)
    return (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False),
            dv.astype(v.dtype, copy=False))
