"""ZeRO stages 1 and 2: DDP's buckets, reduce-scattered, each rank updating its shard (ZeRO §5).

    zero = ZeroDataParallel(model, AdamW(...), stage=2)   # rank 0's weights on every rank
    opt = zero.optimizer                                   # zero_grad / clip_grad_norm_ / step
    for micro in range(accum):
        with zero.no_sync() if micro < accum - 1 else nullcontext():
            (model(x, y)[1] / accum).backward()
    zero.wait_gradients(); opt.clip_grad_norm_(1.0); opt.step()

Everything of Algorithm 1 is DDP's (this class is one): the hooks, the buckets in gradient-ready
order, the in-order launch gate, no_sync. The bucket's collective is a reduce-scatter (average)
into this rank's gradient shard instead of an all-reduce; the optimizer (shards.ShardedAdamW)
keeps AdamW's moments for that shard only and updates it; an all-gather then brings every rank
the new parameters, which are views of flat buffers laid out like the gradient buckets.
Stage 1 keeps the full gradient buckets between steps, stage 2 allocates a bucket when its first
gradient comes and frees it once its reduce-scatter is done: per rank, with Ψ parameters of b
bytes, W ranks and AdamW's 2 moments, model state is (1 + 1 + 2/W)Ψb for stage 1 and
(1 + 1/W + 2/W)Ψb for stage 2, against DDP's 4Ψb.
"""

from __future__ import annotations

from kiln.autograd import no_grad
from kiln.distributed.buckets import GradientBuckets
from kiln.distributed.ddp import DEFAULT_BUCKET_MB, DistributedDataParallel
from kiln.distributed.shards import FlatShard, ShardedAdamW
from kiln.errors import ConfigError
from kiln.tensor import Tensor

STAGES = (1, 2)


class ZeroDataParallel(DistributedDataParallel):
    def __init__(self, module, optimizer, stage: int = 2, group=None, bucket_cap_mb: float = DEFAULT_BUCKET_MB):
        """Broadcast module's parameters from rank 0, make them views of flat buffers laid out as
        the gradient buckets, and shard optimizer (a kiln AdamW over module's parameters)."""
        if stage not in STAGES:
            raise ConfigError(f"ZeroDataParallel stage must be one of {STAGES}, got {stage!r} "
                              "(stage 3 is FullyShardedDataParallel)")
        self.stage = stage
        super().__init__(module, group, bucket_cap_mb)
        # The layout stays the one it started with (DDP re-lays its buckets out in the order the first
        # backward shows): the parameters and the optimizer's shards live in it.
        self._observed = None
        world, rank = self.group.size, self.group.rank
        self.param_buckets = GradientBuckets(self.buckets.order, self.bucket_cap_bytes, pad_to=world)
        shards = []
        with no_grad():
            for pb, gb in zip(self.param_buckets.buckets, self.buckets.buckets):
                for i, p in enumerate(pb.params):
                    view = pb.view(i)
                    view[...] = p.data
                    p.data = view
                    p._version[0] += 1
                shard = FlatShard(pb, rank, world, pb.shard(rank, world))
                shard.grad = pb.buffer.backend.zeros((shard.size,), pb.buffer.dtype.np)
                shards.append(shard)
                if stage == 2:
                    gb.buffer = None
        self.optimizer = ShardedAdamW(optimizer, shards, self.group, after_step=self._gather_parameters)

    # ------------------------------------------------------------------ Algorithm 1, with shards
    def _hook(self, p) -> None:
        if self._sync:
            if self._finished:
                self._reset()
            bucket, _ = self.buckets.slot(p)
            if bucket.buffer is None:  # stage 2: the bucket exists while its gradients are in flight
                first = bucket.params[0]
                padded = self.optimizer.shards[bucket.index].size * self.group.size
                bucket.buffer = Tensor._wrap(first.backend.zeros((padded,), first.dtype.np), first.device)
        super()._hook(p)
        if self._sync:
            p.grad = None  # it is in its bucket now; the averaged shard is what the optimizer reads

    def _launch(self, bucket):
        shard = self.optimizer.shards[bucket.index]
        out = Tensor._wrap(shard.grad, bucket.params[0].device)
        return self.group.reduce_scatter(out, bucket.buffer, "avg", async_op=True)

    def _finalize(self) -> None:
        for b in self.buckets.buckets:
            b.work.wait()
            b.work = None
            if self.stage == 2:
                b.buffer = None
        self._finished = True

    def _gather_parameters(self) -> None:
        """Every rank's updated shard into every rank's flat parameter buffers (ZeRO's all-gather),
        then each parameter's kept compute-dtype copy (a bf16 step's) from its new value, as AdamW
        writes it: a replayed CUDA graph reads the copies without checking versions."""
        works = []
        for pb, shard in zip(self.param_buckets.buckets, self.optimizer.shards):
            mine = Tensor._wrap(shard.param.copy(), pb.buffer.device)
            works.append((mine, self.group.all_gather(pb.buffer, mine, async_op=True)))
        for _, work in works:
            work.wait()
        for p in self.params:
            if getattr(p, "kept", None) is not None and p.kept.data is not None:
                p.kept.refresh(p)

    def memory(self) -> dict:
        """Bytes of model state this rank holds now: parameters, gradients, optimizer moments."""
        shards = self.optimizer.shards
        grads = sum(b.nbytes for b in self.buckets.buckets if b.buffer is not None)
        grads += sum(p.grad.data.nbytes for p in self.params if p.grad is not None)
        grads += sum(s.grad.nbytes for s in shards if s.grad is not None)
        return {"parameters": sum(b.nbytes for b in self.param_buckets.buckets),
                "gradients": grads,
                "optimizer": sum(s.exp_avg.nbytes * 2 for s in shards if s.exp_avg is not None)}
