"""The overlap proof of DDP (Algorithm 1, issue 13): each bucket's all-reduce runs while backward
still computes, and how much of the communication time backward hides.

    python benchmarks/ddp_overlap.py                        # one GPU: NCCL at world size 1
    mpiexec -n W python benchmarks/ddp_overlap.py           # W GPUs
    mpiexec -n 2 python benchmarks/ddp_overlap.py --device cpu --mode fp32 --n-layer 2 --n-embd 128 \
        --n-head 4 --seq-len 64 --batch-size 4 --bucket-mb 0.25    # the CPU path (MPI)

CUDA: after --warmup steps, --steps DDP steps run op by op ("eager") and --steps more replay the
step as one CUDA graph ("graph"), each step under torch.profiler: CUPTI records every kernel of
the process (kiln's, cuBLASLt's, NCCL's; inside a graph too) with its stream and times. A kernel
is communication when NCCL launched it (its name holds "nccl", or is NCCL's one-rank reduction
"oneRankReduce"), or, op by op, when it ran on another stream than the compute stream (the one
with the most kernel time). Hidden fraction = the time during which some communication kernel
and some compute kernel both ran / the time some communication kernel ran. At world size 1 NCCL
moves nothing between GPUs: a bucket's reduce-scatter (avg) is one local kernel that scales it,
so the trace shows the schedule (each bucket's collective on its own stream while backward
runs), not the bandwidth.

CPU: MPI's collectives have no stream. The host notes when each bucket's collective was launched
and when it was first seen complete (every gradient hook polls the ones in flight), and when
backward began and when its last gradient was ready. Hidden fraction = the time some collective
was in flight inside that interval / the time some collective was in flight.

Rank 0 writes benchmarks/results/ddp/overlap-<date>-w<W>-<device>.{json,md,png} (the figure: the
compute and communication timelines of the last profiled step of each mode) and, on CUDA, that
step's profiler trace per mode (-<mode>.trace.json, Chrome's trace format).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from result_file import run_fields

from kiln.distributed import DistributedDataParallel  # noqa: E402

COMM_NAMES = ("nccl", "onerankreduce")  # NCCL's kernels, and its one-rank reduction (world size 1)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (MPI)")
    ap.add_argument("--mode", default="bf16", help="fp32 or bf16 (kiln's precision)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per mode")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ddp"))
    return ap.parse_args()


# ---------------------------------------------------------------------- intervals
def merged(intervals) -> list:
    """The union of (start, end) intervals, as disjoint sorted intervals."""
    out: list = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def busy(intervals) -> float:
    """The time some interval covers."""
    return sum(e - s for s, e in merged(intervals))


def hidden_fraction(comm, compute) -> float | None:
    """The part of the time some communication runs during which some compute runs too (None
    without communication)."""
    total = busy(comm)
    if total <= 0:
        return None
    cover = merged(compute)
    hidden = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in merged(comm) for cs, ce in cover)
    return hidden / total


def device_timeline(trace: dict, by_stream: bool = True) -> tuple[list, list]:
    """(compute, communication) kernel intervals in ms from the first kernel, of a Chrome trace
    that torch.profiler wrote for CUDA activity. by_stream: a kernel off the busiest stream is
    communication too (op by op, the communication stream's own kernels); not for a graph replay,
    whose kernel nodes run on streams the driver picks (the forward on one, backward on another)."""
    kernels = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels (is CUPTI available to torch.profiler?)")
    per_stream: dict = defaultdict(float)
    for e in kernels:
        per_stream[e["args"].get("stream")] += e["dur"]
    compute_stream = max(per_stream, key=per_stream.get)
    t0 = min(e["ts"] for e in kernels)
    compute, comm = [], []
    for e in kernels:
        span = ((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)
        name = e["name"].lower()
        is_comm = any(n in name for n in COMM_NAMES) or (by_stream and e["args"].get("stream") != compute_stream)
        (comm if is_comm else compute).append(span)
    return compute, comm


# ---------------------------------------------------------------------- the CPU path
class TimedDDP(DistributedDataParallel):
    """DDP that notes on the host when each bucket's collective was launched and first seen done,
    and when each gradient became ready (for the CPU path; it polls, so it is never captured)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans: list = []   # [launched, done or None, work]
        self.last_ready = None  # when the last gradient hook of this backward began

    def _launch(self, bucket):
        work = super()._launch(bucket)
        self.spans.append([time.perf_counter(), None, work])
        return work

    def _hook(self, p) -> None:
        self.last_ready = time.perf_counter()
        super()._hook(p)
        now = time.perf_counter()
        for span in self.spans:
            if span[1] is None and span[2].is_completed():
                span[1] = now


def cpu_step_timeline(model, ddp: TimedDDP, opt, x, y) -> tuple[list, list]:
    """One DDP step on the CPU: ([backward's compute interval], [each bucket's collective]) in ms."""
    ddp.spans = []
    opt.zero_grad()
    _, loss = model(x, y)
    t0 = time.perf_counter()
    loss.backward()
    ddp.wait_gradients()
    opt.clip_grad_norm_(1.0)
    opt.step()
    loss.item()
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    return [(0.0, ms(ddp.last_ready))], [(ms(a), ms(b)) for a, b, _ in ddp.spans]


# ---------------------------------------------------------------------- the run
def main() -> None:
    args = parse_args()
    import kiln
    import kiln.distributed as dist
    from benchmarks.ddp import batches_for, kiln_model
    from kiln.graph import CapturedStep
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    world = dist.init_process_group("nccl" if args.device == "cuda" else "mpi")
    dev = kiln.device(args.device)
    model, _ = kiln_model(args)
    model.to(dev)
    apply_precision(model, args.mode, dev)
    cuda = args.device == "cuda"
    ddp = (DistributedDataParallel if cuda else TimedDDP)(model, world, bucket_cap_mb=args.bucket_mb)
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    x, y = (kiln.tensor(a, device=dev) for a in batches_for(world.rank, argparse.Namespace(**{**vars(args), "steps": 1}))[0])

    step = plain_step(model, opt, after_backward=ddp.wait_gradients)

    record = {"benchmark": "ddp_overlap", "world_size": world.size, "device": args.device, "mode": args.mode,
              "batch_per_rank": [args.batch_size, args.seq_len], "n_layer": args.n_layer, "n_embd": args.n_embd,
              "bucket_mb": args.bucket_mb, "warmup": args.warmup, "steps": args.steps, "modes": {}}
    timelines = {}
    if cuda:
        import torch
        from torch.profiler import ProfilerActivity, profile
        graph = CapturedStep(step)
        runs = {"eager": lambda: step(x, y), "graph": lambda: graph(x, y)}
        for mode, run in runs.items():
            for _ in range(args.warmup):
                run().item()
            fractions, comm_ms, compute_ms = [], [], []
            for _ in range(args.steps):
                dev.backend.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run()
                    dev.backend.synchronize()
                with tempfile.TemporaryDirectory() as tmp:
                    prof.export_chrome_trace(f"{tmp}/trace.json")
                    trace = Path(f"{tmp}/trace.json").read_text()
                compute, comm = device_timeline(json.loads(trace), by_stream=mode == "eager")
                fractions.append(hidden_fraction(comm, compute))
                comm_ms.append(busy(comm))
                compute_ms.append(busy(compute))
            timelines[mode] = (compute, comm, trace)
            record["modes"][mode] = _summary(fractions, comm_ms, compute_ms, compute, comm)
        record["torch"] = torch.__version__
    else:
        for _ in range(args.warmup):
            step(x, y).item()
        fractions, comm_ms, compute_ms = [], [], []
        for _ in range(args.steps):
            compute, comm = cpu_step_timeline(model, ddp, opt, x, y)
            fractions.append(hidden_fraction(comm, compute))
            comm_ms.append(busy(comm))
            compute_ms.append(busy(compute))
        timelines["eager"] = (compute, comm, None)
        record["modes"]["eager"] = _summary(fractions, comm_ms, compute_ms, compute, comm)
    record["buckets"] = len(ddp.buckets)
    if world.rank == 0:
        write(record, timelines, args)


def _summary(fractions, comm_ms, compute_ms, compute, comm) -> dict:
    """The figures of one mode; compute and comm: the last step's intervals."""
    known = [f for f in fractions if f is not None]
    end = max(e for _, e in compute)
    return {"hidden_fraction": float(np.median(known)) if known else None, "hidden_fraction_per_step": fractions,
            "communication_ms_per_step": comm_ms, "compute_ms_per_step": compute_ms,
            "communication_intervals_last_step": len(comm),
            # the collectives that began before the last compute ended (Algorithm 1: as gradients come)
            "started_during_compute_last_step": sum(s < end for s, _ in comm)}


def write(record: dict, timelines: dict, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    record.update(run_fields(args.device))
    date = record["date"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"overlap-{date}-w{record['world_size']}-{args.device}"
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 2.2 * len(timelines)), squeeze=False)
    for ax, (mode, (compute, comm, trace)) in zip(axes[:, 0], timelines.items()):
        ax.broken_barh([(s, e - s) for s, e in merged(compute)], (10, 8), color="tab:blue")
        lane = 8 / max(len(comm), 1)  # each collective in its own lane: several may be in flight at once
        for i, (s, e) in enumerate(comm):
            ax.broken_barh([(s, e - s)], (i * lane, lane), color="tab:orange")
        ax.set_yticks([4, 14], ["communication" if args.device == "cuda" else "collectives (MPI)",
                                "compute stream" if args.device == "cuda" else "backward (host)"])
        fraction = record["modes"][mode]["hidden_fraction"]
        ax.set_title(f"kiln DDP, {mode}, W={record['world_size']} {args.device} {args.mode}: "
                     f"{'-' if fraction is None else f'{100 * fraction:.1f}%'} of communication time "
                     f"under compute (median of {args.steps} steps)", fontsize=9)
        ax.set_xlabel("ms from the step's first kernel" if args.device == "cuda" else "ms from backward's start")
        if trace is not None:
            (out / f"{name}-{mode}.trace.json").write_text(trace)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    lines = [f"# DDP overlap, W={record['world_size']} {args.device} {args.mode}, "
             f"B{args.batch_size} T{args.seq_len}, {record['buckets']} buckets of <= {args.bucket_mb:g} MB", "",
             "| mode | hidden fraction (median) | communication ms/step | compute ms/step |", "|---|---|---|---|"]
    for mode, m in record["modes"].items():
        f = m["hidden_fraction"]
        lines.append(f"| {mode} | {'-' if f is None else f'{100 * f:.1f}%'} | "
                     f"{np.median(m['communication_ms_per_step']):.3f} | {np.median(m['compute_ms_per_step']):.3f} |")
    lines += ["", f"![timelines]({name}.png)"]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
