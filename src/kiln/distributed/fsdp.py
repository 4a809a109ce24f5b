"""FullyShardedDataParallel (ZeRO stage 3): parameters sharded too, gathered per unit only while used.

    fsdp = FullyShardedDataParallel(model, AdamW(...))    # units: each block's attention and MLP
    opt = fsdp.optimizer                                   # as ZeRO's: a ShardedAdamW
    loss = model(x, y)[1]; loss.backward(); fsdp.wait_gradients(); opt.step()

Each unit (a module whose forward uses only its own parameters; by default every GPT block's
attention and MLP) keeps 1/W of its flat parameter layout per rank. Its forward all-gathers the
unit (the gather prefetched while the previous unit ran), launches the next unit's gather (on
CUDA: the NCCL communication stream, ordered by events), runs, and frees the gathered
parameters: tensors saved for backward hold handles to them (autograd.saved_tensors_hooks), not
their memory, and so do the compute-dtype casts of them (bf16 over fp32 weights), cast again in
backward from the re-gathered weight. A node on the unit's output gathers it again when backward reaches it (and
prefetches the unit before it); as soon as the unit's last gradient has accumulated (autograd's
post-accumulate hooks) its gradients are reduce-scattered (average) into this rank's gradient
shard and the gathered parameters are freed. The root unit (embeddings, LayerNorms: what no unit
holds) is gathered from the model's forward to the end of its backward. Accumulation micro-steps
(no_sync) keep full local gradients and communicate nothing. Per rank the model state is
(1 + 1 + 2)Ψb/W plus the units gathered at a time (ZeRO §5; FSDP, Zhao et al. 2023).
"""

from __future__ import annotations

import contextlib

from kiln.autograd import AccumulateGrad, Function, is_grad_enabled, no_grad, saved_tensors_hooks
from kiln.distributed.buckets import GradientBuckets
from kiln.distributed.shards import FlatShard, ShardedAdamW
from kiln.errors import ConfigError, DistributedError
from kiln.graph import capturing
from kiln.ops.convert import ToDType
from kiln.tensor import Tensor

ONE_LAYOUT = 1 << 62  # bucket cap that puts a whole unit (of one dtype) in one flat layout


def default_units(module) -> list:
    """Every GPT block's attention and MLP (their forwards use only their own parameters; the
    block's LayerNorms are also used by the block before it, so they stay in the root unit)."""
    blocks = getattr(module, "h", None)
    if blocks is None:
        return []
    return [m for block in blocks for m in (block.attn, block.mlp)]


class _ParamHandle:
    """What a saved tensor of a unit's gathered parameter holds instead of the array; with a dtype,
    the tensor was a cast of it (bf16 compute over fp32 weights), cast again when backward needs it."""

    __slots__ = ("dtype", "param", "unit")

    def __init__(self, param, unit, dtype=None):
        self.param, self.unit, self.dtype = param, unit, dtype


class _Unit:
    """One sharding unit: its flat layouts, this rank's shards of them, and the gather state."""

    def __init__(self, index: int, name: str, params: list, world: int, rank: int):
        self.index, self.name, self.params = index, name, params
        self.shards = []
        for bucket in GradientBuckets(params, ONE_LAYOUT, pad_to=world).buckets:
            for i, p in enumerate(bucket.params):
                bucket.view(i)[...] = p.data
            self.shards.append(FlatShard(bucket, rank, world, bucket.shard(rank, world).copy()))
            bucket.buffer = None  # the full layout exists only while gathered
        self.gathers = None        # [(full buffer Tensor, Work)] while a gather is in flight or done
        self.gathered = False
        self.pending = len(params)  # gradients still to accumulate in this backward


def _cast_source(t):
    """The leaf tensor t is a dtype cast of (ops.convert.ToDType straight from it), else None (t may
    also be an op's Fresh output, which has no graph)."""
    node = getattr(t, "grad_fn", None)
    if not isinstance(node, ToDType) or node.next_edges[0] is None:
        return None
    sink = node.next_edges[0][0]
    return sink.leaf if isinstance(sink, AccumulateGrad) else None


class _GatherBeforeBackward(Function):
    """Identity on a unit's output; its backward (which runs before any of the unit's nodes)
    gathers the unit's parameters again and prefetches the unit before it."""

    is_view = True

    @staticmethod
    def forward(ctx, x, fsdp, index):
        ctx.fsdp, ctx.index = fsdp, index
        return x.data

    @staticmethod
    def backward(ctx, g):
        ctx.fsdp._before_backward(ctx.index)
        return g


class FullyShardedDataParallel:
    def __init__(self, module, optimizer, units=None, group=None):
        """Broadcast module's parameters from rank 0, shard them by unit (default_units(module);
        the rest is the root unit) and shard optimizer (a kiln AdamW over module's parameters)."""
        from kiln.distributed.process_group import get_world
        self.module, self.group = module, group or get_world()
        world, rank = self.group.size, self.group.rank
        names = {id(p): n for n, p in module.named_parameters()}
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("FullyShardedDataParallel needs a module with parameters that require grad")
        with no_grad():
            for p in self.params:
                self.group.broadcast(p, 0)
        units = default_units(module) if units is None else list(units)
        taken: set = set()
        groups = []
        for m in units:
            ps = [p for p in m.parameters() if p.requires_grad and id(p) not in taken]
            if ps:
                taken.update(id(p) for p in ps)
                groups.append((m, ps))
        root = [p for p in self.params if id(p) not in taken]
        if not root:
            raise ConfigError("FSDP units must leave the model's root some parameters (embeddings, norms)")
        self.units = [_Unit(0, "root", root, world, rank)]
        module_names = {id(m): n for n, m in module.named_modules()}
        for m, ps in groups:
            self.units.append(_Unit(len(self.units), module_names.get(id(m), "?"), ps, world, rank))
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._summoned = False
        self._names = names
        with no_grad():
            for u in self.units:
                self._free(u)
        self._sync, self._reducing, self._reduced = True, [], set()
        for u, (m, _) in zip(self.units[1:], groups):
            object.__setattr__(m, "forward", self._unit_forward(u, m.forward))
        object.__setattr__(module, "forward", self._root_forward(module.forward))
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)
        shards = [s for u in self.units for s in u.shards]
        self.optimizer = ShardedAdamW(optimizer, shards, self.group)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------------ gather / free
    def _gather(self, u: _Unit) -> None:
        """Launch u's all-gather (asynchronous: the prefetch) unless it is gathered or in flight."""
        if u.gathers is not None:
            return
        u.gathers = []
        for s in u.shards:
            first = s.bucket.params[0]
            full = Tensor._wrap(first.backend.zeros((s.size * self.group.size,), first.dtype.np), first.device)
            u.gathers.append((full, self.group.all_gather(full, Tensor._wrap(s.param, first.device), async_op=True)))

    def _wait(self, u: _Unit) -> None:
        """Finish u's gather: its parameters become views of the gathered layouts."""
        self._gather(u)
        if u.gathered:
            return
        for s, (full, work) in zip(u.shards, u.gathers):
            work.wait()
            for p, offset in zip(s.bucket.params, s.bucket.offsets):
                p.data = full.data[offset:offset + p.numel()].reshape(p.shape)
        u.gathered = True

    def _free(self, u: _Unit) -> None:
        """Drop u's gathered parameters: each becomes a zero-byte broadcast view of its shape."""
        if self._summoned:
            return
        for p in u.params:
            xp = p.backend.xp
            p.data = xp.broadcast_to(xp.zeros((), p.dtype.np), p.shape)
            p.kept = None  # a compute-dtype copy kept across steps would hold the whole parameter again
        if u.gathers is not None and not u.gathered:
            # a prefetch never waited on: its buffers go back to the allocator below, which would hand
            # them to the compute stream while NCCL still writes them; the compute stream waits first
            for _, work in u.gathers:
                work.wait()
        u.gathers, u.gathered = None, False

    def _pack(self, t):
        u = self._unit_of.get(id(t))
        if u is not None and u.index > 0 and u.gathered:
            return _ParamHandle(t, u)
        cast_of = _cast_source(t)
        u = self._unit_of.get(id(cast_of))
        if u is not None and u.gathered:  # a weight's compute-dtype copy: kept as a handle, not its bytes
            return _ParamHandle(cast_of, u, t.dtype)
        return t.data

    def _unpack(self, saved):
        if not isinstance(saved, _ParamHandle):
            return saved
        if not saved.unit.gathered:
            raise DistributedError(f"FSDP: backward needs unit {saved.unit.name!r}, which is not gathered "
                                   "(was its output used outside the unit's forward?)")
        p = saved.param
        return p.data if saved.dtype is None else p.backend.cast(p.data, saved.dtype.np)

    # ------------------------------------------------------------------ forward
    def _root_forward(self, forward):
        def root_forward(*args, **kwargs):
            root = self.units[0]
            self._wait(root)
            if len(self.units) > 1:
                self._gather(self.units[1])  # prefetch the first unit
            with saved_tensors_hooks(self._pack, self._unpack):  # the root's weight casts, as the units'
                out = forward(*args, **kwargs)
            if not is_grad_enabled():
                self._free(root)
            return out
        return root_forward

    def _unit_forward(self, u: _Unit, forward):
        def unit_forward(*args, **kwargs):
            self._wait(u)
            if u.index + 1 < len(self.units):
                self._gather(self.units[u.index + 1])  # prefetch the next unit
            with saved_tensors_hooks(self._pack, self._unpack):
                out = forward(*args, **kwargs)
            if isinstance(out, Tensor) and out.requires_grad and is_grad_enabled():
                out = _GatherBeforeBackward.apply(out, self, u.index)
            self._free(u)
            return out
        return unit_forward

    # ------------------------------------------------------------------ backward
    def _before_backward(self, index: int) -> None:
        self._wait(self.units[index])
        if index > 1:
            self._gather(self.units[index - 1])  # prefetch the unit backward reaches next

    def _hook(self, p) -> None:
        u = self._unit_of[id(p)]
        u.pending -= 1
        if u.pending:
            return
        u.pending = len(u.params)
        if self._sync:
            self._reduce(u)
        self._free(u)

    def _reduce(self, u: _Unit) -> None:
        """Reduce-scatter (average) u's local gradients into its gradient shards, asynchronously."""
        if not capturing():  # drop the finished ones (no event is queried while a graph records)
            self._reducing = [(f, w) for f, w in self._reducing if not w.is_completed()]
        for s in u.shards:
            first = s.bucket.params[0]
            full = first.backend.zeros((s.size * self.group.size,), first.dtype.np)
            for p, offset in zip(s.bucket.params, s.bucket.offsets):
                full[offset:offset + p.numel()] = p.grad.data.reshape(-1)
                p.grad = None
            if s.grad is None:
                s.grad = first.backend.zeros((s.size,), first.dtype.np)
            full = Tensor._wrap(full, first.device)
            work = self.group.reduce_scatter(Tensor._wrap(s.grad, first.device), full, "avg", async_op=True)
            self._reducing.append((full, work))
        self._reduced.add(u.index)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside it only accumulates local gradients (an accumulation micro-step)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def wait_gradients(self) -> None:
        """Wait for every unit's reduce-scatter of the last synchronised backward (before the
        optimizer). A unit that got no gradient there: DistributedError naming its parameters."""
        missing = [u for u in self.units if u.index not in self._reduced]
        if missing:
            names = [self._names.get(id(p), "?") for u in missing for p in u.params]
            raise DistributedError(
                "FSDP: the last synchronised backward did not produce a gradient for every parameter "
                f"({len(names)} missing: {names[:5]}); every parameter must take part in the loss on "
                "every rank, and the last micro-step must not be inside no_sync()")
        for _, work in self._reducing:
            work.wait()
        self._reducing, self._reduced = [], set()

    # ------------------------------------------------------------------ state
    def full_parameters(self) -> dict:
        """Every parameter's full value by name (backend arrays): a gather of every unit. Collective."""
        out = {}
        with no_grad():
            for u in self.units:
                was = u.gathered
                self._wait(u)
                out.update((self._names[id(p)], p.data.copy()) for p in u.params)
                if not was:
                    self._free(u)
        return out

    def summon_full_parameters(self) -> None:
        """Collective: gather every unit and keep it gathered, so that the model's forward (sampling,
        saving its weights) runs on one rank alone with no collective. For the end of a run: training
        on from here holds the full parameters, as DDP does, and updates only the shards."""
        with no_grad():
            for u in self.units:
                self._wait(u)
        self._summoned = True

    def memory(self) -> dict:
        """Bytes of model state this rank holds now: parameters (shards and gathered units),
        gradients (shards, local accumulations, layouts in flight), optimizer moments."""
        shards = self.optimizer.shards
        gathered = sum(full.data.nbytes for u in self.units if u.gathers for full, _ in u.gathers)
        grads = sum(s.grad.nbytes for s in shards if s.grad is not None)
        grads += sum(p.grad.data.nbytes for p in self.params if p.grad is not None)
        grads += sum(full.data.nbytes for full, _ in self._reducing)
        return {"parameters": sum(s.param.nbytes for s in shards) + gathered,
                "gradients": grads,
                "optimizer": sum(s.exp_avg.nbytes * 2 for s in shards if s.exp_avg is not None)}
