"""Context parallelism (paper §4.3): the sequence sharded across the cp group, attention exact.

Each rank holds T/W tokens of every sequence. Attention needs every earlier key, so K/V move
by one of three interchangeable transports:

- "p2p" (ring attention): K/V shards pass around the ring by send/recv while the current block
  is computed; each block's (out, lse) is merged into the running (out, lse) with the stable
  update  out -= sigmoid(lse_b - lse) * (out - out_b),  lse = logaddexp(lse, lse_b).
  The backward has two rotators: K/V go around again (the scores are recomputed from them and
  the final lse), and dK/dV travel with them, collecting each rank's part, until they are home.
- "all_gather": every rank gathers all K/V at once, computes the same blocks, and the dK/dV
  parts are summed home by one reduce-scatter.
- "all_to_all" (Ulysses): an all-to-all trades sequence shards for head shards, each rank runs
  kiln's causal kernel on the whole sequence for H/W heads, and a second all-to-all trades back.

Causal blocks: a key block after the query block is skipped, the diagonal one is masked, those
before it are full. Load balance at the data boundary ("zigzag"): the sequence is cut into 2W
chunks and rank r holds chunks r and 2W-1-r, so every rank does the same work; its token
positions (`sequence_positions`) go to the model with the tokens. With zigzag, a rank's own two
chunks form a causally consistent sequence (the later chunk sees all of the earlier one), so the
diagonal step is one causal call, and every other step is one full block.

Dropout draws the masks one process draws: a rank draws the mask of the whole [B, T, C] sequence
from its generator (in the same state on every rank: the same seed, the same draws before) and
keeps its tokens' rows, so the streams stay aligned too; it costs W times its own tokens' draws.
"""

from __future__ import annotations

import math

from kiln.autograd import Function
from kiln.backend import array_backend, array_module
from kiln.errors import ConfigError, ShapeError
from kiln.nn.layers import Dropout
from kiln.nn.module import Module
from kiln.ops.dropout import Dropout as DropoutOp
from kiln.random import default_generator
from kiln.tensor import Tensor, _device_of

TRANSPORTS = ("p2p", "all_gather", "all_to_all")


def _wrap(array) -> Tensor:
    return Tensor._wrap(array, _device_of(array))


# ---------------------------------------------------------------------- the data boundary
def _check_layout(t: int, size: int, zigzag: bool) -> int:
    parts = 2 * size if zigzag else size
    if t % parts:
        raise ShapeError(f"context parallelism over {size} ranks{' with zigzag' if zigzag else ''} cuts the "
                         f"sequence into {parts} chunks: its length {t} must be divisible by {parts}")
    return t // parts


def sequence_slices(t: int, rank: int, size: int, zigzag: bool) -> list[slice]:
    """The slices of a length-t sequence that rank holds, in its local order."""
    c = _check_layout(t, size, zigzag)
    if not zigzag:
        return [slice(rank * c, (rank + 1) * c)]
    late = 2 * size - 1 - rank
    return [slice(rank * c, (rank + 1) * c), slice(late * c, (late + 1) * c)]


def shard_sequence(array, rank: int, size: int, zigzag: bool, axis: int = 1):
    """This rank's tokens of a [B, T, ...] array (token ids, targets), in its local order."""
    xp = array_module(array)
    t = array.shape[axis]
    index = [slice(None)] * array.ndim
    parts = []
    for s in sequence_slices(t, rank, size, zigzag):
        index[axis] = s
        parts.append(array[tuple(index)])
    return xp.ascontiguousarray(xp.concatenate(parts, axis=axis))


def sequence_positions(t: int, rank: int, size: int, zigzag: bool):
    """The positions (int64) of the tokens this rank holds, for GPT.forward(..., pos=)."""
    import numpy as np
    return np.concatenate([np.arange(s.start, s.stop) for s in sequence_slices(t, rank, size, zigzag)])


# ---------------------------------------------------------------------- blocks of one K/V shard
def _blocks(rank: int, source: int, tl: int, zigzag: bool):
    """(query rows, key rows, causal) for this rank's queries against `source`'s K/V shard."""
    every = slice(0, tl)
    if source == rank:
        return [(every, every, True)]
    if not zigzag:
        return [(every, every, False)] if source < rank else []
    half = tl // 2
    if source < rank:  # both my chunks come after its early chunk and before its late one
        return [(every, slice(0, half), False)]
    return [(slice(half, tl), every, False)]  # only my late chunk sees it, and sees all of it


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """out[rows], lse[rows] <- the softmax over both key sets, stably (sigmoid / log-sum-exp)."""
    xp = array_module(out)
    o, s = out[..., rows, :], lse[..., rows]
    w = xp.exp(-xp.logaddexp(0.0, s - block_lse))  # sigmoid(block_lse - lse), no overflow; 1 when lse=-inf
    o -= w[..., None] * (o - block_out)
    lse[..., rows] = xp.logaddexp(s, block_lse)


class _Ring:
    """The p2p transport's rotator: shards move to rank+1 and arrive from rank-1."""

    def __init__(self, group):
        self.group = group

    def start(self, array):
        """Launch the rotation of array; (received array, work) - wait on work before reading it."""
        recv = array_module(array).empty(array.shape, dtype=array.dtype)
        g = self.group
        work = g.send_recv(_wrap(array), (g.rank + 1) % g.size, _wrap(recv), (g.rank - 1) % g.size, async_op=True)
        return recv, work


def _forward_blocks(backend, q, kv, source, rank, zigzag, scale, out, lse):
    for rows, keys, causal in _blocks(rank, source, q.shape[-2], zigzag):
        o, s = backend.attention_fwd(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], scale, causal=causal)
        _merge(out, lse, rows, o, s)


def _backward_blocks(backend, g, q, kv, out, lse, source, rank, zigzag, scale, dq, dkv):
    for rows, keys, causal in _blocks(rank, source, q.shape[-2], zigzag):
        bq, bk, bv = backend.attention_bwd(g[..., rows, :], q[..., rows, :], kv[0][..., keys, :],
                                           kv[1][..., keys, :], out[..., rows, :], lse[..., rows], scale,
                                           causal=causal)
        dq[..., rows, :] += bq
        dkv[0][..., keys, :] += bk
        dkv[1][..., keys, :] += bv


class RingAttention(Function):
    """Causal attention of this rank's q, k, v [B, H, T/W, D] against the whole sharded sequence,
    by the p2p or all_gather transport; returns this rank's out [B, H, T/W, D]."""

    @staticmethod
    def forward(ctx, q, k, v, group, transport, zigzag, scale):
        backend, xp = q.backend, q.backend.xp
        acc = xp.float64 if q.data.dtype == xp.float64 else xp.float32
        kv = xp.ascontiguousarray(xp.stack([k.data, v.data]))
        out = xp.zeros(q.shape, dtype=acc)
        lse = xp.full(q.shape[:-1], -xp.inf, dtype=acc)
        r, w = group.rank, group.size
        if transport == "all_gather":
            every = _all_gather(group, kv)
            for source in range(w):
                _forward_blocks(backend, q.data, every[source], source, r, zigzag, scale, out, lse)
        else:
            ring = _Ring(group)
            for step in range(w):
                nxt, work = ring.start(kv) if step < w - 1 else (None, None)  # overlaps this block
                _forward_blocks(backend, q.data, kv, (r - step) % w, r, zigzag, scale, out, lse)
                if work is not None:
                    work.wait()
                    kv = nxt
        ctx.save_for_backward(q, k, v)
        ctx.meta = (out, lse, group, transport, zigzag, scale)
        return out.astype(q.data.dtype, copy=False)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved
        out, lse, group, transport, zigzag, scale = ctx.meta
        backend, xp = array_backend(q), array_module(q)
        acc = out.dtype
        g = g.astype(acc, copy=False)
        kv = xp.ascontiguousarray(xp.stack([k, v]))
        dq = xp.zeros(q.shape, dtype=acc)
        r, w = group.rank, group.size
        if transport == "all_gather":
            every = _all_gather(group, kv)  # gathered again, not kept from the forward
            dkv_all = xp.zeros(every.shape, dtype=acc)
            for source in range(w):
                _backward_blocks(backend, g, q, every[source], out, lse, source, r, zigzag, scale, dq,
                                 dkv_all[source])
            dkv = xp.empty(kv.shape, dtype=acc)
            group.reduce_scatter(_wrap(dkv), _wrap(dkv_all))  # each rank's dK/dV home, summed
        else:
            ring = _Ring(group)
            dkv = xp.zeros(kv.shape, dtype=acc)
            for step in range(w):
                nxt, work = ring.start(kv) if step < w - 1 else (None, None)  # rotator 1: K/V
                _backward_blocks(backend, g, q, kv, out, lse, (r - step) % w, r, zigzag, scale, dq, dkv)
                dkv, dwork = ring.start(dkv)  # rotator 2: dK/dV with their owner's part, W hops home
                dwork.wait()
                if work is not None:
                    work.wait()
                    kv = nxt
        return dq.astype(q.dtype, copy=False), dkv[0].astype(k.dtype, copy=False), dkv[1].astype(v.dtype, copy=False)


def _all_gather(group, array):
    """[W, *array.shape]: every rank's array, in rank order."""
    xp = array_module(array)
    out = xp.empty((group.size,) + array.shape, dtype=array.dtype)
    group.all_gather(_wrap(out), _wrap(xp.ascontiguousarray(array)))
    return out


# ---------------------------------------------------------------------- Ulysses
def _layout_order(t: int, size: int, zigzag: bool):
    """The position of each token of the sequence as the ranks hold it, concatenated in rank order."""
    import numpy as np
    return np.concatenate([sequence_positions(t, r, size, zigzag) for r in range(size)])


def _heads_to_ranks(group, x):
    """[B, G, H, T/W, D] of sequence shards -> [B, G, H/W, T, D] of head shards (tokens in rank order)."""
    xp = array_module(x)
    b, n, h, tl, d = x.shape
    w = group.size
    send = xp.ascontiguousarray(x.reshape(b, n, w, h // w, tl, d).transpose(2, 0, 1, 3, 4, 5))  # block j: j's heads
    recv = xp.empty(send.shape, dtype=send.dtype)  # block j: rank j's tokens of my heads
    group.all_to_all(_wrap(recv), _wrap(send))
    return recv.transpose(1, 2, 3, 0, 4, 5).reshape(b, n, h // w, w * tl, d)


def _ranks_to_heads(group, y):
    """The inverse: [B, G, H/W, T, D] head shards (tokens in rank order) -> [B, G, H, T/W, D]."""
    xp = array_module(y)
    b, n, hl, t, d = y.shape
    w = group.size
    send = xp.ascontiguousarray(y.reshape(b, n, hl, w, t // w, d).transpose(3, 0, 1, 2, 4, 5))  # block j: j's tokens
    recv = xp.empty(send.shape, dtype=send.dtype)  # block j: my tokens of rank j's heads
    group.all_to_all(_wrap(recv), _wrap(send))
    return recv.transpose(1, 2, 0, 3, 4, 5).reshape(b, n, w * hl, t // w, d)


class UlyssesAttention(Function):
    """Causal attention by head exchange: all-to-all, kiln's causal kernel over the whole
    sequence for H/W heads, all-to-all back; the backward mirrors it."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, scale):
        backend, xp = q.backend, q.backend.xp
        order = _layout_order(q.shape[-2] * group.size, group.size, zigzag)  # rank-order token i: position order[i]
        order, inverse = xp.asarray(order), xp.asarray(order.argsort())  # device index arrays
        full = _heads_to_ranks(group, xp.stack([q.data, k.data, v.data], axis=1))[:, :, :, inverse]
        qf, kf, vf = full[:, 0], full[:, 1], full[:, 2]
        out, lse = backend.attention_fwd(qf, kf, vf, scale)
        ctx.meta = (qf, kf, vf, out, lse, group, order, inverse, scale, backend)
        return _ranks_to_heads(group, out[:, None, :, order])[:, 0]

    @staticmethod
    def backward(ctx, g):
        qf, kf, vf, out, lse, group, order, inverse, scale, backend = ctx.meta
        gf = _heads_to_ranks(group, g[:, None])[:, 0][:, :, inverse]
        grads = backend.attention_bwd(gf, qf, kf, vf, out, lse, scale)
        d = _ranks_to_heads(group, backend.xp.stack([a[:, :, order] for a in grads], axis=1))
        return d[:, 0], d[:, 1], d[:, 2]


# ---------------------------------------------------------------------- the attention a GPT calls
def context_parallel_attention(q, k, v, group, transport: str = "p2p", zigzag: bool = True, scale=None):
    """Causal attention over a sequence sharded across group: q, k, v [B, H, T/W, D] are this
    rank's tokens (in the layout of `shard_sequence` with this zigzag); returns its out."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown context-parallel transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")
    if not (q.shape == k.shape == v.shape) or q.ndim != 4:
        raise ShapeError(f"context-parallel attention needs q, k, v of one shape [B, H, T/W, D], got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if zigzag and q.shape[-2] % 2:
        raise ShapeError(f"zigzag holds two equal chunks per rank: the local length {q.shape[-2]} must be even")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if transport == "all_to_all":
        if q.shape[1] % group.size:
            raise ConfigError(f"the all_to_all transport splits the {q.shape[1]} heads over {group.size} "
                              "ranks: they must divide evenly")
        return UlyssesAttention.apply(q, k, v, group, zigzag, scale)
    return RingAttention.apply(q, k, v, group, transport, zigzag, scale)


class ContextParallelAttention:
    """What a GPT's CausalSelfAttention calls (its `context`) when the sequence is sharded: the
    packed qkv [B, T/W, 3C] in, [B, T/W, C] out, as F.causal_self_attention."""

    def __init__(self, group, transport: str = "p2p", zigzag: bool = True):
        if transport not in TRANSPORTS:
            raise ConfigError(f"unknown context-parallel transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")
        self.group, self.transport, self.zigzag = group, transport, zigzag

    def __call__(self, qkv, n_head: int):
        b, t, c3 = qkv.shape
        d = c3 // (3 * n_head)
        q, k, v = (x.reshape(b, t, n_head, d).transpose(1, 2) for x in qkv.reshape(b, t, 3, n_head, d).split(1, dim=2))
        y = context_parallel_attention(q, k, v, self.group, self.transport, self.zigzag)
        return y.transpose(1, 2).reshape(b, t, c3 // 3)


# ---------------------------------------------------------------------- dropout
class SequenceShardedDropout(Function):
    """Dropout of this rank's tokens x [B, T/W, ...] with one process's mask of the whole sequence."""

    @staticmethod
    def forward(ctx, x, p, generator, group, zigzag):
        xp = x.backend.xp
        whole = (x.shape[0], x.shape[1] * group.size) + x.shape[2:]
        _, mask = x.backend.dropout_fwd(xp.ones(whole, dtype=x.data.dtype), p, generator.native)
        ctx.mask = shard_sequence(mask, group.rank, group.size, zigzag)
        return x.data * ctx.mask

    backward = staticmethod(DropoutOp.backward)  # g * mask


class ContextParallelDropout(Dropout):
    """A GPT's Dropout when the sequence is sharded across group: the masks of one process."""

    def __init__(self, dense: Dropout, group, zigzag: bool = True):
        Module.__init__(self)
        self.p, self.generator, self.group, self.zigzag = dense.p, dense.generator, group, zigzag

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        generator = self.generator if self.generator is not None else default_generator(x.device)
        return SequenceShardedDropout.apply(x, self.p, generator, self.group, self.zigzag)


def parallelize_context(model, group, transport: str = "p2p", zigzag: bool = True):
    """Make every attention of a GPT attend over the sequence sharded across group, and its
    dropouts draw one process's masks (in place)."""
    context = ContextParallelAttention(group, transport, zigzag)
    model.drop = ContextParallelDropout(model.drop, group, zigzag)
    for block in model.h:
        block.attn.context = context
        block.attn.resid_dropout = ContextParallelDropout(block.attn.resid_dropout, group, zigzag)
        block.mlp.dropout = ContextParallelDropout(block.mlp.dropout, group, zigzag)
    return model
