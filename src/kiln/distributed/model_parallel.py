"""DP x TP x CP of one GPT on a DeviceMesh (paper §2.2, DTMS): the strategies are chosen by the
mesh's sizes and the model code does not change.

    mesh = DeviceMesh({"dp": -1, "tp": 2, "cp": 2})
    run = ModelParallel(GPT(cfg), mesh, parallel="zero2",                # shards the dense weights (TP),
                        optimizer=lambda m: AdamW(gpt_param_groups(m, 0.1)))  # attention (CP), AdamW (ZeRO)
    idx, targets, pos = run.batch(x, y)                 # this rank's rows (dp) and tokens (cp, zigzag)
    loss = run.model(idx, targets, pos)[1]; loss.backward()
    run.wait_gradients(); run.optimizer.clip_grad_norm_(1.0, run.grad_norm()); run.optimizer.step()
    model, optimizer = run.dense_state()                # the dense GPT's and AdamW's: load into any layout or one process

A loader that reads only this dp rank's rows (the Trainer's) hands them to `run.sequence(x, y)`
instead of `batch`.

Gradients are averaged over the ranks that hold the same shards (dp x cp: each holds other rows
or other tokens of the batch, and the loss is their mean) by a data-parallel wrapper on that group:
DDP, or ZeRO-1/2 or FSDP, which shard the tp/cp-local parameters over those ranks (a tp rank's
shard of a column/row-parallel weight is sharded again, a replicated LayerNorm as in plain ZeRO);
the tp ranks' replicated parameters get equal gradients by construction (tensor_parallel). The
tp and cp ranks of a replica draw one process's dropout masks (tensor_parallel, context_parallel);
replicas draw theirs as DDP ranks do, each as one process would for its rows.
"""

from __future__ import annotations

from kiln.backend import array_backend
from kiln.distributed.context_parallel import (
    TRANSPORTS,
    parallelize_context,
    sequence_positions,
    shard_sequence,
)
from kiln.distributed.ddp import DistributedDataParallel
from kiln.distributed.fsdp import FullyShardedDataParallel
from kiln.distributed.tensor_parallel import (
    cut_shards,
    gather_shards,
    parallelize_tensor,
    shard_layout,
)
from kiln.distributed.zero import ZeroDataParallel
from kiln.errors import ConfigError, KilnError, ShapeError
from kiln.tensor import Tensor, _device_of

DATA_PARALLEL = ("ddp", "zero1", "zero2", "fsdp")  # how the ranks holding the same shards share gradients


class ModelParallel:
    def __init__(self, model, mesh, chunks: int = 1, transport: str = "p2p", zigzag: bool = True,
                 bucket_cap_mb: float = 25.0, parallel: str = "ddp", optimizer=None):
        """model: a dense GPT, the same on every rank (same seed, or loaded from one state dict);
        mesh: a DeviceMesh with any of dp, tp, cp (absent: size 1); chunks: async TP's N;
        transport: context parallelism's p2p / all_gather / all_to_all; zigzag: CP's load balance;
        parallel: the data-parallel wrapper over the dp x cp ranks (DATA_PARALLEL); optimizer: a
        function of the tp/cp-local model that returns its kiln AdamW (zero1, zero2 and fsdp need it:
        the wrapper shards it). `run.optimizer` is then what steps: the AdamW or its sharded form."""
        if transport not in TRANSPORTS:
            raise ConfigError(f"unknown context-parallel transport {transport!r}; allowed: {', '.join(TRANSPORTS)}")
        if parallel not in DATA_PARALLEL:
            raise ConfigError(f"unknown data-parallel mode {parallel!r} for a mesh; allowed: {', '.join(DATA_PARALLEL)}")
        if parallel != "ddp" and optimizer is None:
            raise ConfigError(f"parallel {parallel!r} shards the optimizer: give ModelParallel optimizer=, a function "
                              "of the model that returns its AdamW")
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
        self.adamw = None if optimizer is None else optimizer(model)
        self.optimizer = self.adamw
        # the ranks holding this rank's shards: one per (dp, cp) place, with this tp coordinate
        self.grad_group = mesh.group.split(self.coordinate["tp"])
        self.data_parallel = None  # DDP, ZeRO or FSDP over grad_group; None when this rank is the only one
        if self.grad_group.size > 1:
            if parallel == "ddp":
                self.data_parallel = DistributedDataParallel(model, group=self.grad_group, bucket_cap_mb=bucket_cap_mb)
            elif parallel == "fsdp":
                self.data_parallel = FullyShardedDataParallel(model, self.adamw, group=self.grad_group)
            else:
                self.data_parallel = ZeroDataParallel(model, self.adamw, stage=int(parallel[-1]), group=self.grad_group,
                                                      bucket_cap_mb=bucket_cap_mb)
            if parallel != "ddp":
                self.optimizer = self.data_parallel.optimizer
        self.sharded = parallel != "ddp" and self.data_parallel is not None

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
        if self.data_parallel is not None:
            self.data_parallel.wait_gradients()

    def grad_norm(self):
        """The dense model's global L2 gradient norm, a 0-d device array (no host sync), one process's:
        each rank takes the norm of the gradients it holds (ZeRO/FSDP: its pieces of the averaged
        shards; the tp-replicated parameters' on tp rank 0 alone, every tp rank holding the same), and
        the squares are summed over the ranks that hold distinct pieces (tp, and the dp x cp ranks when
        sharded). Call after wait_gradients(); AdamW.clip_grad_norm_(max_norm, norm) (or the sharded
        optimizer's) fuses the clip into its step."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        if self.sharded:
            pieces = [(names[id(p)], g) for p, g in self.optimizer.gradient_pieces()]
        else:
            pieces = [(n, p.grad.data) for n, p in self.model.named_parameters() if p.grad is not None]
        if not pieces:
            raise KilnError("grad_norm found no gradients; call backward() first")
        backend = array_backend(pieces[0][1])
        over = self.mesh.group if self.sharded else self.tp
        if over is None:  # every rank holds every gradient
            return backend.grad_norm([g for _, g in pieces])
        layout = shard_layout(self.model) if self.tp is not None else {}
        mine = [g for n, g in pieces if n in layout or self.coordinate["tp"] == 0]
        xp = backend.xp
        norm = backend.grad_norm(mine).astype("float64") if mine else xp.zeros((), "float64")
        total = xp.reshape(norm * norm, (1,))
        over.all_reduce(Tensor._wrap(total, _device_of(total)), "sum")
        wide = all(g.dtype == xp.float64 for _, g in pieces)  # the dtype backend.grad_norm gives
        return xp.sqrt(total[0]).astype("float64" if wide else "float32")

    def dense_state_dict(self) -> dict:
        """The dense GPT's parameters (backend arrays; collective over tp, and over dp x cp under FSDP) -
        a checkpoint of any layout."""
        return self.gather_dense(self._local_parameters())

    def dense_state(self) -> tuple[dict, dict]:
        """(the dense GPT's parameters, its AdamW's state_dict with the parameters' names under
        "params"), as one process's training holds them: the ZeRO/FSDP shards gathered over dp x cp,
        then the tp shards over tp (collective). Loads into any layout (load_dense_state) or one process."""
        if self.adamw is None:
            raise KilnError("ModelParallel.dense_state: this run was built without optimizer=, so it has no "
                            "optimizer state; dense_state_dict() gives the parameters")
        names = {id(p): n for n, p in self.model.named_parameters()}
        optimizer = self.optimizer.full_state_dict() if self.sharded else self.adamw.state_dict()
        optimizer["params"] = [names[id(p)] for p in self.adamw.params]
        for kind in ("exp_avg", "exp_avg_sq"):
            if optimizer[kind] is not None:
                dense = self.gather_dense(dict(zip(optimizer["params"], optimizer[kind])))
                optimizer[kind] = [dense[n] for n in optimizer["params"]]
        return self.dense_state_dict(), optimizer

    def load_dense_state(self, model: dict, optimizer: dict) -> None:
        """Continue from dense_state()'s (or one process's) state: this rank's tp shards of it cut out,
        and under ZeRO/FSDP only the pieces this rank owns kept. No communication beyond ZeRO's gather."""
        optimizer = dict(optimizer)
        for kind in ("exp_avg", "exp_avg_sq"):
            if optimizer[kind] is not None:
                local = self.cut_dense(dict(zip(optimizer["params"], optimizer[kind])))
                optimizer[kind] = [local[n] for n in optimizer["params"]]
        model = self.cut_dense(model)
        if self.sharded:
            from kiln.distributed.checkpoint import load_replicated
            load_replicated(model, optimizer, self.model, self.adamw, self.data_parallel, self.grad_group)
        else:
            self.model.load_state_dict(model)
            self.adamw.load_state_dict(optimizer)

    def _local_parameters(self) -> dict:
        """{name: this rank's tp/cp-local parameter} (FSDP's gathered over dp x cp: a copy)."""
        if isinstance(self.data_parallel, FullyShardedDataParallel):
            return self.data_parallel.full_parameters()
        return {name: p.data for name, p in self.model.named_parameters()}

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
