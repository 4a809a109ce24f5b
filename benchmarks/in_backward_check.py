"""Diagnostic for the open CUDA failure of AdamW in backward (tests/test_adamw_in_backward.py's
test_cuda_in_backward_step_equals_backward_clip_step_bit_for_bit, all four cases, H200 2026-12-05).

    PYTHONPATH=src python benchmarks/in_backward_check.py [--recompute 1 --norm-gelu] [--max-norm 0.05]
        (GPU; output in benchmarks/results/diagnostics/in-backward-*.log when redirected there)

The test's tiny tied GPT (fp32, head dim 8: attention runs on the CPU through cpu_fallback) trained twice
side by side, 3 steps; each line is one pairing of two models (A stepped first in each step, then B):

    ordinary-ordinary  both loss.backward() + clip + step: is the CUDA path itself repeatable in one process?
    ordinary-inside    the failing test's pairing
    inside-ordinary    the same with the in-backward model stepped first (does the second model part?)
    inside-inside      both AdamW(in_backward=True)
    sync               ordinary-inside, the device synchronised after every in-backward hook (a race?)
    keep               ordinary-inside, every gradient the hooks drop kept alive to the step's end (reuse
                       of a dropped gradient's memory?)

Per step: the two clip norms (bit-equal or not) and the parameters whose bytes differ after the step.
On the CPU the test passes bit for bit: the CPU backend's values are printed first as the reference.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import numpy as np
from test_adamw_in_backward import adamw, batches, tiny_gpt


def make(kind, device, recompute, norm_gelu, mode):
    model = tiny_gpt("float32")
    if device != "cpu":
        model = model.to(device)
    model.recompute_blocks, model.recompute_norm_gelu = recompute, norm_gelu
    opt = adamw(model, kind == "inside")
    kept = []
    if kind == "inside" and mode in ("sync", "keep"):
        original = opt._gradient_final

        def hook(p):
            if mode == "keep":
                kept.append(p.grad)
            original(p)
            if mode == "sync":
                p.backend.synchronize()
        for p in model.parameters():
            p._post_accumulate_hooks[:] = [hook]
    return model, opt, kept


def step(model, opt, kept, x, y, max_norm):
    if opt.in_backward:
        norm = opt.backward_step(model(x, y)[1], max_norm)
        kept.clear()
        return norm
    opt.zero_grad()
    model(x, y)[1].backward()
    norm = opt.clip_grad_norm_(max_norm) if max_norm is not None else None
    opt.step()
    return norm


def run(label, kinds, device, args, mode="plain"):
    a, b = (make(k, device, args.recompute, args.norm_gelu, mode) for k in kinds)
    for i, (x, y) in enumerate(batches(3)):
        x, y = x.to(device), y.to(device)
        na, nb = step(*a, x, y, args.max_norm), step(*b, x, y, args.max_norm)
        norms = "" if na is None else (f"norms {float(na.item()):.9g} {float(nb.item()):.9g} "
                                       f"{'equal' if na.numpy().tobytes() == nb.numpy().tobytes() else 'DIFFER'}  ")
        differ = [n for (n, p), q in zip(a[0].named_parameters(), b[0].parameters())
                  if p.numpy().tobytes() != q.numpy().tobytes()]
        worst = max((float(np.abs(p.numpy() - q.numpy()).max()) for p, q in zip(a[0].parameters(), b[0].parameters())))
        print(f"{label:18s} step {i}: {norms}{len(differ)} parameters differ (max |diff| {worst:.3g})"
              f"{': ' + ', '.join(differ[:6]) if differ else ''}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recompute", type=int, default=0)
    ap.add_argument("--norm-gelu", action="store_true")
    ap.add_argument("--max-norm", type=float, default=0.05, help="the clip; 0: none")
    args = ap.parse_args()
    args.max_norm = args.max_norm or None
    run("cpu reference", ("ordinary", "inside"), "cpu", args)
    for label, kinds in (("ordinary-ordinary", ("ordinary", "ordinary")), ("ordinary-inside", ("ordinary", "inside")),
                         ("inside-ordinary", ("inside", "ordinary")), ("inside-inside", ("inside", "inside"))):
        run(label, kinds, "cuda", args)
    for mode in ("sync", "keep"):
        run(mode, ("ordinary", "inside"), "cuda", args, mode)


if __name__ == "__main__":
    main()
