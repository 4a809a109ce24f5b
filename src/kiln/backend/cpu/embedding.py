"""Embedding lookup and its deterministic scatter-add backward."""

import numpy as np

from kiln.backend.cpu.compute import upcast


def embedding_fwd(weight, idx):
    """out[..., C] = weight[idx[...]]."""
    return weight[idx]


def embedding_bwd(grad, idx, num_embeddings):
    """dweight[V, C]: the rows of grad summed by index, in index order (deterministic)."""
    c = grad.shape[-1]
    dweight = np.zeros((num_embeddings, c), dtype=upcast(grad).dtype)
    np.add.at(dweight, idx.reshape(-1), upcast(grad).reshape(-1, c))
    return dweight.astype(grad.dtype, copy=False)
