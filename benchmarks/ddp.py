"""Data-parallel GPT-2 training, kiln DDP (Algorithm 1) beside PyTorch DDP, at any world size.

    mpiexec -n W python benchmarks/ddp.py                  # or: torchrun --nproc-per-node W ...
    python benchmarks/ddp.py                               # world size 1, one GPU
    mpiexec -n 2 python benchmarks/ddp.py --device cpu --mode fp32 --n-layer 2 --n-embd 128 --n-head 4 --seq-len 128 \
        --batch-size 4 --sizes-mb 1,5 --steps 8 --warmup 3  # a CPU smoke run (MPI / gloo)

Three parts, every rank running this file:
1. all-reduce (avg) latency per bucket size, the paper's Figure 35 sweep (5 to 100 MB, Appendix
   B.11): kiln's process group (NCCL on GPUs, MPI on the CPU) and torch.distributed (NCCL/gloo);
   median ms over --iters, algorithm and bus bandwidth (busbw = algbw x 2(W-1)/W, as nccl-tests).
2. tokens/s per GPU of one training step: rank 0 alone with no communication (the baseline on
   this machine), then all W ranks with DDP, for kiln and for torch; scaling efficiency = DDP
   tokens/s per GPU / the lone rank's. Same model (GPT-2 124M by default), same batch per rank,
   same initial weights, AdamW (fused in torch), clip 1.0; kiln replays its step as a CUDA graph
   from the third step (--no-cuda-graph: op by op); torch runs eager with --mode's autocast.
3. peak memory per rank (each framework's allocator).
4. with --strategies, the same step sharded: kiln ZeRO-1, ZeRO-2 and FSDP (ZeRO-3) beside PyTorch's
   ZeroRedundancyOptimizer over DDP (ZeRO-1) and FSDP2 (fully_shard); tokens/s and peak memory
   per rank. PyTorch has no ZeRO-2 of its own (its column is empty). FSDP2 shards the benchmark's
   functional GPT-2 module as one unit (it has no per-block modules); kiln's FSDP gathers per
   block's attention and MLP. kiln's sharded steps replay as a CUDA graph too (--no-cuda-graph: op by op).
The overlap of the buckets' all-reduces with backward is benchmarks/ddp_overlap.py's (a profiler
trace and its figure).
Rank 0 prints a table and writes benchmarks/results/ddp/ddp-<date>-w<W>-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from result_file import run_fields

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (MPI / gloo)")
    ap.add_argument("--mode", default="bf16", help="fp32 or bf16 (kiln's precision, torch's autocast)")
    ap.add_argument("--sizes-mb", default="5,10,25,50,100")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--frameworks", default="kiln,torch")
    ap.add_argument("--strategies", default="zero1,zero2,fsdp", help="sharded strategies to time after DDP "
                    "('' for none)")
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ddp"))
    return ap.parse_args()


# ---------------------------------------------------------------------- kiln
def kiln_world(args):
    import kiln.distributed as dist
    return dist.init_process_group("nccl" if args.device == "cuda" else "mpi")


def sync(args):
    import kiln
    kiln.device(args.device).backend.synchronize()


def kiln_all_reduce_ms(world, args, nbytes: int) -> float:
    import kiln
    t = kiln.tensor(np.random.default_rng(world.rank).standard_normal(nbytes // 4).astype(np.float32),
                    device=args.device)
    times = []
    for i in range(args.iters + 3):
        sync(args)
        t0 = time.perf_counter()
        world.all_reduce(t, "avg")
        sync(args)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def kiln_model(args):
    import kiln
    from kiln.nn import GPT, preset
    cfg = preset("gpt2-124m", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                 block_size=max(args.seq_len, 64))
    return GPT(cfg, generator=kiln.Generator(1234)), cfg


def kiln_train(world, args, batches, ddp_on: bool, strategy: str = "ddp") -> dict:
    """tokens/s of this rank over the timed steps, and its peak memory (strategy: ddp, zero1,
    zero2 or fsdp when ddp_on)."""
    import kiln
    import kiln.distributed as dist
    from kiln.graph import CapturedStep
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision
    dev = kiln.device(args.device)
    model, _ = kiln_model(args)
    model.to(dev)
    apply_precision(model, args.mode, dev)
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    ddp = None
    if ddp_on and strategy == "ddp":
        ddp = dist.DistributedDataParallel(model, world, bucket_cap_mb=args.bucket_mb)
    elif ddp_on and strategy == "fsdp":
        ddp = dist.FullyShardedDataParallel(model, opt, group=world)
    elif ddp_on:
        ddp = dist.ZeroDataParallel(model, opt, stage=int(strategy[-1]), group=world, bucket_cap_mb=args.bucket_mb)
    if ddp is not None and strategy != "ddp":
        opt = ddp.optimizer

    def step(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if ddp is not None:
            ddp.wait_gradients()
        opt.clip_grad_norm_(1.0)
        opt.step()
        return loss

    graph = CapturedStep(step) if args.cuda_graph and args.device == "cuda" else None
    times, losses = [], []
    for i, (x, y) in enumerate(batches):
        if i == 1:
            dev.backend.end_warmup()
        t0 = time.perf_counter()
        xs, ys = kiln.tensor(x, device=dev), kiln.tensor(y, device=dev)
        loss = graph(xs, ys) if graph is not None and i >= 2 else step(xs, ys)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    peak = dev.backend.memory_stats().get("peak_allocated_bytes", 0)
    return {"tokens_per_s": args.batch_size * args.seq_len / float(np.median(times[args.warmup:])),
            "peak_gib": peak / 2**30, "losses": losses}


# ---------------------------------------------------------------------- torch
def torch_world(env, args):
    import torch
    import torch.distributed as tdist
    if args.device == "cuda":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    tdist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                             init_method=f"tcp://{env.master_addr}:{env.master_port + 1}",
                             rank=env.rank, world_size=env.world_size)
    return tdist


def torch_all_reduce_ms(tdist, args, nbytes: int) -> float:
    import torch
    dev = "cuda" if args.device == "cuda" else "cpu"
    t = torch.randn(nbytes // 4, device=dev)
    op = tdist.ReduceOp.AVG if args.device == "cuda" else tdist.ReduceOp.SUM  # gloo has no AVG
    times = []
    for i in range(args.iters + 3):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tdist.all_reduce(t, op=op)
        if dev == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def torch_train(args, batches, ddp_on: bool, strategy: str = "ddp") -> dict:
    import torch

    from tests.torch_gpt import torch_gpt_forward, torch_params
    dev = "cuda" if args.device == "cuda" else "cpu"
    kmodel, cfg = kiln_model(args)

    class GPTModule(torch.nn.Module):  # torch DDP wants a Module: the same functional GPT-2
        def __init__(self):
            super().__init__()
            self.params = torch.nn.ParameterDict(
                {k.replace(".", "_"): torch.nn.Parameter(v.detach()) for k, v in torch_params(kmodel, torch.float32).items()})
            self.names = {k.replace(".", "_"): k for k in torch_params(kmodel, torch.float32)}

        def forward(self, x, y):
            return torch_gpt_forward({self.names[k]: v for k, v in self.params.items()}, cfg, x, y)[1]

    module = GPTModule().to(dev)
    if ddp_on and strategy == "fsdp":  # FSDP2: parameters become DTensor shards
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(module)
    elif ddp_on:
        model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=args.bucket_mb,
                                                          gradient_as_bucket_view=True)
    else:
        model = module
    plist = list(module.parameters())
    groups = [{"params": [p for p in plist if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in plist if p.ndim < 2], "weight_decay": 0.0}]
    adamw = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8, "fused": dev == "cuda"}
    if ddp_on and strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(plist, optimizer_class=torch.optim.AdamW, weight_decay=0.1, **adamw)
    else:
        opt = torch.optim.AdamW(groups, **adamw)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=args.mode == "bf16"):
            loss = model(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    return {"tokens_per_s": args.batch_size * args.seq_len / float(np.median(times[args.warmup:])),
            "peak_gib": peak / 2**30, "losses": losses}


# ---------------------------------------------------------------------- the run
def batches_for(rank: int, args):
    from kiln.data.corpus import bundled_dataset
    from kiln.data.loader import ShardLoader
    loader = ShardLoader(bundled_dataset(), "train", batch_size=args.batch_size, seq_len=args.seq_len,
                         rank=rank, world_size=max(rank + 1, 1))
    return [loader.next_batch() for _ in range(args.steps)]


def main() -> None:
    args = parse_args()
    import kiln.distributed as dist
    env = dist.detect()
    world = kiln_world(args)
    frameworks = args.frameworks.split(",")
    tdist = torch_world(env, args) if "torch" in frameworks else None
    W, rank = world.size, world.rank
    batches = batches_for(rank, args)
    record = {"benchmark": "ddp", "world_size": W, "device": args.device, "mode": args.mode,
              "batch_per_rank": [args.batch_size, args.seq_len], "n_layer": args.n_layer, "n_embd": args.n_embd,
              "bucket_mb": args.bucket_mb, "steps": args.steps, "warmup": args.warmup,
              "kiln_cuda_graph": args.cuda_graph, "all_reduce": [], "training": {}}
    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        nbytes = int(mb * 1e6) // 4 * 4
        row = {"size_mb": mb, "kiln_ms": kiln_all_reduce_ms(world, args, nbytes)}
        if tdist is not None:
            row["torch_ms"] = torch_all_reduce_ms(tdist, args, nbytes)
        for fw in ("kiln", "torch"):
            if f"{fw}_ms" in row:
                algbw = nbytes / (row[f"{fw}_ms"] / 1000) / 1e9
                row[f"{fw}_algbw_gbs"] = algbw
                row[f"{fw}_busbw_gbs"] = algbw * 2 * (W - 1) / W
        record["all_reduce"].append(row)
        if rank == 0:
            print(f"all-reduce {mb:6.1f} MB: kiln {row['kiln_ms']:8.3f} ms"
                  + (f", torch {row['torch_ms']:8.3f} ms" if "torch_ms" in row else ""), flush=True)
    for fw in frameworks:
        alone = None
        if rank == 0:  # the baseline: one rank, no communication, the same per-rank batch
            alone = kiln_train(world, args, batches, False) if fw == "kiln" else torch_train(args, batches, False)
        world.barrier()
        together = kiln_train(world, args, batches, True) if fw == "kiln" else torch_train(args, batches, True)
        per_rank = world.engine.exchange([together["tokens_per_s"], together["peak_gib"]])
        if rank == 0:
            tps = [p[0] for p in per_rank]
            record["training"][fw] = {
                "alone_tokens_per_s": alone["tokens_per_s"], "alone_peak_gib": alone["peak_gib"],
                "ddp_tokens_per_s_per_rank": tps, "ddp_tokens_per_s_total": float(sum(tps)),
                "ddp_peak_gib_per_rank": [p[1] for p in per_rank],
                "scaling_efficiency": float(np.mean(tps)) / alone["tokens_per_s"],
                "losses_rank0": together["losses"]}
            t = record["training"][fw]
            print(f"{fw:6} alone {t['alone_tokens_per_s']:10.0f} tok/s; DDP x{W}: {np.mean(tps):10.0f} tok/s per rank "
                  f"(efficiency {t['scaling_efficiency']:.3f}), peak {max(t['ddp_peak_gib_per_rank']):.2f} GiB",
                  flush=True)
    strategies = [s for s in args.strategies.split(",") if s]
    record["sharded"] = {}
    for fw in frameworks:
        for strategy in strategies:
            if fw == "torch" and strategy == "zero2":
                continue  # PyTorch has no ZeRO-2 of its own
            world.barrier()
            run = kiln_train(world, args, batches, True, strategy) if fw == "kiln" else \
                torch_train(args, batches, True, strategy)
            per_rank = world.engine.exchange([run["tokens_per_s"], run["peak_gib"]])
            if rank == 0:
                record["sharded"].setdefault(fw, {})[strategy] = {
                    "tokens_per_s_per_rank": [p[0] for p in per_rank], "peak_gib_per_rank": [p[1] for p in per_rank],
                    "losses_rank0": run["losses"]}
                print(f"{fw:6} {strategy:5} x{W}: {np.mean([p[0] for p in per_rank]):10.0f} tok/s per rank, "
                      f"peak {max(p[1] for p in per_rank):.2f} GiB", flush=True)
    if rank == 0:
        write(record, args)


def write(record: dict, args) -> None:
    record.update(run_fields(args.device))
    date = record["date"]
    with contextlib.suppress(ImportError):
        import torch
        record["torch"] = torch.__version__
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"ddp-{date}-w{record['world_size']}-{args.device}"
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    lines = ["| bucket MB | kiln ms | kiln busbw GB/s | torch ms | torch busbw GB/s |", "|---|---|---|---|---|"]
    for r in record["all_reduce"]:
        lines.append(f"| {r['size_mb']:g} | {r['kiln_ms']:.3f} | {r['kiln_busbw_gbs']:.1f} | "
                     f"{r.get('torch_ms', float('nan')):.3f} | {r.get('torch_busbw_gbs', float('nan')):.1f} |")
    lines += ["", "| framework | alone tok/s | DDP tok/s per rank | scaling efficiency | peak GiB per rank |",
              "|---|---|---|---|---|"]
    for fw, t in record["training"].items():
        lines.append(f"| {fw} | {t['alone_tokens_per_s']:.0f} | {np.mean(t['ddp_tokens_per_s_per_rank']):.0f} | "
                     f"{t['scaling_efficiency']:.3f} | {max(t['ddp_peak_gib_per_rank']):.2f} |")
    if record.get("sharded"):
        lines += ["", "| strategy | kiln tok/s per rank | kiln peak GiB per rank | torch tok/s per rank | "
                      "torch peak GiB per rank |", "|---|---|---|---|---|"]
        for strategy in ("zero1", "zero2", "fsdp"):
            cells = []
            for fw in ("kiln", "torch"):
                r = record["sharded"].get(fw, {}).get(strategy)
                cells += [f"{np.mean(r['tokens_per_s_per_rank']):.0f}", f"{max(r['peak_gib_per_rank']):.2f}"] \
                    if r else ["-", "-"]
            if any(c != "-" for c in cells):
                lines.append(f"| {strategy} | " + " | ".join(cells) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
