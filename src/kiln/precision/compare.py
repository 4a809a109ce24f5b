"""One GPT step, or N training steps, in kiln and in PyTorch from the same weights and batches:
per-op forward outputs, their gradients and every parameter gradient as statistics, the first
place where kiln and the reference part beyond the precision's tolerance (paper §2.3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kiln.dtypes import bfloat16
from kiln.errors import ConfigError
from kiln.precision.capture import Capture
from kiln.precision.reference import PRECISIONS, TorchGPT, import_torch
from kiln.precision.stats import TOLERANCE, compare_arrays


def _host(backend, arr) -> np.ndarray:
    return backend.to_numpy(arr)


def _torch_host(t) -> np.ndarray:
    """A torch tensor as numpy with its own bits (bf16 as ml_dtypes' bfloat16)."""
    torch = import_torch()
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16.np)
    return t.numpy()


class Comparison:
    """kiln's `model` (a GPT) against a PyTorch copy of its weights, step after step.

    precision: fp64 / fp32 / tf32 / bf16 (kiln's model must already run in it: train.apply_precision).
    names: fnmatch patterns of the ops to record (all when None). reference_state: the weights the
    reference starts from (default: the model's own). optimizer: kiln's AdamW, for `step(update=True)`;
    the reference gets torch.optim.AdamW with the same groups and hyper-parameters. dump_dir: also
    save the full tensors of each step there (.npz), which is off by default. tolerance: the relative
    error beyond which an op counts as diverged (default: stats.TOLERANCE of the precision)."""

    def __init__(self, model, precision: str, names=None, reference_state=None, optimizer=None,
                 grad_clip: float = 0.0, dump_dir=None, tolerance: float | None = None):
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
        if model.config.dropout:
            raise ConfigError(f"the comparison needs dropout 0 (the two frameworks draw different masks), "
                              f"got model.dropout={model.config.dropout}")
        torch = import_torch()
        self.model, self.precision, self.names = model, precision, names
        self.tolerance = TOLERANCE[precision] if tolerance is None else tolerance
        self.backend = next(model.parameters()).backend
        device = next(model.parameters()).device
        self.torch_device = "cuda" if device.type == "cuda" else "cpu"
        state = reference_state if reference_state is not None else \
            {n: p.numpy() for n, p in model.named_parameters()}
        self.ref = TorchGPT(state, model.config, precision, self.torch_device)
        self.optimizer, self.grad_clip = optimizer, grad_clip
        self.ref_optimizer = None
        if optimizer is not None:
            by_id = {id(p): n for n, p in model.named_parameters()}
            self.ref_optimizer = torch.optim.AdamW(
                [{"params": [self.ref.params[by_id[id(p)]] for p in g["params"]],
                  "lr": g["lr"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups],
                betas=optimizer.betas, eps=optimizer.eps, foreach=False)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.steps: list[dict] = []

    def step(self, idx: np.ndarray, targets: np.ndarray, update: bool = False) -> dict:
        """Forward and backward of one batch on both sides (and the optimizer steps, with update);
        the step's rows and first divergences, appended to self.steps."""
        import kiln
        torch = import_torch()
        model, ref = self.model, self.ref
        device = next(model.parameters()).device
        for p in model.parameters():
            p.grad = None
        for p in ref.params.values():
            p.grad = None
        with Capture(model, self.names) as cap:
            _, loss = model(kiln.tensor(idx, device=device), kiln.tensor(targets, device=device))
            loss.backward()
        t_idx = torch.as_tensor(np.asarray(idx), dtype=torch.int64, device=self.torch_device)
        t_tgt = torch.as_tensor(np.asarray(targets), dtype=torch.int64, device=self.torch_device)
        _, t_loss = ref.forward(t_idx, t_tgt)
        t_loss.backward()

        forward, backward, dumps = [], [], {}
        for rec in cap.records:
            t = ref.taps.get(rec.name)
            if t is None:
                continue
            a, b = _host(self.backend, rec.value), _torch_host(t)
            forward.append({"name": rec.name, "kiln_op": f"{rec.path or '(model)'}:{rec.op}"
                            + (f"[{rec.output}]" if rec.op == "AddLayerNorm" else ""), **compare_arrays(a, b)})
            if self.dump_dir is not None:
                dumps[f"fwd/{rec.name}/kiln"], dumps[f"fwd/{rec.name}/ref"] = a, b
        for rec in sorted((r for r in cap.records if r.compare_grad and r.grad is not None),
                          key=lambda r: r.grad_order):
            t = ref.taps.get(rec.name)
            if t is None or t.grad is None:
                continue
            a, b = _host(self.backend, rec.grad), _torch_host(t.grad)
            backward.append({"name": rec.name, **compare_arrays(a, b)})
            if self.dump_dir is not None:
                dumps[f"bwd/{rec.name}/kiln"], dumps[f"bwd/{rec.name}/ref"] = a, b
        params = []
        for name, p in model.named_parameters():
            params.append({"name": name, **compare_arrays(p.grad.numpy(), _torch_host(ref.params[name].grad))})
        fused = sorted(set(ref.taps) - {r.name for r in cap.records})
        if self.names is not None:
            import fnmatch
            fused = [n for n in fused if any(fnmatch.fnmatchcase(n, p) for p in self.names)]

        out = {"step": len(self.steps) + 1, "loss": float(loss.item()), "ref_loss": float(t_loss.item()),
               "forward": forward, "backward": backward, "param_grads": params,
               "reference_only": fused, "unmapped_kiln_ops": sorted(f"{p or '(model)'}:{op}" for p, op in cap.unmapped)}
        for kind in ("forward", "backward", "param_grads"):
            out[f"first_{kind}_divergence"] = next((r["name"] for r in out[kind] if r["rel_err"] > self.tolerance),
                                                   None)
        if update:
            self._update()
            out["param_rel_err_after_update"] = max(
                compare_arrays(p.numpy(), _torch_host(ref.params[n]))["rel_err"] for n, p in model.named_parameters())
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            np.savez(self.dump_dir / f"step{out['step']}.npz",
                     **{k: v.astype(np.float64) for k, v in dumps.items()})
        self.steps.append(out)
        return out

    def _update(self):
        if self.optimizer is None:
            raise ConfigError("Comparison.step(update=True) needs the kiln optimizer (optimizer=...)")
        torch = import_torch()
        if self.grad_clip > 0:
            self.optimizer.clip_grad_norm_(self.grad_clip)
            torch.nn.utils.clip_grad_norm_(list(self.ref.params.values()), self.grad_clip)
        self.optimizer.step()
        self.ref_optimizer.step()

    def summary(self) -> dict:
        """The run: precision, tolerance, the first step and op that diverged, and every step.

        Step 1 (the same weights on both sides) is judged op by op. After an update the two sides
        hold weights that differ by the rounding of the update, so the ops of later steps carry that
        drift too (their statistics are kept, and shown); a trajectory is judged by its loss."""
        first = next(((1, kind, self.steps[0][f"first_{kind}_divergence"])
                      for kind in ("forward", "backward", "param_grads")
                      if self.steps and self.steps[0][f"first_{kind}_divergence"]), None)
        if first is None:
            first = next(((s["step"], "loss", "loss") for s in self.steps[1:]
                          if abs(s["loss"] - s["ref_loss"]) > self.tolerance * abs(s["ref_loss"])), None)
        return {"precision": self.precision, "tolerance": self.tolerance, "steps": self.steps,
                "first_divergence": None if first is None else {"step": first[0], "pass": first[1], "name": first[2]}}

    def write(self, out_dir) -> tuple[Path, Path]:
        """compare.json (every statistic) and compare.md (the tables) in out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        s = self.summary()
        (out / "compare.json").write_text(json.dumps(s, indent=1))
        (out / "compare.md").write_text(markdown(s))
        return out / "compare.json", out / "compare.md"


def headline(summary: dict) -> str:
    """One line per step (loss, worst errors) and where kiln and PyTorch first part, if they do."""
    tol = summary["tolerance"]
    lines = []
    for s in summary["steps"]:
        worst = {k: max((r["rel_err"] for r in s[k]), default=0.0) for k in ("forward", "backward", "param_grads")}
        lines.append(f"step {s['step']}: loss {s['loss']:.6f} (PyTorch {s['ref_loss']:.6f}); worst relative error "
                     f"forward {worst['forward']:.2e}, activation grads {worst['backward']:.2e}, parameter grads "
                     f"{worst['param_grads']:.2e}" + (f", parameters after the update "
                                                     f"{s['param_rel_err_after_update']:.2e}"
                                                     if "param_rel_err_after_update" in s else ""))
    f = summary["first_divergence"]
    if f is None:
        lines.append(f"no op beyond the {summary['precision']} tolerance {tol:g} in {len(summary['steps'])} step(s)")
    else:
        lines.append(f"FIRST DIVERGENCE ({summary['precision']}, tolerance {tol:g}): step {f['step']}, "
                     f"{f['pass']} pass, at {f['name']}")
    return "\n".join(lines)


def markdown(summary: dict) -> str:
    """The summary as Markdown: the headline, then per step a table per pass, diverged rows marked."""
    tol = summary["tolerance"]
    out = ["# kiln vs PyTorch", "", "```", headline(summary), "```", ""]
    cols = ("name", "shape", "dtype", "ref_dtype", "l2", "ref_l2", "max_abs_diff", "rel_err", "cosine", "hash",
            "ref_hash")
    for s in summary["steps"]:
        for kind in ("forward", "backward", "param_grads"):
            out += [f"## step {s['step']}: {kind}", "", "| " + " | ".join(("", "kiln op") + cols if kind == "forward"
                                                                         else ("",) + cols) + " |",
                    "|" + "---|" * (len(cols) + (2 if kind == "forward" else 1))]
            for r in s[kind]:
                mark = "**>**" if r["rel_err"] > tol else ""
                cells = [mark] + ([r["kiln_op"]] if kind == "forward" else [])
                for c in cols:
                    v = r.get(c, "")
                    cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        if s["reference_only"]:
            out += [f"Reference ops inside a fused kiln op (no kiln value): {', '.join(s['reference_only'])}", ""]
    return "\n".join(out)
