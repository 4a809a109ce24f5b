"""DP x TP x CP of one GPT on a DeviceMesh (paper §2.2, DTMS): the strategies are chosen by the
mesh's sizes and the model code does not change.

    mesh = DeviceMesh({"dp": -1, "tp": 2, "cp": 2})
    run = ModelParallel(GPT(cfg), mesh)                 # shards the dense weights (TP), shards attention (CP)
    idx, targets, pos = run.batch(x, y)                 # this rank's rows (dp) and tokens (cp, zigzag)
    loss = run.model(idx, targets, pos)[1]; loss.backward()
    run.wait_gradients(); run.clip_grad_norm_(1.0); optimizer.step()
    state = run.dense_state_dict()                      # the dense GPT's: loads into any layout or one process

Gradients are averaged over the ranks that hold the same shards (dp x cp: each holds other rows
or other tokens of the batch, and the loss is their mean) by DistributedDataParallel on that group;
the tp ranks' replicated parameters get equal gradients by construction (tensor_parallel).
"""

from __future__ import annotations

import math

from kiln.distributed.context_parallel import (
    TRANSPORTS,
    parallelize_context,
    sequence_positions,
    shard_sequence,
)
from kiln.distributed.ddp import DistributedDataParallel
from kiln.distributed.tensor_parallel import (
    dense_state_dict,
    parallelize_tensor,
    shard_layout,
)
from kiln.errors import ConfigError, ShapeError
from kiln.tensor import Tensor


class ModelParallel:
    def __init__(self, model, mesh, chunks: int = 1, transport: str = "p2p", zigzag: bool = True,
                 bucket_cap_mb: float = 25.0):
        """model: a dense GPT, the same on every rank (same seed, or loaded from one state dict);
        mesh: a DeviceMesh with any of dp, tp, cp (absent: size 1); chunks: async TP's N;
        transport: context parallelism's p2p / all_gather / all_to_all; zigzag: CP's load balance."""
        if transport not in TRANSPORTS:
            raise ConfigError(f"unknown context-parallel transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")
        self.mesh, self.zigzag = mesh, zigzag
        self.sizes = {name: (mesh.size(name) if name in mesh.names else 1) for name in ("dp", "tp", "cp")}
        self.coordinate = {name: mesh.coordinate.get(name, 0) for name in ("dp", "tp", "cp")}
        self.tp = mesh["tp"] if self.sizes["tp"] > 1 else None
        self.cp = mesh["cp"] if self.sizes["cp"] > 1 else None
        if self.tp is not None:
            parallelize_tensor(model, self.tp, chunks)
        if self.cp is not None:
            parallelize_context(model, self.cp, transport, zigzag)
        self.model = model
        # the ranks holding this rank's shards: one per (dp, cp) place, with this tp coordinate
        self.grad_group = mesh.group.split(self.coordinate["tp"])
        self.ddp = None
        if self.grad_group.size > 1:
            self.ddp = DistributedDataParallel(model, group=self.grad_group, bucket_cap_mb=bucket_cap_mb)

    def batch(self, idx, targets=None):
        """(idx, targets, pos) of this rank from the global batch [B, T] (arrays or Tensors): the
        dp rank's rows, the cp rank's tokens (zigzag: chunks r and 2W-1-r) and their positions."""
        dp, cp = self.sizes["dp"], self.sizes["cp"]
        arrays = [a.data if isinstance(a, Tensor) else a for a in (idx, targets) if a is not None]
        b, t = arrays[0].shape
        if b % dp:
            raise ShapeError(f"data parallelism over {dp} ranks splits the batch's {b} rows: they must divide evenly")
        rows = slice(self.coordinate["dp"] * (b // dp), (self.coordinate["dp"] + 1) * (b // dp))
        rank = self.coordinate["cp"]
        out = [Tensor(shard_sequence(a[rows], rank, cp, self.zigzag) if cp > 1 else a[rows]) for a in arrays]
        pos = Tensor(sequence_positions(t, rank, cp, self.zigzag) if cp > 1 else _arange(t))
        return out[0], (out[1] if len(out) > 1 else None), pos

    def wait_gradients(self) -> None:
        """Every gradient averaged over the dp x cp ranks (no-op when there are none)."""
        if self.ddp is not None:
            self.ddp.wait_gradients()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)) (torch's coefficient), norm the
        dense model's global L2 norm: the squares of the tp shards summed over tp, the replicated
        parameters' counted once. Call after wait_gradients(); returns the norm."""
        if not max_norm > 0:
            raise ConfigError(f"clip_grad_norm_ needs max_norm > 0, got {max_norm}")
        layout = shard_layout(self.model) if self.tp is not None else {}
        grads = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
        backend = grads[0][1].backend
        sharded = [g.data for name, g in grads if name in layout]
        squares = backend.xp.asarray([float(backend.grad_norm(sharded)) ** 2 if sharded else 0.0])
        if self.tp is not None:
            self.tp.all_reduce(Tensor._wrap(squares, grads[0][1].device))
        replicated = [g.data for name, g in grads if name not in layout]
        norm = math.sqrt(float(squares[0]) + float(backend.grad_norm(replicated)) ** 2)
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for _, g in grads:
                g.data *= coef
        return norm

    def dense_state_dict(self) -> dict:
        """The dense GPT's parameters (backend arrays; collective over tp) - a checkpoint of any layout."""
        if self.tp is None:
            return {name: p.data.copy() for name, p in self.model.named_parameters()}
        return dense_state_dict(self.model, self.tp)


def _arange(t: int):
    import numpy as np
    return np.arange(t)
