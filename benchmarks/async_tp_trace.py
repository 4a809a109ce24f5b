"""The async-TP schedule (paper §4.2) in a GPU trace: each row-parallel layer's GEMM chunks on the
compute stream, each chunk's all-reduce on the communication stream, ordered by events.

    python benchmarks/async_tp_trace.py                        (one GPU: world size 1, NCCL)
    torchrun --nproc-per-node W benchmarks/async_tp_trace.py   (W GPUs: the overlap itself)

For each chunk count N (--chunks, default 1,4) a GPT tensor-parallel over the world
(kiln.distributed.parallelize_tensor) runs forward + backward op by op; --steps steps after three
warm-up steps are recorded with torch.profiler (CUPTI sees every kernel, copy and CUDA runtime call
of the process, kiln's CuPy ones included) into trace-N<N>-w<W>-rank<R>.json (open it in
https://ui.perfetto.dev). Per step the summary gives the GEMM and collective (NCCL) kernels, the
streams they ran on, the event records and stream waits, and the collective time that overlaps a
GEMM on another stream. A block's forward has 2 (N - 1) more GEMMs than with N = 1 (both
row-parallel layers in N chunks; their backward is one GEMM each). At world size 1 an in-place
NCCL all-reduce launches no kernel, so the trace shows the chunks and the event ordering but no
overlap: that needs W >= 2. Rank 0 writes summary.json and summary.md beside the traces (--out,
default benchmarks/results/async_tp_trace/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from result_file import commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
WARMUP = 3
GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass")  # cuBLASLt's kernel names on Hopper and before


def kind_of(kernel: str) -> str:
    """collective (an NCCL kernel), gemm (cuBLASLt's) or other."""
    name = kernel.lower()
    if "nccl" in name:
        return "collective"
    return "gemm" if any(k in name for k in GEMM_NAMES) else "other"


def covered_us(intervals, others) -> float:
    """Microseconds of intervals [(start, end)] during which at least one of others runs."""
    merged = []
    for a, b in sorted(others):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return float(sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in merged))


def summarize(trace: dict, steps: int) -> dict:
    """Per-step counts and times of a torch.profiler Chrome trace of `steps` steps."""
    kernels = defaultdict(list)  # (kind, stream) -> [(start, end)]
    runtime = defaultdict(int)
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "kernel":
            kernels[(kind_of(e["name"]), e.get("args", {}).get("stream"))].append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "cuda_runtime":
            runtime[e["name"]] += 1
    streams = {kind: sorted({s for k, s in kernels if k == kind}) for kind in ("gemm", "collective")}
    collective_us = overlapped_us = 0.0
    for (kind, stream), spans in kernels.items():
        if kind != "collective":
            continue
        gemms_elsewhere = [span for (k, s), other in kernels.items() if k == "gemm" and s != stream for span in other]
        collective_us += sum(b - a for a, b in spans)
        overlapped_us += covered_us(spans, gemms_elsewhere)
    count = {kind: sum(len(v) for (k, _), v in kernels.items() if k == kind) for kind in ("gemm", "collective", "other")}
    return {"gemm_kernels_per_step": count["gemm"] / steps, "collective_kernels_per_step": count["collective"] / steps,
            "other_kernels_per_step": count["other"] / steps, "gemm_streams": streams["gemm"],
            "collective_streams": streams["collective"],
            "event_records_per_step": sum(n for name, n in runtime.items() if "EventRecord" in name) / steps,
            "stream_waits_per_step": sum(n for name, n in runtime.items() if "StreamWaitEvent" in name) / steps,
            "collective_ms_per_step": collective_us / 1e3 / steps, "overlapped_ms_per_step": overlapped_us / 1e3 / steps,
            "overlap_fraction": overlapped_us / collective_us if collective_us else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--chunks", default="1,4", help="async-TP chunk counts (1: plain TP)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--steps", type=int, default=2, help="steps recorded per chunk count")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "async_tp_trace"))
    args = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kiln
    import kiln.distributed as dist
    from kiln.distributed.tensor_parallel import parallelize_tensor
    from kiln.nn import GPT, preset
    from kiln.train import apply_precision
    env = dist.detect()
    world = dist.init_process_group("nccl")
    dev = kiln.device(f"cuda:{env.local_rank}")
    torch.cuda.set_device(env.local_rank)
    torch.cuda.synchronize()  # torch's CUDA (and CUPTI) on the context kiln's CuPy uses
    cfg = preset(args.preset)
    rng = np.random.default_rng(0)
    x, y = (kiln.tensor(rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len)), device=dev) for _ in range(2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for chunks in [int(c) for c in args.chunks.split(",")]:
        model = GPT(cfg, generator=kiln.Generator(0)).to(dev)
        apply_precision(model, args.precision, dev)
        parallelize_tensor(model, world, chunks)

        def step():
            model.zero_grad()
            loss = model(x, y)[1]
            loss.backward()
            return loss
        for _ in range(WARMUP):
            step().item()
        dev.backend.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            dev.backend.synchronize()
        trace = out / f"trace-N{chunks}-w{world.size}-rank{world.rank}.json"
        prof.export_chrome_trace(str(trace))
        rows.append({"chunks": chunks, "trace": trace.name, **summarize(json.loads(trace.read_text()), args.steps)})
    if world.rank == 0:
        base = rows[0]["gemm_kernels_per_step"] - 2 * (rows[0]["chunks"] - 1) * cfg.n_layer
        lines = [f"# async TP schedule, {args.preset} B{args.batch_size} T{args.seq_len} {args.precision}, "
                 f"W={world.size}, {args.steps} steps per N", "",
                 "| N | GEMMs/step (expected) | NCCL kernels/step | GEMM streams | NCCL streams | event records | "
                 "stream waits | NCCL ms/step | overlapped with a GEMM |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            expected = base + 2 * (r["chunks"] - 1) * cfg.n_layer
            frac = "-" if r["overlap_fraction"] is None else f"{100 * r['overlap_fraction']:.0f}%"
            lines.append(f"| {r['chunks']} | {r['gemm_kernels_per_step']:.0f} ({expected:.0f}) | "
                         f"{r['collective_kernels_per_step']:.0f} | {r['gemm_streams']} | {r['collective_streams']} | "
                         f"{r['event_records_per_step']:.0f} | {r['stream_waits_per_step']:.0f} | "
                         f"{r['collective_ms_per_step']:.3f} | {frac} |")
        record = {"benchmark": "async_tp_trace", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "commit": commit(), "world_size": world.size,
                  "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "args": vars(args),
                  "rows": rows}
        (out / "summary.json").write_text(json.dumps(record, indent=1))
        (out / "summary.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
