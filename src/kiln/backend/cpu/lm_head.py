"""The fused LM head: logits = x @ weight^T and their softmax cross-entropy, in chunks of rows.

The [N, V] logits and their gradient are never kept whole: each chunk's logits are made,
reduced to per-row losses and turned into dlogits in place, and dlogits go straight into dx
(its rows) and dweight (accumulated over the chunks), all in the forward. The backward only
scales those by the loss's upstream gradient. This is the reference the GPU version is
checked against (the same chunking and roundings: logits and dlogits in x's dtype).
"""

import numpy as np

from kiln.backend.cpu.compute import compute_dtype, upcast
from kiln.backend.cpu.cross_entropy import _check_targets
from kiln.backend.cpu.matmul import _gemm

CHUNK_BYTES = 512 << 20  # logits of one chunk: 4 chunks of 4096 rows for B16 T1024, V 50304 in bf16


def chunk_rows_for(n: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk: as many as fit CHUNK_BYTES of logits, the chunks of near-equal size."""
    per = max(1, CHUNK_BYTES // max(1, vocab * itemsize))
    chunks = -(-n // per)
    return -(-n // max(1, chunks))


def lm_head_xent_fwd(x, weight, targets, ignore_index, chunk_rows=None, need_dx=True, need_dw=True):
    """(loss 0-d, dx [N, C] in x's dtype or None, dweight [V, C] in the compute dtype or None) for
    the mean cross-entropy of x[N, C] @ weight[V, C]^T against targets[N]; grads are d loss."""
    n, c = x.shape
    vocab = weight.shape[0]
    chunk_rows = chunk_rows or chunk_rows_for(n, vocab, x.dtype.itemsize)
    acc = compute_dtype(x.dtype)
    valid = targets != ignore_index
    _check_targets(targets, valid, vocab)
    count = valid.sum()
    with np.errstate(divide="ignore"):
        scale = acc.type(1.0) / acc.type(count)
    dx = np.empty((n, c), dtype=x.dtype) if need_dx else None
    dw = np.zeros((vocab, c), dtype=acc) if need_dw else None
    losses = np.zeros(n, dtype=acc)
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        xc, tc, vc = x[r0:r1], targets[r0:r1], valid[r0:r1]
        lf = upcast(_gemm(xc, weight.T, x.dtype))  # the chunk's logits, rounded to x's dtype
        m = lf.max(axis=1)
        lse = m + np.log(np.exp(lf - m[:, None]).sum(axis=1))
        rows = np.arange(r1 - r0)
        safe = np.where(vc, tc, 0)
        losses[r0:r1] = np.where(vc, lse - lf[rows, safe], 0.0)
        p = np.exp(lf - lse[:, None])
        p[rows, safe] -= 1.0
        p *= np.where(vc, scale, 0.0)[:, None]
        g = p.astype(x.dtype, copy=False)  # dlogits in the logits' dtype, as the GPU writes them
        if need_dx:
            dx[r0:r1] = _gemm(g, weight, x.dtype)
        if need_dw:
            dw += upcast(g).T @ upcast(xc)
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = losses.sum() / count
    return np.asarray(loss, dtype=acc), dx, dw


def lm_head_xent_bwd(grad, dx, dweight, weight_dtype):
    """(grad * dx, grad * dweight in weight_dtype): the forward's gradients scaled by the upstream one
    (None: the implicit 1 of loss.backward(), nothing to scale)."""
    if grad is None:
        return dx, (None if dweight is None else dweight.astype(weight_dtype, copy=False))
    g = upcast(np.asarray(grad))
    out_dx = None if dx is None else (upcast(dx) * g).astype(dx.dtype, copy=False)
    out_dw = None if dweight is None else (dweight * g).astype(weight_dtype, copy=False)
    return out_dx, out_dw
