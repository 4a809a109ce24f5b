"""DP x TP x CP of one GPT on a DeviceMesh (paper §2.2, DTMS): the strategies are chosen by the
mesh's sizes and the model code does not change.

    mesh = DeviceMesh({"dp": -1, "tp": 2, "cp": 2})
    run = ModelParallel(GPT(cfg), mesh)                 # shards the dense weights (TP), shards attention (CP)
    idx, targets, pos = run.batch(x, y)                 # this rank's rows (dp) and tokens (cp, zigzag)
    loss = run.model(idx, targets, pos)[1]; loss.backward()
    run.wait_gradients(); run.clip_grad_norm_(1.0); optimizer.step()
    state = run.dense_state_dict()                      # the dense GPT's: loads into any layout or one process

A loader that reads only this dp rank's rows (the Trainer's) hands them to `run.sequence(x, y)`
instead of `batch`; `optimizer.clip_grad_norm_(1.0, run.grad_norm())` is the clip with no host sync.

Gradients are averaged over the ranks that hold the same shards (dp x cp: each holds other rows
or other tokens of the batch, and the loss is their mean) by DistributedDataParallel on that group;
the tp ranks' replicated parameters get equal gradients by construction (tensor_parallel). The
tp and cp ranks of a replica draw one process's dropout masks (tensor_parallel, context_parallel);
replicas draw theirs as DDP ranks do, each as one process would for its rows.
"""

from __future__ import annotations

from kiln.distributed.context_parallel import (
    TRANSPORTS,
    parallelize_context,
    sequence_positions,
    shard_sequence,
)
from kiln.distributed.ddp import DistributedDataParallel
from kiln.distributed.tensor_parallel import (
    cut_shards,
    gather_shards,
    parallelize_tensor,
    shard_layout,
)
from kiln.errors import ConfigError, KilnError, ShapeError
from kiln.tensor import Tensor, _device_of


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
        dp rank's rows, then `sequence`'s tokens and positions."""
        dp = self.sizes["dp"]
        arrays = [a.data if isinstance(a, Tensor) else a for a in (idx, targets) if a is not None]
        b = arrays[0].shape[0]
        if b % dp:
            raise ShapeError(f"data parallelism over {dp} ranks splits the batch's {b} rows: they must divide evenly")
        rows = slice(self.coordinate["dp"] * (b // dp), (self.coordinate["dp"] + 1) * (b // dp))
        return self.sequence(*(a[rows] for a in arrays))

    def sequence(self, idx, targets=None):
        """(idx, targets, pos) of this rank from its dp rank's rows [B, T] (arrays or Tensors, on
        any device): the cp rank's tokens (zigzag: chunks r and 2W-1-r) and their positions (None
        without context parallelism: 0..T-1)."""
        cp = self.sizes["cp"]
        arrays = [a.data if isinstance(a, Tensor) else a for a in (idx, targets) if a is not None]
        if cp == 1:
            out = [Tensor._wrap(a, _device_of(a)) for a in arrays]
            return out[0], (out[1] if len(out) > 1 else None), None
        rank, t = self.coordinate["cp"], arrays[0].shape[1]
        out = [Tensor._wrap(shard_sequence(a, rank, cp, self.zigzag), _device_of(a)) for a in arrays]
        pos = Tensor(sequence_positions(t, rank, cp, self.zigzag), device=out[0].device)
        return out[0], (out[1] if len(out) > 1 else None), pos

    def wait_gradients(self) -> None:
        """Every gradient averaged over the dp x cp ranks (no-op when there are none)."""
        if self.ddp is not None:
            self.ddp.wait_gradients()

    def grad_norm(self):
        """The dense model's global L2 gradient norm, a 0-d device array (no host sync): the squares
        of the tp shards summed over tp, the replicated parameters' counted once. Call after
        wait_gradients(); AdamW.clip_grad_norm_(max_norm, norm) fuses the clip into its step."""
        layout = shard_layout(self.model) if self.tp is not None else {}
        grads = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
        if not grads:
            raise KilnError("grad_norm found no gradients; call backward() first")
        backend, device = grads[0][1].backend, grads[0][1].device
        xp = backend.xp

        def norm(arrays):
            return backend.grad_norm(arrays) if arrays else xp.zeros((), dtype=grads[0][1].data.dtype)

        if self.tp is None:
            return norm([g.data for _, g in grads])
        squares = xp.reshape(norm([g.data for name, g in grads if name in layout]) ** 2, (1,))
        self.tp.all_reduce(Tensor._wrap(squares, device))
        return xp.sqrt(squares.reshape(()) + norm([g.data for name, g in grads if name not in layout]) ** 2)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)) (torch's coefficient), norm the
        dense model's global L2 norm (grad_norm). Call after wait_gradients(); returns the norm."""
        if not max_norm > 0:
            raise ConfigError(f"clip_grad_norm_ needs max_norm > 0, got {max_norm}")
        norm = float(self.grad_norm())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.data *= coef
        return norm

    def dense_state_dict(self) -> dict:
        """The dense GPT's parameters (backend arrays; collective over tp) - a checkpoint of any layout."""
        return self.gather_dense({name: p.data for name, p in self.model.named_parameters()})

    def gather_dense(self, arrays: dict) -> dict:
        """{name: dense array} from {name: this rank's array} of the parameters or arrays shaped like
        them (AdamW's moments): the tp shards gathered (collective over tp), copies of the rest."""
        if self.tp is None:
            return {name: a.copy() for name, a in arrays.items()}
        return gather_shards(self.model, self.tp, arrays)

    def cut_dense(self, arrays: dict) -> dict:
        """{name: this rank's part} of dense arrays of the parameters (or shaped like them): the
        inverse of gather_dense, no communication."""
        return dict(arrays) if self.tp is None else cut_shards(self.model, self.tp, arrays)
