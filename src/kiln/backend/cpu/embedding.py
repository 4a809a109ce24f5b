"""Embedding lookup and its deterministic scatter-add backward."""

import numpy as np

from kiln.backend.cpu.compute import upcast
from kiln.errors import ShapeError


def embedding_fwd(weight, idx):
    """out[..., C] = weight[idx[...]]."""
    return weight[idx]


def embedding_bwd(grad, idx, num_embeddings, into=None):
    """dweight[V, C]: the rows of grad summed by index, in index order (deterministic); with `into`, a
    [V, C] array the sums are added to in place (each present row rounded once, as on the GPU; an
    absent row keeps its bits), and returned."""
    c = grad.shape[-1]
    dweight = np.zeros((num_embeddings, c), dtype=upcast(grad).dtype)
    np.add.at(dweight, idx.reshape(-1), upcast(grad).reshape(-1, c))
    if into is None:
        return dweight.astype(grad.dtype, copy=False)
    if into.shape != dweight.shape:
        raise ShapeError(f"embedding_bwd into an array of shape {into.shape}, not the weight's {dweight.shape}")
    flat = idx.reshape(-1)
    rows = np.zeros(num_embeddings, dtype=bool)  # the rows the GPU writes
    rows[flat[(flat >= 0) & (flat < num_embeddings)]] = True
    into[rows] = (upcast(into[rows]) + dweight[rows]).astype(into.dtype)
    return into
