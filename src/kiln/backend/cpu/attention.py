"""Causal scaled-dot-product attention, with the flash-attention interface.

The forward returns the output and the per-row log-sum-exp of the scaled scores; the backward
recomputes the probabilities from them, so the [T, T] matrix is not saved between the two.

Both run by blocks of heads, or of one head's query rows (row_blocks.GRAIN_BYTES of scores each), so
a block's score matrix stays in cache through its passes and is never made for all heads at once
(GPT-2 124M at B4 T1024: 200 MB a pass before); under the causal mask a block of query rows reads only
the keys its last row sees. The scores are formed transposed ([keys, queries]: the softmax's
reductions run across contiguous rows). dK and dV add the query blocks' products in block order: the
same bits on every run.
"""

import functools

import numpy as np

from kiln.backend.cpu.compute import upcast
from kiln.backend.cpu.row_blocks import row_blocks


def _heads(a):
    """a [..., T, D] as contiguous [heads, T, D] in its compute dtype."""
    return np.ascontiguousarray(upcast(a)).reshape(-1, *a.shape[-2:])


@functools.lru_cache(maxsize=64)
def _causal_mask_t(tk: int, tq: int, offset: int, dtype) -> np.ndarray:
    """[Tk, Tq], the causal mask transposed: 0 where key j <= query i + offset, -inf elsewhere (read-only,
    shared)."""
    m = np.tril(np.full((tk, tq), -np.inf, dtype=dtype), -(1 + offset))
    m.flags.writeable = False
    return m


def _blocks(heads: int, tq: int, tk: int, causal: bool, offset: int):
    """(head slice, query slice, keys) blocks: several heads whole where one head's float32 scores fit in
    row_blocks.GRAIN_BYTES, else one head's query rows of about that; keys: how many keys the block's rows
    see."""
    rows = row_blocks(tq, tk * 4)
    if len(rows) == 1:  # whole heads, four grains a block: a block's passes are then more than NumPy's calls
        return [(hs, rows[0], min(tk, tq + offset) if causal else tk) for hs in row_blocks(heads, tq * tk)]
    return [(slice(h, h + 1), qs, min(tk, qs.stop + offset) if causal else tk) for h in range(heads) for qs in rows]


def _transposed(a):
    """a [heads, T, D] as contiguous [heads, D, T]."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2))


def _scores_t(ks, qt, hs, qs, keys, causal, offset):
    """A block's scores transposed, [heads, keys, rows] = (scale K) @ Q^T, masked when causal: a softmax
    over keys is then a reduction over axis -2, elementwise across contiguous rows, where NumPy's
    reduction over a short last axis (64 keys) is several times slower."""
    s = ks[hs, :keys] @ qt[hs, :, qs]
    if causal:
        s += _causal_mask_t(keys, qs.stop - qs.start, offset + qs.start, s.dtype)
    return s


def attention_fwd(q, k, v, scale, causal=True, offset=0):
    """(out, lse) for q [B, H, Tq, D] and k, v [B, H, Tk, D]; causal (query i sees keys
    j <= i + offset: offset 0 with Tq == Tk is self-attention) or, for context parallelism's
    off-diagonal blocks (§4.3), every query sees every key. offset >= 0: no row is empty."""
    qh, vh = _heads(q), _heads(v)
    qt = _transposed(qh)
    ks = _heads(k) * scale  # scaled once for all blocks, on the [Tk, D] keys, not the [Tk, Tq] scores
    out = np.empty(qh.shape, qh.dtype)
    lse = np.empty(qh.shape[:-1], qh.dtype)
    for hs, qs, keys in _blocks(qh.shape[0], qh.shape[1], ks.shape[1], causal, offset):
        st = _scores_t(ks, qt, hs, qs, keys, causal, offset)
        m = st.max(axis=-2, keepdims=True)
        st -= m
        p = np.exp(st, out=st)
        denom = p.sum(axis=-2, keepdims=True)
        ob = np.matmul(np.swapaxes(p, -1, -2), vh[hs, :keys], out=out[hs, qs])
        ob /= np.swapaxes(denom, -1, -2)  # normalised on the [rows, D] output, not the [keys, rows] p
        lse[hs, qs] = (m + np.log(denom))[:, 0, :]
    return out.reshape(q.shape).astype(q.dtype, copy=False), lse.reshape(q.shape[:-1])


def attention_bwd(grad, q, k, v, out, lse, scale, into=None, causal=True, offset=0):
    """(dq, dk, dv) from the saved inputs, output and log-sum-exp (the mask as attention_fwd's);
    copied into `into` = (dq, dk, dv) when given (views of one packed gradient, as the CUDA
    kernels write them)."""
    g, qh, kh, vh = _heads(grad), _heads(q), _heads(k), _heads(v)
    qt, gt, ks = _transposed(qh), _transposed(g), kh * scale
    delta = np.einsum("htd,htd->ht", g, _heads(out))[:, None, :]  # rowsum(dO * O), [heads, 1, Tq]
    lse_t = upcast(lse).reshape(qh.shape[0], 1, qh.shape[1])
    dq = np.empty(qh.shape, qh.dtype)
    dk, dv = np.zeros(kh.shape, kh.dtype), np.zeros(vh.shape, vh.dtype)
    for hs, qs, keys in _blocks(qh.shape[0], qh.shape[1], kh.shape[1], causal, offset):
        st = _scores_t(ks, qt, hs, qs, keys, causal, offset)
        st -= lse_t[hs, :, qs]
        p = np.exp(st, out=st)  # [heads, keys, rows]
        dv[hs, :keys] += p @ g[hs, qs]
        dp = vh[hs, :keys] @ gt[hs, :, qs]
        dp -= delta[hs, :, qs]
        dp *= p
        np.matmul(np.swapaxes(dp, -1, -2), kh[hs, :keys], out=dq[hs, qs])
        dk[hs, :keys] += dp @ qh[hs, qs]
    dq *= scale  # the scale on the [T, D] products, not on the [T, T] dp
    dk *= scale
    grads = tuple(a.reshape(x.shape).astype(x.dtype, copy=False) for a, x in ((dq, q), (dk, k), (dv, v)))
    if into is None:
        return grads
    for dst, src in zip(into, grads):
        dst[...] = src
    return tuple(into)
