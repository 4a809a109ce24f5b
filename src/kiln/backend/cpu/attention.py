"""Causal scaled-dot-product attention, with the flash-attention interface.

The forward returns the output and the per-row log-sum-exp of the scaled scores; the backward
recomputes the probabilities from them, so the [T, T] matrix is not saved between the two.
"""

import functools

import numpy as np

from kiln.backend.cpu.compute import upcast


def _c(a):
    """Contiguous compute-dtype operand: NumPy's batched matmul is only fast on those."""
    return np.ascontiguousarray(upcast(a))


def _transposed(a):
    """a's last two axes swapped, contiguous: NumPy's batched matmul is ~2x slower on a transposed
    right operand than on a copied one (its copy included)."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


@functools.lru_cache(maxsize=8)
def _causal_mask(tq: int, tk: int, offset: int, dtype) -> np.ndarray:
    """[Tq, Tk]: 0 where key j <= query i + offset, -inf elsewhere (read-only, shared)."""
    m = np.triu(np.full((tq, tk), -np.inf, dtype=dtype), 1 + offset)
    m.flags.writeable = False
    return m


def _scores(q, k, scale, causal, offset):
    """scale * q @ k^T, masked when causal; the scale is applied to k^T ([D, Tk]), not to the [Tq, Tk] scores."""
    kt = _transposed(k)
    kt *= scale
    s = q @ kt
    if causal:
        s += _causal_mask(q.shape[-2], k.shape[-2], offset, s.dtype)
    return s


def attention_fwd(q, k, v, scale, causal=True, offset=0):
    """(out, lse) for q [B, H, Tq, D] and k, v [B, H, Tk, D]; causal (query i sees keys
    j <= i + offset: offset 0 with Tq == Tk is self-attention) or, for context parallelism's
    off-diagonal blocks (§4.3), every query sees every key. offset >= 0: no row is empty."""
    s = _scores(_c(q), _c(k), scale, causal, offset)
    m = s.max(axis=-1, keepdims=True)
    s -= m
    p = np.exp(s, out=s)
    denom = p.sum(axis=-1, keepdims=True)
    p /= denom
    out = p @ _c(v)
    lse = (m + np.log(denom))[..., 0]
    return out.astype(q.dtype, copy=False), lse


def attention_bwd(grad, q, k, v, out, lse, scale, into=None, causal=True, offset=0):
    """(dq, dk, dv) from the saved inputs, output and log-sum-exp (the mask as attention_fwd's);
    copied into `into` = (dq, dk, dv) when given (views of one packed gradient, as the CUDA
    kernels write them)."""
    g, qc, kc, vc = _c(grad), _c(q), _c(k), _c(v)
    s = _scores(qc, kc, scale, causal, offset)
    s -= lse[..., None]
    p = np.exp(s, out=s)
    dv = np.swapaxes(p, -1, -2) @ g
    dp = g @ _transposed(vc)
    dp -= (g * upcast(out)).sum(axis=-1, keepdims=True)
    dp *= p
    dq = dp @ kc
    dq *= scale  # the scale on the [T, D] products, not on the [T, T] dp
    dk = np.swapaxes(dp, -1, -2) @ qc
    dk *= scale
    grads = (dq.astype(q.dtype, copy=False), dk.astype(k.dtype, copy=False), dv.astype(v.dtype, copy=False))
    if into is None:
        return grads
    for dst, src in zip(into, grads):
        dst[...] = src
    return tuple(into)
