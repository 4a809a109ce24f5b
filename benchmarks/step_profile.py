"""Where a GPT-2 training step's time goes, against the machine's limits: the graph-replayed step's
kernels (CUPTI through torch.profiler, which sees inside a CUDA graph), by family, with achieved
TFLOP/s or GB/s as a fraction of the device's measured ceilings; the step's MFU; and kiln's
profiler's own overhead (eager steps with it off and on).

    python benchmarks/step_profile.py [--mode bf16] [--batch-size 16] [--seq-len 1024]

FLOPs and bytes per family come from kiln's profiler over eager steps of the same model and batch
(each backend call's argument shapes); the graph's kernel times from CUPTI. Writes
benchmarks/results/step_profile/step_profile-<mode>-<date>.json and .md, and kiln's profile folder (report.html,
trace.json, memory.png, ...) under --profile-dir.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from result_file import commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# CUDA kernel names -> kiln's kernel families (cuBLASLt's nvjet/xmma/cutlass kernels are GEMMs)
# (column_sum: the bias and LayerNorm-parameter gradients' part and finish kernels, kernels/column_sum.cuh)
KERNEL_FAMILIES = [(r"nvjet|gemm|xmma|cutlass|cublasLt|splitK", "matmul"), (r"attention", "attention"),
                   (r"column_sum", "column_sum"), (r"layer_norm", "layer_norm"), (r"gelu", "gelu"),
                   (r"cross_entropy", "cross_entropy"), (r"embedding", "embedding"),
                   (r"adamw|sumsq|scale_multi", "adamw"), (r"softmax", "softmax"), (r"dropout|philox", "dropout"),
                   (r"^void (add|cast)<", "elementwise")]


def family_of(kernel: str) -> str:
    for pattern, fam in KERNEL_FAMILIES:
        if re.search(pattern, kernel):
            return fam
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="bf16")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--eager-steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_profile"))
    ap.add_argument("--profile-dir", default=None, help="kiln's profile folder (default: <out>/step_profile-<mode>-<date>)")
    args = ap.parse_args()

    import kiln
    from kiln.graph import CapturedStep
    from kiln.nn import GPT, preset
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.profiler import Profiler
    from kiln.profiler.ceilings import ceilings
    from kiln.profiler.cost import FAMILIES, gpt_flops_per_token, mfu
    from kiln.train import apply_precision

    dev = kiln.device(args.device)
    cuda = dev.type == "cuda"
    limits = ceilings(dev)
    cfg = preset(args.model, n_layer=args.n_layer)
    model = GPT(cfg, generator=kiln.Generator(1234))
    model.to(dev)
    apply_precision(model, args.mode, dev)
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(0)
    x = kiln.tensor(rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len)), device=dev)
    y = kiln.tensor(rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len)), device=dev)

    def step(xs=x, ys=y):
        opt.zero_grad()
        _, loss = model(xs, ys)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        return loss

    def timed(fn, n):
        out = []
        for _ in range(n):
            dev.backend.synchronize()
            t0 = time.perf_counter()
            fn().item()
            out.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(out))

    step().item()
    if cuda:
        dev.backend.end_warmup()
    step().item()
    eager_ms = timed(step, args.eager_steps)
    date = time.strftime("%Y-%m-%d")
    stem = f"step_profile-{args.mode}-{date}"
    with Profiler(dev, ceilings=limits) as prof:
        profiled = [timed(step, 1) for _ in range(args.eager_steps)]
    folder = Path(args.profile_dir or Path(args.out) / stem)
    s = prof.write(folder, title=f"kiln {args.model} {args.mode} B{args.batch_size} T{args.seq_len}, eager steps")
    per_step = {k: {"flops": v["flops"] / args.eager_steps, "bytes": v["bytes"] / args.eager_steps}
                for k, v in s["kernels"].items()}
    fam_cost = defaultdict(lambda: [0.0, 0.0])
    for k, v in per_step.items():
        fam_cost[FAMILIES.get(k, k)][0] += v["flops"]
        fam_cost[FAMILIES.get(k, k)][1] += v["bytes"]

    tokens = args.batch_size * args.seq_len
    fpt = gpt_flops_per_token(cfg, args.seq_len)
    gemm_peak = limits["gemm_tflops"].get(args.mode) or limits["gemm_tflops"]["fp32"]
    record = {"benchmark": "step_profile", "date": date, "command": " ".join(["python", *sys.argv]),
              "commit": commit(),
              "device": limits["device"], "ceilings": limits, "model": args.model, "mode": args.mode,
              "batch": [args.batch_size, args.seq_len], "flops_per_token": fpt,
              "eager_step_ms": eager_ms, "profiled_eager_step_ms": float(np.median(profiled)),
              "profiler_overhead": float(np.median(profiled)) / eager_ms - 1,
              "eager_mfu": mfu(tokens / (eager_ms * 1e-3), fpt, gemm_peak * 1e12),
              "kernel_cost_per_step": per_step, "profile_folder": str(folder)}
    lines = [f"# {args.model} {args.mode} step, B{args.batch_size} T{args.seq_len} on {limits['device']}", "",
             f"ceilings (measured, cached): GEMM {limits['gemm_tflops']} TFLOP/s, copy {limits['copy_gbps']:.0f} GB/s",
             (f"eager step {eager_ms:.2f} ms; under kiln's profiler {record['profiled_eager_step_ms']:.2f} ms "
              f"(overhead {100 * record['profiler_overhead']:+.1f}%)")]

    if cuda:
        import torch
        from torch.profiler import ProfilerActivity, profile
        captured = CapturedStep(step)

        def graph():
            return captured(x, y)
        for _ in range(3):
            graph().item()
        graph_ms = timed(graph, args.replays)
        record.update(graph_step_ms=graph_ms, tokens_per_s=tokens / (graph_ms * 1e-3),
                      mfu=mfu(tokens / (graph_ms * 1e-3), fpt, gemm_peak * 1e12))
        n = 5
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            for _ in range(n):
                graph()
            dev.backend.synchronize()
        kernels = []
        for e in tp.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if us:
                kernels.append({"kernel": e.key, "family": family_of(e.key), "ms_per_step": us / 1e3 / n,
                                "calls_per_step": e.count / n})
        kernels.sort(key=lambda k: -k["ms_per_step"])
        fam_ms = defaultdict(float)
        for k in kernels:
            fam_ms[k["family"]] += k["ms_per_step"]
        families = []
        for fam, ms in sorted(fam_ms.items(), key=lambda kv: -kv[1]):
            flops, nbytes = fam_cost.get(fam, (0.0, 0.0))
            row = {"family": fam, "ms_per_step": ms, "share": ms / sum(fam_ms.values()), "flops": flops,
                   "bytes": nbytes}
            if flops:
                row["tflops"] = flops / (ms * 1e-3) / 1e12
                row["ceiling_fraction"] = row["tflops"] / gemm_peak
            elif nbytes:
                row["gbps"] = nbytes / (ms * 1e-3) / 1e9
                row["ceiling_fraction"] = row["gbps"] / limits["copy_gbps"]
            families.append(row)
        record.update(graph_kernels=kernels, graph_families=families)
        lines += [(f"graph-replayed step {graph_ms:.2f} ms = {record['tokens_per_s']:,.0f} tokens/s, "
                   f"MFU {100 * record['mfu']:.1f}% of the measured {args.mode} GEMM ceiling "
                   f"({fpt / 1e9:.3f} GFLOP/token)"), "",
                  "| family | ms/step | share | TFLOP/s | GB/s | of ceiling |", "|---|---|---|---|---|---|"]
        for r in families:
            lines.append(f"| {r['family']} | {r['ms_per_step']:.3f} | {100 * r['share']:.1f}% | "
                         f"{r.get('tflops', float('nan')):.1f} | {r.get('gbps', float('nan')):.0f} | "
                         f"{100 * r.get('ceiling_fraction', float('nan')):.1f}% |")
        lines += ["", "| kernel (graph replay, CUPTI) | family | ms/step | calls/step |", "|---|---|---|---|"]
        lines += [f"| `{k['kernel'][:90]}` | {k['family']} | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |"
                  for k in kernels[:40]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
