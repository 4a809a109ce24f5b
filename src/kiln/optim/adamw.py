"""AdamW with decoupled weight decay, updating every parameter in one multi-tensor kernel call.

Gradient clipping rides in the same call: `AdamW.clip_grad_norm_` computes the global norm
into a device scalar, and the next `step()` scales each gradient by min(1, max_norm / norm)
as the kernel reads it (computed on the device: no host sync, no separate scaling pass).
A parameter that keeps a copy in a lower compute dtype (kiln.ops.convert.KeptCopy: a bf16
step's weights) has it written by the same kernel from the updated value, so the next forward
casts no weight (one pass over the weights fewer).

`AdamW(..., in_backward=True)` keeps no gradients: `backward_step(loss, max_norm)` updates each
parameter from a hook as soon as backward has made its gradient final (a tied weight's after its
last use) and drops that gradient at once, so a whole model's gradients are never held (the largest
model on one GPU: 12 bytes a parameter instead of 16). The global-norm clip needs the norm of the whole
gradient before the first update, so with a clip the step runs backward twice over one retained
graph: the first pass only adds up each gradient's sum of squares (dropping the gradient as it is
made), the second updates with the clip coefficient from that norm; without a clip, one pass. The
update is the ordinary step's (backward, clip_grad_norm_, step) bit for bit on the CPU; the clip
costs a second backward (about 4N FLOPs a token on top of the step's 6N) and no device memory but the
retained graph's. `clip_via="host"` parks each gradient in page-locked host memory instead
(kiln.optim.host_stash): one backward, the gradients' bytes over PCIe both ways, the same bits.
"""

from __future__ import annotations

from kiln.autograd import no_grad
from kiln.errors import ConfigError, KilnError, NotBuiltError
from kiln.graph import before_each_replay, capturing
from kiln.optim.host_stash import HostGradStash
from kiln.tensor import Tensor

CLIP_VIA = ("recompute", "host")  # how AdamW in backward's exact clip gets the gradients back after the norm


def gpt_param_groups(model, weight_decay: float):
    """GPT-2's split: weight decay on 2-D weights (matmuls, embeddings), none on biases and norms."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class AdamW:
    """torch.optim.AdamW's arithmetic; `param_groups` hold params, lr and weight_decay. in_backward:
    each parameter is updated inside backward_step(loss) as its gradient is made (see above); clip_via:
    how its exact clip gets each gradient again once the norm is known, "recompute" (a second backward)
    or "host" (kept in page-locked host memory)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, in_backward: bool = False, clip_via: str = "recompute"):
        if lr < 0 or eps < 0 or not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ConfigError(f"AdamW needs lr >= 0, eps >= 0 and betas in [0, 1): got lr={lr}, "
                              f"betas={betas}, eps={eps}")
        if clip_via not in CLIP_VIA:
            raise ConfigError(f"clip_via must be one of {', '.join(CLIP_VIA)}, got {clip_via!r}")
        params = list(params)
        if params and isinstance(params[0], dict):
            groups = params
        else:
            groups = [{"params": params}]
        self.param_groups = []
        for g in groups:
            group = {"lr": lr, "weight_decay": weight_decay, **g, "params": list(g["params"])}
            self.param_groups.append(group)
        self.betas = tuple(betas)
        self.eps = eps
        self.step_count = 0
        all_params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in all_params}) != len(all_params):
            raise KilnError("a parameter appears in more than one AdamW param group")
        self._moments = None  # (exp_avgs, exp_avg_sqs), allocated at the first step
        self._clip = None  # (norm device array, max_norm) for the next step, from clip_grad_norm_
        self.in_backward = in_backward
        self.clip_via = clip_via
        self._stash = None  # clip_via="host": the HostGradStash, made at the first clipped backward_step
        self._pass = None  # inside backward_step: "norm" (the clip's first pass), "stash" (clip_via host) or "update"
        self._norm_parts = None  # the clip's first pass: the gradients' squares, as they come (backend.grad_norm_parts)
        if in_backward:
            self._position = {}  # id(param) -> (its index in self.params, its group)
            for g in self.param_groups:
                for p in g["params"]:
                    self._position[id(p)] = (len(self._position), g)
                    p.register_post_accumulate_grad_hook(self._gradient_final)

    @property
    def params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip = None
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.data[...] = 0

    def _allocate(self):
        self._moments = ([p.backend.xp.zeros_like(p.data) for p in self.params],
                         [p.backend.xp.zeros_like(p.data) for p in self.params])

    def _refuse_outside_backward_step(self, what: str) -> None:
        if self.in_backward:
            raise ConfigError(f"{what} on an AdamW(in_backward=True): it keeps no gradients; call "
                              "optimizer.backward_step(loss, max_norm) instead of loss.backward(), the clip and step()")

    @no_grad()
    def clip_grad_norm_(self, max_norm: float, norm=None) -> Tensor:
        """The global L2 norm of this optimizer's gradients (a 0-d device tensor, not synced);
        the next step() clips by it, exactly as kiln.optim.clip_grad_norm_ followed by step()
        would (torch's coefficient min(1, max_norm / (norm + 1e-6))), fused into the update.
        The gradients themselves are left unscaled. norm: that norm as a 0-d device array when
        it is computed elsewhere (a tensor-parallel model's spans ranks: ModelParallel.grad_norm)."""
        self._refuse_outside_backward_step("clip_grad_norm_")
        if max_norm <= 0:
            raise ConfigError(f"clip_grad_norm_ needs max_norm > 0, got {max_norm}")
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            raise KilnError("clip_grad_norm_ found no gradients; call backward() first")
        if norm is None:
            norm = grads[0].backend.grad_norm([g.data for g in grads])
        self._clip = (norm, float(max_norm))
        return Tensor._wrap(norm, grads[0].device)

    @no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (clipped if clip_grad_norm_ was called).

        Recorded into a CUDA graph (kiln.graph.CapturedStep), the update reads lr and the bias
        corrections from a device buffer per param group that a callback refreshes from
        `param_groups` and the step count before every replay."""
        self._refuse_outside_backward_step("step()")
        if self._moments is None:
            self._allocate()
        captured = capturing()
        if not captured:
            self.step_count += 1
        exp_avgs, exp_avg_sqs = self._moments
        i = 0
        by_lr: dict = {}
        kept = []  # the kept copies this step writes: current once it has
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if p.grad is not None:
                    key = (gi if captured else g["lr"], p.device)
                    batch = by_lr.setdefault(key, ([], [], [], [], [], [], p.backend))
                    batch[0].append(p.data)
                    batch[1].append(p.grad.data)
                    batch[2].append(exp_avgs[i])
                    batch[3].append(exp_avg_sqs[i])
                    batch[4].append(g["weight_decay"])
                    copy = getattr(p, "kept", None)
                    batch[5].append(None if copy is None else copy.data)
                    p._version[0] += 1
                    if copy is not None and copy.data is not None:
                        kept.append((copy, p))
                i += 1
        b1, b2 = self.betas
        clip_norm, max_norm = self._clip if self._clip is not None else (None, 0.0)
        self._clip = None
        if captured:
            self._record_step(by_lr, clip_norm, max_norm)
        else:
            for (lr, _), (ps, gs, ms, vs, wds, cs, backend) in by_lr.items():
                backend.adamw_step(ps, gs, ms, vs, wds, lr, b1, b2, self.eps, self.step_count,
                                   clip_norm=clip_norm, max_norm=max_norm, copies=cs)
        for copy, p in kept:
            copy.version = p._version[0]

    def backward_step(self, loss: Tensor, max_norm: float | None = None) -> Tensor | None:
        """backward of loss with every parameter updated as its gradient is final (in_backward=True);
        returns the gradient's global norm (a 0-d device tensor, not synced) when max_norm clips it.

        With max_norm, the first backward (retain_graph) only adds up each gradient's sum of squares
        (backend.grad_norm_parts: grad_norm's sum, bit for bit) and drops the gradient; the second updates each
        parameter with torch's coefficient min(1, max_norm / (norm + 1e-6)). Without, one backward. With
        clip_via="host", one backward adds up the squares and parks each gradient on the host; the updates
        follow it, from the host copies."""
        if not self.in_backward:
            raise ConfigError("backward_step needs AdamW(..., in_backward=True); this AdamW keeps gradients: "
                              "call loss.backward() and step()")
        if max_norm is not None and not max_norm > 0:
            raise ConfigError(f"backward_step needs max_norm > 0 (None: no clip), got {max_norm}")
        if capturing():
            raise NotBuiltError("AdamW in backward inside a CUDA graph capture is not built: its updates read lr "
                                "and the step count from the host; run the step op by op")
        held = [i for i, p in enumerate(self.params) if p.grad is not None]
        if held:
            raise KilnError(f"AdamW in backward found {len(held)} parameters holding gradients (the first at index "
                            f"{held[0]}): it adds no gradient to an old one; set them to None first (zero_grad())")
        if self._moments is None:
            self._allocate()
        norm = None
        host = max_norm is not None and self.clip_via == "host"
        if max_norm is not None:
            params = self.params
            backend = params[0].backend
            self._norm_parts = backend.grad_norm_parts([p.data for p in params])
            if host:
                self._stash = self._stash or HostGradStash(backend)
                self._stash.order.clear()  # what a failed step left
            try:
                self._run_pass("stash" if host else "norm", loss, retain_graph=not host)
                norm = self._norm_parts.norm()
            finally:
                self._norm_parts = None
                if host:
                    self._stash.drain()
            self._clip = (norm, float(max_norm))
        self.step_count += 1
        try:
            if host:
                for i, grad in self._stash.returned():
                    self._update(i, params[i], grad)
            else:
                self._run_pass("update", loss, retain_graph=False)
        finally:
            self._clip = None
        return None if norm is None else Tensor._wrap(norm, loss.device)

    def _run_pass(self, name: str, loss: Tensor, retain_graph: bool) -> None:
        self._pass = name
        try:
            loss.backward(retain_graph=retain_graph)
        finally:
            self._pass = None

    def _gradient_final(self, p) -> None:
        """The post-accumulate hook: p's gradient of this backward is complete."""
        if self._pass is None:
            raise KilnError("a backward reached a parameter of an AdamW(in_backward=True) outside its "
                            "backward_step(loss): call optimizer.backward_step(loss, max_norm) instead of loss.backward()")
        i, _ = self._position[id(p)]
        grad, p.grad = p.grad, None  # nothing else holds it: freed when this returns (or once stashed)
        if self._pass in ("norm", "stash"):
            self._norm_parts.add(i, grad.data)
            if self._pass == "stash":
                self._stash.put(i, grad.data)
            return
        self._update(i, p, grad.data)

    def _update(self, i: int, p, grad) -> None:
        """AdamW on parameter p (index i) from its gradient array, clipped by self._clip when set."""
        group = self._position[id(p)][1]
        exp_avgs, exp_avg_sqs = self._moments
        clip_norm, max_norm = self._clip if self._clip is not None else (None, 0.0)
        copy = getattr(p, "kept", None)
        p.backend.adamw_step([p.data], [grad], [exp_avgs[i]], [exp_avg_sqs[i]], [group["weight_decay"]],
                             group["lr"], self.betas[0], self.betas[1], self.eps, self.step_count,
                             clip_norm=clip_norm, max_norm=max_norm, copies=[None if copy is None else copy.data])
        p._version[0] += 1
        if copy is not None and copy.data is not None:
            copy.version = p._version[0]

    def _record_step(self, by_group, clip_norm, max_norm) -> None:
        b1, b2 = self.betas
        hypers = []
        for (gi, _), (ps, gs, ms, vs, wds, cs, backend) in by_group.items():
            hyper = backend.adamw_hyper_buffer()
            hypers.append((gi, hyper, backend))
            backend.adamw_step(ps, gs, ms, vs, wds, self.param_groups[gi]["lr"], b1, b2, self.eps,
                               self.step_count + 1, clip_norm=clip_norm, max_norm=max_norm, copies=cs,
                               hyper=hyper)

        def advance():  # before each replay: this step's count, lr and bias corrections
            self.step_count += 1
            for gi, hyper, backend in hypers:
                backend.adamw_set_hyper(hyper, self.param_groups[gi]["lr"], b1, b2, self.step_count)

        before_each_replay(advance)

    def update_state(self):
        """What step() changes (the parameters, the moments, the count), copied on the device: undo a
        step with restore_update_state (kiln launch's skip of a bad step)."""
        moments = None if self._moments is None else tuple([m.copy() for m in ms] for ms in self._moments)
        return [p.data.copy() for p in self.params], moments, self.step_count

    def restore_update_state(self, saved) -> None:
        """Put update_state()'s copy back in place (the same buffers: a captured graph stays valid)."""
        params, moments, count = saved
        for p, a in zip(self.params, params):
            p.data[...] = a
            p._bump()
        if moments is None:
            self._moments = None
        else:
            for live, copy in zip(self._moments, moments):
                for m, a in zip(live, copy):
                    m[...] = a
        self.step_count = count

    def state_dict(self) -> dict:
        """Step count, hyperparameters and the moments (backend arrays), in parameter order."""
        return {"step": self.step_count, "betas": list(self.betas), "eps": self.eps,
                "groups": [{"lr": g["lr"], "weight_decay": g["weight_decay"], "size": len(g["params"])}
                           for g in self.param_groups],
                "exp_avg": None if self._moments is None else list(self._moments[0]),
                "exp_avg_sq": None if self._moments is None else list(self._moments[1])}

    def load_state_dict(self, state: dict) -> None:
        sizes = [g["size"] for g in state["groups"]]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise KilnError(f"optimizer state has param groups of sizes {sizes}, this optimizer "
                            f"{[len(g['params']) for g in self.param_groups]}")
        self.step_count = int(state["step"])
        self.betas = tuple(state["betas"])
        self.eps = float(state["eps"])
        for g, s in zip(self.param_groups, state["groups"]):
            g["lr"], g["weight_decay"] = s["lr"], s["weight_decay"]
        if state["exp_avg"] is None:
            self._moments = None
            return
        params = self.params
        for name in ("exp_avg", "exp_avg_sq"):
            for p, m in zip(params, state[name]):
                if tuple(m.shape) != p.shape:
                    raise KilnError(f"optimizer {name} of shape {tuple(m.shape)} for a parameter of shape {p.shape}")
        self._moments = ([p.backend.asarray(m).astype(p.dtype.np) for p, m in zip(params, state["exp_avg"])],
                         [p.backend.asarray(m).astype(p.dtype.np) for p, m in zip(params, state["exp_avg_sq"])])
