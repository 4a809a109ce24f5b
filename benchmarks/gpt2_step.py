"""GPT-2 124M training steps: kiln vs PyTorch eager vs torch.compile, on one GPU, in one call.

    python benchmarks/gpt2_step.py [--modes fp32,tf32,bf16] [--steps 50] [--batch-size 16]

Every (framework, mode) trains in its own subprocess from the same initial weights on the same
batches (the bundled corpus as bytes, B x T tokens a step), with AdamW (fused in PyTorch),
clipping at 1.0 and lr 6e-4. tokens/s is the median over the steps after --warmup; peak memory
is the framework's own peak of allocated device memory; fidelity is the largest difference of
the per-step losses against PyTorch eager in the same mode. Writes
benchmarks/results/gpt2_step/gpt2_step-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))


def _batches(n, b, t):
    from kiln.data.corpus import bundled_dataset
    from kiln.data.loader import ShardLoader
    loader = ShardLoader(bundled_dataset(), "train", batch_size=b, seq_len=t)
    return [loader.next_batch() for _ in range(n)]


def _model(args):
    import kiln
    from kiln.nn import GPT, preset
    cfg = preset("gpt2-124m", n_layer=args.n_layer)
    return GPT(cfg, generator=kiln.Generator(1234)), cfg


def run_kiln(args, batches):
    import kiln
    from kiln.graph import CapturedStep
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision
    model, _ = _model(args)
    dev = kiln.device("cuda")
    model.to(dev)
    apply_precision(model, args.mode, dev)
    backend = dev.backend
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8)

    def step(x, y):  # the Trainer's step: the clip fused into AdamW
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        return loss

    graph = CapturedStep(step) if args.cuda_graph else None
    losses, times = [], []
    for i, (x, y) in enumerate(batches):
        if i == 1:
            backend.end_warmup()  # the paper's allocator: learn the rounding, return step 0's cache
        t0 = time.perf_counter()
        xs, ys = kiln.tensor(x, device=dev), kiln.tensor(y, device=dev)
        # as the Trainer: two eager steps warm kernels, GEMM plans and the allocator, then one graph
        loss = graph(xs, ys) if graph is not None and i >= 2 else step(xs, ys)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    stats = backend.memory_stats()
    if args.kernel_profile:
        xs, ys = kiln.tensor(batches[-1][0], device=dev), kiln.tensor(batches[-1][1], device=dev)
        _profile_kernels(lambda: (graph(xs, ys) if graph is not None else step(xs, ys)).item(), args)
    return losses, times, stats["peak_allocated_bytes"], stats


def run_torch(args, batches, compiled: bool):
    import torch

    from tests.torch_gpt import torch_gpt_forward, torch_params
    model, cfg = _model(args)
    params = {k: v.detach().cuda().requires_grad_(True) for k, v in torch_params(model, torch.float32).items()}
    torch.backends.cuda.matmul.allow_tf32 = args.mode == "tf32"
    torch.backends.cudnn.allow_tf32 = args.mode == "tf32"
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(torch_gpt_forward) if compiled else torch_gpt_forward
    plist = list(params.values())

    def step(xs, ys):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.mode == "bf16"):
            _, loss = fwd(params, cfg, xs, ys)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        return loss.item()

    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    for x, y in batches:
        t0 = time.perf_counter()
        losses.append(step(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()))
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    if args.kernel_profile:
        xs, ys = torch.from_numpy(batches[-1][0]).cuda(), torch.from_numpy(batches[-1][1]).cuda()
        _profile_kernels(lambda: step(xs, ys), args)
    return losses, times, peak, {}


def _profile_kernels(one_step, args, steps: int = 3) -> None:
    """The GPU kernels of `steps` more steps, by total time (CUPTI through torch.profiler, so it
    also sees kiln's CuPy and cuBLASLt kernels, inside a CUDA graph too); a table per framework."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    one_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    out = Path(args.kernel_profile)
    out.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90)
    (out / f"kernels-{args.framework}-{args.mode}.txt").write_text(
        f"{args.framework} {args.mode}: GPU kernels of {steps} steps (divide the totals by {steps})\n{table}\n")


def worker(args) -> dict:
    batches = _batches(args.steps, args.batch_size, args.seq_len)
    if args.framework == "kiln":
        losses, times, peak, extra = run_kiln(args, batches)
    else:
        losses, times, peak, extra = run_torch(args, batches, args.framework == "compile")
    timed = np.array(times[args.warmup:])
    tokens = args.batch_size * args.seq_len
    return {"framework": args.framework, "mode": args.mode, "tokens_per_s": tokens / float(np.median(timed)),
            "median_step_ms": 1000 * float(np.median(timed)), "peak_allocated_gib": peak / 2**30,
            "losses": losses, "step_ms": [1000 * t for t in times], "memory": extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="fp32,tf32,bf16")
    ap.add_argument("--frameworks", default="kiln,eager,compile")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpt2_step"))
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                    help="kiln runs every step op by op (default: replayed as one CUDA graph from step 2)")
    ap.add_argument("--kernel-profile", metavar="DIR",
                    help="after the timed steps, profile 3 more steps per framework: a table of GPU kernels in DIR")
    ap.add_argument("--framework", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.framework:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    rows = []
    for mode in args.modes.split(","):
        for fw in args.frameworks.split(","):
            cmd = [sys.executable, __file__, "--framework", fw, "--mode", mode, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len), "--n-layer", str(args.n_layer)] + \
                  ([] if args.cuda_graph else ["--no-cuda-graph"]) + \
                  (["--kernel-profile", args.kernel_profile] if args.kernel_profile else [])
            t0 = time.time()
            done = subprocess.run(cmd, capture_output=True, text=True)
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode or not line:
                print(f"{fw} {mode}: FAILED\n{done.stderr[-3000:]}", flush=True)
                rows.append({"framework": fw, "mode": mode, "error": done.stderr[-3000:]})
                continue
            r = json.loads(line[0][7:])
            r["wall_s"] = time.time() - t0
            rows.append(r)
            print(f"{fw:8} {mode:5} {r['tokens_per_s']:10.0f} tok/s {r['peak_allocated_gib']:7.2f} GiB "
                  f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} ({r['wall_s']:.0f} s)", flush=True)
    by = {(r["framework"], r["mode"]): r for r in rows if "error" not in r}
    for r in rows:
        ref = by.get(("eager", r["mode"]))
        if "error" not in r and ref:
            r["max_loss_diff_vs_eager"] = float(max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])))
            r["tokens_per_s_vs_eager"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["memory_vs_eager"] = r["peak_allocated_gib"] / ref["peak_allocated_gib"]
        comp = by.get(("compile", r["mode"]))
        if "error" not in r and comp:
            r["tokens_per_s_vs_compile"] = r["tokens_per_s"] / comp["tokens_per_s"]
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    import torch
    date = time.strftime("%Y-%m-%d")
    record = {"benchmark": "gpt2_step", "date": date,
              "commit": os.environ.get("KILN_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
              "command": " ".join(["python", *sys.argv]), "device": gpu, "torch": torch.__version__,
              "python": platform.python_version(), "batch": [args.batch_size, args.seq_len],
              "n_layer": args.n_layer, "steps": args.steps, "warmup": args.warmup,
              "kiln_cuda_graph": args.cuda_graph, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpt2_step-{date}.json").write_text(json.dumps(record, indent=2))
    lines = ["| framework | mode | tokens/s | vs eager | vs compile | peak GiB | vs eager | max loss diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['mode']} | failed | | | | | |")
            continue
        lines.append(f"| {r['framework']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
                     f"{r.get('tokens_per_s_vs_eager', float('nan')):.2f} | {r.get('tokens_per_s_vs_compile', float('nan')):.2f} | "
                     f"{r['peak_allocated_gib']:.2f} | {r.get('memory_vs_eager', float('nan')):.2f} | "
                     f"{r.get('max_loss_diff_vs_eager', float('nan')):.2e} |")
    (out / f"gpt2_step-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
