"""This rank's share of flat parameter layouts, and the AdamW that updates only that share (ZeRO, FSDP).

A flat layout is a Bucket (buckets.py): parameters back to back, padded to a multiple of the
world size W. Rank r owns elements [r·S, (r+1)·S) of it, S = padded / W: their values (`param`),
their gradient averaged over the ranks (`grad`, what a reduce-scatter leaves) and their AdamW
moments. The update is the backend's fused multi-tensor AdamW on the pieces of the shard that
belong to each parameter (each with its group's lr and weight decay; padding is never updated),
so each element gets exactly the arithmetic of kiln.optim.AdamW. The global-norm clip is exact:
every rank's sum of squares, all-reduced (ZeRO, Rajbhandari et al. 2020; paper §2.2).
"""

from __future__ import annotations

from kiln.autograd import no_grad
from kiln.backend import array_module
from kiln.errors import ConfigError, KilnError
from kiln.graph import capturing
from kiln.tensor import Tensor


class FlatShard:
    """Rank's share of one flat layout (a Bucket): `param` (S values), `grad` (S or None), moments."""

    def __init__(self, bucket, rank: int, world_size: int, param):
        self.bucket, self.param, self.grad = bucket, param, None
        self.size = -(-bucket.numel // world_size)
        self.start = rank * self.size
        self.exp_avg = self.exp_avg_sq = None
        # (parameter, first, end) in shard coordinates, and where that piece starts in the parameter
        self.segments = []
        for p, offset in zip(bucket.params, bucket.offsets):
            lo, hi = max(offset, self.start), min(offset + p.numel(), self.start + self.size)
            if lo < hi:
                self.segments.append((p, lo - self.start, hi - self.start, lo - offset))


class ShardedAdamW:
    """kiln.optim.AdamW over FlatShards: the same param_groups (lr, weight_decay), betas, eps and
    step count, the same interface (zero_grad, clip_grad_norm_, step, state_dict), each rank
    updating its shard only. after_step() runs after each update (ZeRO-1/2: all-gather params and
    write the parameters' kept compute-dtype copies; FSDP keeps none)."""

    def __init__(self, optimizer, shards: list, group, after_step=None):
        self.optimizer, self.shards, self.group, self.after_step = optimizer, shards, group, after_step
        self.param_groups = optimizer.param_groups
        owned = {id(p) for s in shards for p in s.bucket.params}
        mine = {id(p) for p in optimizer.params}
        if owned != mine:
            raise ConfigError(f"the optimizer holds {len(mine)} parameters, the sharded model "
                              f"{len(owned)}: give it exactly the module's trainable parameters")
        self._group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._clip = None

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    @property
    def params(self):
        return self.optimizer.params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the local (unreduced) gradients of accumulation micro-steps and a pending clip."""
        self._clip = None
        for p in self.params:
            p.grad = None

    def gradient_pieces(self) -> list:
        """[(parameter, its averaged gradient's piece in this rank's shards)] (1-d array views)."""
        return [(p, s.grad[a:b]) for s in self.shards if s.grad is not None for p, a, b, _ in s.segments]

    @no_grad()
    def clip_grad_norm_(self, max_norm: float, norm=None) -> Tensor:
        """The global L2 norm of the averaged gradients, all shards together (a 0-d tensor); the
        next step() clips by it as AdamW.clip_grad_norm_ does. Collective over the group. norm: that
        norm as a 0-d device array when it is computed elsewhere (a tensor-parallel model's spans
        more ranks than the group: ModelParallel.grad_norm), no collective then."""
        if max_norm <= 0:
            raise ConfigError(f"clip_grad_norm_ needs max_norm > 0, got {max_norm}")
        pieces = [g for _, g in self.gradient_pieces()]
        if not pieces:
            raise KilnError("clip_grad_norm_ found no gradients; call backward() first")
        device = self.shards[0].bucket.params[0].device
        if norm is None:
            xp = array_module(pieces[0])
            total = xp.zeros((1,), dtype="float64")
            for g in pieces:
                g64 = g.astype("float64")
                total += (g64 * g64).sum()  # not dot: CuPy's cuBLAS refuses to be captured in a graph
            self.group.all_reduce(Tensor._wrap(total, device), "sum")
            wide = all(g.dtype == xp.float64 for g in pieces)
            norm = xp.sqrt(total[0]).astype("float64" if wide else "float32")
        self._clip = (norm, float(max_norm))
        return Tensor._wrap(norm, device)

    def update_state(self):
        """What step() changes on this rank (its shards' values and moments, the count), copied on
        the device, for restore_update_state (kiln launch's skip of a bad step)."""
        copy = lambda a: None if a is None else a.copy()  # noqa: E731
        return [(s.param.copy(), copy(s.exp_avg), copy(s.exp_avg_sq)) for s in self.shards], self.step_count

    def restore_update_state(self, saved) -> None:
        """Put update_state()'s copy back in place, then after_step() (ZeRO: all-gather the parameters
        from the restored shards; a collective, as every rank skips the same step)."""
        shards, count = saved
        for s, (param, exp_avg, exp_avg_sq) in zip(self.shards, shards):
            s.param[...] = param
            if exp_avg is None:
                s.exp_avg = s.exp_avg_sq = None
            else:
                s.exp_avg[...], s.exp_avg_sq[...] = exp_avg, exp_avg_sq
        self.optimizer.step_count = count
        if self.after_step is not None:
            self.after_step()

    def full_state_dict(self) -> dict:
        """kiln.optim.AdamW.state_dict() of the whole parameters, as one process's optimizer holds it:
        every shard's moments all-gathered over the group (collective), in the optimizer's parameter
        order; the moments None before the first step."""
        state = self.optimizer.state_dict()  # the step count and the groups; its own moments are never made
        if all(s.exp_avg is None for s in self.shards):
            return state
        world = self.group.size
        for kind in ("exp_avg", "exp_avg_sq"):
            full = {}
            for s in self.shards:
                first = s.bucket.params[0]
                mine = getattr(s, kind)
                mine = first.backend.xp.zeros_like(s.param) if mine is None else mine
                layout = first.backend.zeros((s.size * world,), first.dtype.np)
                self.group.all_gather(Tensor._wrap(layout, first.device), Tensor._wrap(mine, first.device))
                for p, offset in zip(s.bucket.params, s.bucket.offsets):
                    full[id(p)] = layout[offset:offset + p.numel()].reshape(p.shape)
            state[kind] = [full[id(p)] for p in self.params]
        return state

    @no_grad()
    def step(self) -> None:
        """One AdamW update of this rank's shard of every parameter, then after_step(). Recorded
        into a CUDA graph, it reads lr and the step count as kiln.optim.AdamW does (a device buffer
        per param group, refreshed before every replay)."""
        opt = self.optimizer
        captured = capturing()
        if not captured:
            opt.step_count += 1
        by_lr: dict = {}
        for s in self.shards:
            if s.grad is None:
                continue
            if s.exp_avg is None:
                xp = s.bucket.params[0].backend.xp
                s.exp_avg, s.exp_avg_sq = xp.zeros_like(s.param), xp.zeros_like(s.param)
            for p, a, b, _ in s.segments:
                gi = self._group_of[id(p)]
                g = self.param_groups[gi]
                batch = by_lr.setdefault((gi if captured else g["lr"], p.device), ([], [], [], [], [], [], p.backend))
                for column, array in zip(batch, (s.param, s.grad, s.exp_avg, s.exp_avg_sq)):
                    column.append(array[a:b])
                batch[4].append(g["weight_decay"])
                batch[5].append(None)  # a piece of a parameter: its kept copy is the wrapper's (after_step)
        clip_norm, max_norm = self._clip if self._clip is not None else (None, 0.0)
        self._clip = None
        if captured:
            opt._record_step(by_lr, clip_norm, max_norm)
        else:
            b1, b2 = opt.betas
            for (lr, _), (ps, gs, ms, vs, wds, _, backend) in by_lr.items():
                backend.adamw_step(ps, gs, ms, vs, wds, lr, b1, b2, opt.eps, opt.step_count,
                                   clip_norm=clip_norm, max_norm=max_norm)
        for p in self.params:
            p._version[0] += 1
        if self.after_step is not None:
            self.after_step()

