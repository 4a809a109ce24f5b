"""Embedding lookup: out[..., C] = weight[idx[...]]; the backward scatters rows back, in order."""

from __future__ import annotations

from functools import partial

from kiln.autograd import DeferredGrad, Function
from kiln.errors import DTypeError, ShapeError


class Embedding(Function):
    fresh_grads = True  # backward returns new arrays (AccumulateGrad keeps them uncopied)

    @staticmethod
    def forward(ctx, weight, idx):
        ctx.meta = (idx.data, weight.shape[0], weight.backend)
        return weight.backend.embedding_fwd(weight.data, idx.data)

    @staticmethod
    def backward(ctx, g):
        idx, num, backend = ctx.meta
        # the scatter adds itself into the weight's pending gradient where there is one (a tied weight's):
        # make(into) is embedding_bwd(g, idx, num, into)
        return DeferredGrad((num, g.shape[-1]), g.dtype, partial(backend.embedding_bwd, g, idx, num)), None


def embedding(idx, weight):
    """Rows of weight[V, C] picked by the integer tensor idx."""
    if idx.dtype.is_floating or idx.dtype.name == "bool":
        raise DTypeError(f"embedding indices must be integers, got {idx.dtype}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding weight must be 2-D [num_embeddings, dim], got {weight.shape}")
    if idx.device.type == "cpu" and idx.numel():
        lo, hi = int(idx.data.min()), int(idx.data.max())
        if lo < 0 or hi >= weight.shape[0]:
            bad = lo if lo < 0 else hi
            raise ShapeError(f"embedding index {bad} is out of range for {weight.shape[0]} embeddings")
    return Embedding.apply(weight, idx)
