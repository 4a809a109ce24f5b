"""DistributedDataParallel: data-parallel training exactly as Algorithm 1 (paper §4.1).

    ddp = DistributedDataParallel(model)           # line 3: rank 0's weights on every rank
    for micro in range(accum):                     # line 1: accum = global_batch / (B·T·W)
        with ddp.no_sync() if micro < accum - 1 else nullcontext():
            loss = model(x, y)[1] / accum; loss.backward()
    ddp.wait_gradients()                           # every gradient averaged over the ranks
    optimizer.step()

Each parameter's post-accumulate hook (autograd fires it when the gradient of this backward is
final) copies the gradient into its bucket (~25 MB, in gradient-ready order); a complete bucket
is all-reduced (average) asynchronously, launched in bucket order by the in-order gate, while
backward goes on. On CUDA the all-reduce runs on the NCCL communicator's high-priority stream,
ordered by events only; after the last gradient the compute stream waits on the comm stream
(FINALIZE), so the optimizer reads averaged gradients with no host barrier and the whole step
can be captured as one CUDA graph. On the CPU the MPI all-reduces overlap backward the same way
and FINALIZE waits on the host. Accumulation micro-steps (`no_sync`) communicate nothing.

ZeRO-1/2 reuse this machinery: the buckets are padded to a multiple of the world size
(`Bucket.shard(rank, W)` is a rank's equal share), so a subclass's `_launch` reduce-scatters a
bucket into its shard instead of all-reducing it, and its `_scatter` keeps the shard.
"""

from __future__ import annotations

import contextlib

from kiln.autograd import no_grad
from kiln.distributed.buckets import GradientBuckets
from kiln.errors import ConfigError, DistributedError
from kiln.graph import capturing
from kiln.tensor import Tensor

DEFAULT_BUCKET_MB = 25.0


class DistributedDataParallel:
    def __init__(self, module, group=None, bucket_cap_mb: float = DEFAULT_BUCKET_MB):
        """Broadcast module's parameters from rank 0 of group (default: the world), lay their
        gradients out in buckets of bucket_cap_mb megabytes and hook every parameter."""
        from kiln.distributed.process_group import get_world
        if not bucket_cap_mb > 0:
            raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.module, self.group = module, group or get_world()
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("DistributedDataParallel needs a module with parameters that require grad")
        with no_grad():  # line 3: identical start weights
            for p in self.params:
                self.group.broadcast(p, 0)
        # line 2: gradient-ready order. Before any backward the best guess is the reverse of the
        # registration order (later layers' gradients come first); the first synced backward
        # records the real order, and the buckets are laid out again by it once (as torch does).
        self._layout(list(reversed(self.params)))
        self._observed: list | None = []
        self._sync = True
        self._finished = False
        self._ready: set = set()  # ids of the parameters whose gradient this backward has bucketed
        for p in self.params:  # lines 4-5
            p.register_post_accumulate_grad_hook(self._hook)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _layout(self, order: list) -> None:
        self.buckets = GradientBuckets(order, self.bucket_cap_bytes, pad_to=self.group.size)
        self._next = 0

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside it only accumulates local gradients (an accumulation micro-step)."""
        if self._finished:
            self._reset()  # a new step: the last one's averaged gradients no longer count
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------ Algorithm 1, lines 12-22
    def _hook(self, p) -> None:
        if not self._sync:  # lines 13-14
            return
        if self._finished:  # the first gradient of a new synced backward: line 9's reset
            self._reset()
        self._ready.add(id(p))
        if self._observed is not None:
            self._observed.append(p)
        bucket, i = self.buckets.slot(p)
        bucket.view(i)[...] = p.grad.data  # line 15
        bucket.pending -= 1                # line 16
        buckets = self.buckets.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:  # line 17: in-order gate
            b = buckets[self._next]
            b.work = self._launch(b)                                           # line 18
            self._next += 1
        if self._next == len(buckets):
            self._finalize()

    def _launch(self, bucket):
        """The bucket's collective (ZeRO reduce-scatters instead): the average over the ranks, async,
        as a reduce-scatter + all-gather: each element summed in the order ZeRO's reduce-scatter of
        the same padded bucket sums it (a plain all-reduce may sum in another order)."""
        return self.group.reduce_scatter_all_gather(bucket.buffer, "avg", async_op=True)

    def _scatter(self, bucket) -> None:
        """Line 22 for one bucket whose collective is done: each parameter's gradient becomes its
        averaged slot in the bucket (a view: no copy)."""
        for i, p in enumerate(bucket.params):
            p.grad = Tensor._wrap(bucket.view(i), p.device)

    def _finalize(self) -> None:
        """Lines 20-22: wait on every bucket's collective (CUDA: the compute stream waits on the comm
        stream's events, the host does not), then scatter the averaged gradients back."""
        for b in self.buckets.buckets:
            b.work.wait()
            b.work = None
            self._scatter(b)
        self._finished = True
        observed, self._observed = self._observed, None
        if observed is not None and not capturing() and \
                [id(p) for p in observed] != [id(p) for p in self.buckets.order]:
            grads = [(p, p.grad.data.copy()) for p in self.params]
            self._layout(observed)  # the real gradient-ready order, from now on
            for p, g in grads:
                p.grad = Tensor._wrap(g, p.device)

    def _reset(self) -> None:
        for b in self.buckets.buckets:
            b.pending = len(b.params)
        self._next = 0
        self._finished = False
        self._ready.clear()

    def wait_gradients(self) -> None:
        """Check that the last synced backward averaged every gradient (call before the optimizer).
        A parameter that got no gradient there leaves its bucket incomplete: DistributedError naming it."""
        if self._finished:
            return
        names = {id(p): n for n, p in self.module.named_parameters()}
        missing = [names.get(id(p), "?") for p in self.params if id(p) not in self._ready]
        raise DistributedError(
            "DDP: the last synchronised backward did not produce a gradient for every parameter "
            f"({len(missing)} missing: {missing[:5]}); every parameter must take part in the loss on "
            "every rank, and the last micro-step must not be inside no_sync()")
