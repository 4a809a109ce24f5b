"""Tensor parallelism (paper §4.2), Megatron-style: each weight matrix split across the ranks of
the tp group so that a transformer block's forward makes exactly two all-reduces.

    f = copy_to_parallel(x, group)     identity forward, all-reduce of the gradient backward
    g = reduce_from_parallel(y, group) all-reduce forward, identity backward

A column-parallel Linear (c_attn, c_fc: each rank owns a slice of the outputs, whole heads for
c_attn) starts with f; a row-parallel Linear (attention c_proj, MLP c_proj: each rank owns a
slice of the inputs) ends with g, its bias added once after the sum. The embedding and the tied
LM head are split over the vocabulary: the embedding's rows outside a rank's range give zeros
(then g), the head gives each rank the logits of its vocabulary slice, and the cross-entropy is
computed from those slices with two small all-reduces (the row max, then the sum of exponentials
with the target's logit): the [N, V] logits are never gathered. LayerNorms and position
embeddings are replicated: their inputs and gradients are the same on every rank.

A GPT's dropouts act only on replicated activations (the embeddings' sum, the row-parallel
outputs), so every tp rank draws one process's masks from its generator, seeded alike: the same
stream within the tp group, as Megatron keeps it for replicated activations.

Async TP (§4.2, the dual-stream all-reduce overlap): a row-parallel Linear can split its tokens
into N chunks; chunk i's all-reduce is launched (on the communication stream, ordered after the
chunk's GEMM by an event: kiln.distributed.nccl_engine) before chunk i+1's GEMM, so they overlap.
On the CPU the MPI all-reduces are non-blocking too; N = 1 is plain TP.
"""

from __future__ import annotations

from kiln.autograd import Function, no_grad
from kiln.backend import array_module
from kiln.errors import ConfigError, ShapeError
from kiln.nn import functional as F
from kiln.nn.layers import Embedding, Linear, as_dtype_of
from kiln.nn.module import Module, Parameter
from kiln.ops.convert import grad_dtype
from kiln.ops.matmul import GELULinear, Linear as LinearOp
from kiln.tensor import Tensor, _device_of


def wrap(array) -> Tensor:
    """A Tensor around a backend array, no copy: the process groups take Tensors."""
    return Tensor._wrap(array, _device_of(array))


def _all_reduce(group, array, op: str = "sum", async_op: bool = False):
    """All-reduce of a contiguous backend array, in place."""
    return group.all_reduce(wrap(array), op, async_op=async_op)


class CopyToParallel(Function):
    """Megatron's f: identity forward; the backward sums the input's gradient over the group."""

    is_view = True  # the output is the input's array: one version counter

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.data.view()

    @staticmethod
    def backward(ctx, g):
        g = g.copy()  # a gradient array may be shared with another node; the sum is in place
        _all_reduce(ctx.group, g)
        return g


class ReduceFromParallel(Function):
    """Megatron's g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.backend.xp.ascontiguousarray(x.data).copy()
        _all_reduce(group, out)
        return out

    @staticmethod
    def backward(ctx, g):
        return g


def copy_to_parallel(x, group):
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x, group):
    return ReduceFromParallel.apply(x, group)


class ChunkedRowParallel(Function):
    """x[..., in/tp] @ w[out, in/tp]^T summed over the group, the tokens in `chunks` pieces whose
    all-reduces run while the next piece's GEMM does (async TP); the backward is a Linear's (g's
    backward is the identity). of_gelu: the GEMMs read gelu(x), made here and not kept (x is the MLP's
    pre-activation under Block.recompute_norm_gelu), and the backward is F.gelu_linear's."""

    fresh_grads = True

    @staticmethod
    def forward(ctx, x, weight, group, chunks, of_gelu):
        backend = x.backend
        ctx.backend, ctx.x_shape, ctx.has_bias, ctx.param_grad_dtype = backend, x.shape, False, grad_dtype(weight)
        ctx.of_gelu = of_gelu
        nx, nw = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if nw or of_gelu else None, weight if nx or of_gelu else None)
        x2 = x.data.reshape(-1, x.shape[-1])
        a = backend.gelu_fwd(x2) if of_gelu else x2
        rows = a.shape[0] // chunks
        pieces, works = [], []
        for i in range(chunks):
            y = backend.linear_fwd(a[i * rows:(i + 1) * rows], weight.data, None)  # GEMM of chunk i
            works.append(_all_reduce(group, y, async_op=True))  # its sum overlaps chunk i+1's GEMM
            pieces.append(y)
        for work in works:
            work.wait()
        y = pieces[0] if chunks == 1 else backend.xp.concatenate(pieces, axis=0)
        return y.reshape(x.shape[:-1] + (weight.shape[0],))

    @staticmethod
    def backward(ctx, g):  # the ops' own backwards, has_bias False: (dx, dw)
        return (GELULinear if ctx.of_gelu else LinearOp).backward(ctx, g)


# ---------------------------------------------------------------------- sharding
def shard(array, axis: int, sections: int, rank: int, size: int):
    """This rank's part of a dense array: `array` split along axis into `sections` equal blocks
    (q, k, v of a packed c_attn: 3), each split in `size` parts, part `rank` of each, joined."""
    xp = array_module(array)
    blocks = xp.split(array, sections, axis=axis)
    return xp.concatenate([xp.split(b, size, axis=axis)[rank] for b in blocks], axis=axis)


def unshard(parts, axis: int, sections: int):
    """The dense array from every rank's shard (the inverse of shard)."""
    xp = array_module(parts[0])
    split = [xp.split(p, sections, axis=axis) for p in parts]
    return xp.concatenate([split[r][s] for s in range(sections) for r in range(len(parts))], axis=axis)


def _divides(what: str, n: int, size: int) -> None:
    if n % size:
        raise ConfigError(f"tensor parallelism over {size} ranks needs {what} divisible by {size}, got {n}")


def _sharded_parameter(p, axis, sections, group):
    return Parameter(wrap(shard(p.data, axis, sections, group.rank, group.size).copy()))


class ColumnParallelLinear(Linear):
    """Linear whose output features are split over the group (f before it); `sections` equal
    blocks of the outputs (3 for a packed q|k|v) are split each, so a rank holds whole heads."""

    def __init__(self, dense: Linear, group, sections: int = 1):
        Module.__init__(self)
        _divides(f"{dense.out_features} output features in {sections} blocks", dense.out_features // sections,
                 group.size)
        self.group, self.sections = group, sections
        self.in_features, self.out_features = dense.in_features, dense.out_features // group.size
        self.weight = _sharded_parameter(dense.weight, 0, sections, group)
        self.bias = None if dense.bias is None else _sharded_parameter(dense.bias, 0, sections, group)
        self.shards = {"weight": (0, sections), "bias": (0, sections)}

    def forward(self, x):
        return Linear.forward(self, copy_to_parallel(x, self.group))

    def forward_gelu(self, x):
        return Linear.forward_gelu(self, copy_to_parallel(x, self.group))

    def forward_of_norm(self, x, s, norm):
        return Linear.forward_of_norm(self, copy_to_parallel(x, self.group), s, norm)


class RowParallelLinear(Linear):
    """Linear whose input features are split over the group; the partial products are summed
    (g) in `chunks` pieces (async TP; 1: one all-reduce), the replicated bias added after."""

    def __init__(self, dense: Linear, group, chunks: int = 1):
        Module.__init__(self)
        _divides(f"{dense.in_features} input features", dense.in_features, group.size)
        if not isinstance(chunks, int) or chunks < 1:
            raise ConfigError(f"async TP chunks must be an integer >= 1, got {chunks!r}")
        self.group, self.chunks = group, chunks
        self.in_features, self.out_features = dense.in_features // group.size, dense.out_features
        self.weight = _sharded_parameter(dense.weight, 1, 1, group)
        self.bias = dense.bias
        self.shards = {"weight": (1, 1)}

    def forward(self, x):
        return self._summed(x, of_gelu=False)

    def forward_of_gelu(self, pre):
        """self(gelu(pre)) keeping pre, not gelu(pre), for the backward (Block.recompute_norm_gelu)."""
        return self._summed(pre, of_gelu=True)

    def _summed(self, x, of_gelu: bool):
        tokens = x.numel() // x.shape[-1]
        if tokens % self.chunks:
            raise ShapeError(f"async TP splits the {tokens} tokens of input {x.shape} into {self.chunks} "
                             "chunks: they must divide evenly")
        if x.shape[-1] != self.in_features:
            raise ShapeError(f"row-parallel linear: input {x.shape} does not fit its {self.in_features} "
                             "input features (this rank's shard)")
        y = ChunkedRowParallel.apply(x, as_dtype_of(self.weight, x), self.group, self.chunks, of_gelu)
        return y if self.bias is None else y + as_dtype_of(self.bias, y)


class VocabParallelEmbedding(Embedding):
    """Embedding whose rows (the vocabulary) are split over the group: a rank looks up the ids in
    its range, zeros elsewhere, and g sums the ranks' lookups. The tied LM head uses the same shard."""

    def __init__(self, dense: Embedding, group):
        Module.__init__(self)
        vocab = dense.weight.shape[0]
        _divides(f"the vocabulary ({vocab})", vocab, group.size)
        self.group, self.per_rank = group, vocab // group.size
        self.start = group.rank * self.per_rank
        self.weight = _sharded_parameter(dense.weight, 0, 1, group)
        self.shards = {"weight": (0, 1)}

    def forward(self, idx):
        xp = idx.backend.xp
        local = idx.data - self.start
        inside = (local >= 0) & (local < self.per_rank)
        rows = F.embedding(Tensor._wrap(xp.where(inside, local, 0), idx.device), self.weight)
        mask = Tensor._wrap(inside[..., None].astype(rows.dtype.np), idx.device)
        return reduce_from_parallel(rows * mask, self.group)


class VocabParallelCrossEntropy(Function):
    """mean over targets != ignore_index of lse(all logits) - logit[target], from each rank's
    logits[N, V/tp] of its vocabulary slice: two all-reduces of [N] and [2, N], never [N, V]."""

    @staticmethod
    def forward(ctx, logits, targets, group, start, ignore_index):
        xp = logits.backend.xp
        lf = logits.data if logits.data.dtype.itemsize >= 4 else logits.data.astype("float32")
        n, per = lf.shape
        t = targets.data
        valid = t != ignore_index
        local = t - start
        inside = valid & (local >= 0) & (local < per)
        local = xp.where(inside, local, 0)
        m = xp.ascontiguousarray(lf.max(axis=1))
        _all_reduce(group, m, "max")
        stats = xp.stack([xp.exp(lf - m[:, None]).sum(axis=1),
                          xp.where(inside, lf[xp.arange(n), local], 0.0)])
        _all_reduce(group, stats)
        lse = m + xp.log(stats[0])
        count = valid.sum()
        loss = xp.where(valid, lse - stats[1], 0.0).sum() / count
        ctx.save_for_backward(logits)
        ctx.meta = (lse, inside, local, valid, count)
        return xp.asarray(loss, dtype=lf.dtype)

    @staticmethod
    def backward(ctx, g):
        (logits,) = ctx.saved
        lse, inside, local, valid, count = ctx.meta
        xp = array_module(lse)
        lf = logits if logits.dtype.itemsize >= 4 else logits.astype("float32")
        p = xp.exp(lf - lse[:, None])
        p[xp.arange(p.shape[0]), local] -= inside.astype(p.dtype)
        p *= xp.where(valid, g / count, 0.0).astype(p.dtype)[:, None]
        return p.astype(logits.dtype, copy=False), None


class VocabParallelHead:
    """The tied (or untied) LM head and loss over a vocabulary split across the group: GPT.forward
    calls it with this rank's head shard; it returns (logits of this rank's slice, loss)."""

    def __init__(self, group, start: int):
        self.group, self.start = group, start

    def __call__(self, x, head, targets, ignore_index: int = -100):
        logits = F.linear(copy_to_parallel(x, self.group), head)
        if targets is None:
            return logits, None
        v = logits.shape[-1]
        loss = VocabParallelCrossEntropy.apply(logits.reshape(-1, v), targets.reshape(-1), self.group,
                                               self.start, ignore_index)
        return logits, loss


def parallelize_tensor(model, group, chunks: int = 1):
    """Turn a dense GPT into this rank's tensor-parallel part, in place: its blocks' Linears become
    column/row-parallel (heads split), its embedding and head vocabulary-parallel, its LayerNorms
    stay replicated; the shards are cut from the dense weights (shard on load). Returns model."""
    cfg = model.config
    _divides(f"model.n_head ({cfg.n_head})", cfg.n_head, group.size)
    if not cfg.tie_weights:
        model.lm_head = ColumnParallelLinear(model.lm_head, group)  # the f is the head's own, below
    with no_grad():
        for block in model.h:
            attn, mlp = block.attn, block.mlp
            attn.c_attn = ColumnParallelLinear(attn.c_attn, group, sections=3)
            attn.n_head = cfg.n_head // group.size
            attn.c_proj = RowParallelLinear(attn.c_proj, group, chunks)
            mlp.c_fc = ColumnParallelLinear(mlp.c_fc, group)
            mlp.c_proj = RowParallelLinear(mlp.c_proj, group, chunks)
        model.wte = VocabParallelEmbedding(model.wte, group)
    model.vocab_parallel = VocabParallelHead(group, model.wte.start)
    return model


def shard_layout(model) -> dict:
    """{parameter name: (axis, sections)} of every tensor-parallel shard of model (others replicated)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, spec in getattr(module, "shards", {}).items():
            if getattr(module, name, None) is not None:
                out[f"{prefix}.{name}" if prefix else name] = spec
    return out


def dense_state_dict(model, group) -> dict:
    """The dense model's state dict (backend arrays) from a tensor-parallel one (collective over tp)."""
    return gather_shards(model, group, {name: p.data for name, p in model.named_parameters()})


def gather_shards(model, group, arrays: dict) -> dict:
    """{name: dense array} from {name: this rank's array} of model's parameters or arrays shaped like
    them (AdamW's moments): every shard all-gathered over the tp group (collective), the replicated
    ones copied as they are."""
    layout = shard_layout(model)
    out = {}
    for name, a in arrays.items():
        if name not in layout:
            out[name] = a.copy()
            continue
        axis, sections = layout[name]
        xp = array_module(a)
        gathered = xp.empty((group.size,) + a.shape, dtype=a.dtype)
        group.all_gather(wrap(gathered), wrap(xp.ascontiguousarray(a)))
        out[name] = unshard(list(gathered), axis, sections)
    return out


def cut_shards(model, group, arrays: dict) -> dict:
    """{name: this rank's part} of dense arrays of model's parameters (or shaped like them): the
    inverse of gather_shards, no communication - a dense checkpoint loads into any tp layout."""
    layout = shard_layout(model)
    out = {}
    for name, a in arrays.items():
        if name in layout:
            axis, sections = layout[name]
            a = shard(a, axis, sections, group.rank, group.size)
        out[name] = a
    return out
