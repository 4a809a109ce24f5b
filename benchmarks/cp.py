"""Context-parallel causal attention: kiln's three transports beside PyTorch's `context_parallel`, in one call.

    mpiexec -n W python benchmarks/cp.py [--seq-lens 16384,65536] [--transports p2p,all_gather,all_to_all]
    torchrun --nproc-per-node W benchmarks/cp.py ...          (either launcher; W GPUs, one per rank)

Per sequence length T and transport (the paper's rotator comparison, Figure 39, as a table):
median milliseconds of one forward + backward of attention over the sequence sharded across the
W ranks (zigzag load balance; B x H x T x D, bf16 by default), tokens/s (B * T over that time),
kiln's peak allocated memory per rank, and the largest difference of kiln's output from PyTorch
SDPA on the whole sequence (rows of this rank). PyTorch runs SDPA under
torch.distributed.tensor.experimental.context_parallel with its allgather and alltoall rotate
methods. Rank 0 writes benchmarks/results/cp/cp-<date>.json. At W=1 on one GPU it exercises the
code paths (every block is the diagonal one); on the GPU kiln's p2p and all_gather transports
need a non-causal attention kernel for the off-diagonal blocks at W > 1, which kiln does not have
yet: those rows report the NotBuiltError instead of a time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np
from result_file import commit, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def median_ms(fn, iters, sync):
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times))


def inputs(args, t, dtype):
    """q, k, v, g [B, H, T, D] of the whole sequence (every rank draws the same)."""
    import ml_dtypes
    rng = np.random.default_rng(t)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return [rng.standard_normal((args.batch_size, args.heads, t, args.head_dim)).astype(np_dtype) for _ in range(4)]


def run_kiln(args, world, t, transport, full, want):
    import kiln
    from kiln.distributed.context_parallel import (
        context_parallel_attention,
        shard_sequence,
    )
    from kiln.errors import NotBuiltError
    dev = kiln.device(args.device)
    backend = dev.backend
    r, w = world.rank, world.size
    mine = [kiln.tensor(shard_sequence(a, r, w, True, axis=2), device=dev) for a in full]
    q, k, v = (a.requires_grad_() for a in mine[:3])

    def step():
        y = context_parallel_attention(q, k, v, world, transport, zigzag=True)
        y.backward(mine[3])
        return y

    try:
        out = step().numpy().astype(np.float64)
        ms = median_ms(step, args.iters, backend.synchronize)
    except NotBuiltError as e:
        return {"error": str(e)}
    diff = float(np.max(np.abs(out - shard_sequence(want, r, w, True, axis=2)))) if want is not None else None
    return {"ms": ms, "tokens_per_s": args.batch_size * t / (ms / 1000),
            "peak_bytes": backend.memory_stats().get("peak_allocated_bytes"), "out_diff_vs_sdpa": diff}


def run_torch(args, t, method, full):
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn import functional as F
    cuda = args.device.startswith("cuda")
    dev = torch.device(args.device if cuda else "cpu")
    mesh = init_device_mesh(dev.type, (tdist.get_world_size(),))
    set_rotate_method(method)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else getattr(torch, args.dtype)

    def step():
        q, k, v, g = (torch.from_numpy(a.astype(np.float32)).to(dev, dtype) for a in full)
        with context_parallel(mesh, buffers=[q, k, v, g], buffer_seq_dims=[2, 2, 2, 2]):  # shards them in place
            q, k, v = (a.detach().requires_grad_() for a in (q, k, v))  # the buffers are resized back at exit
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    try:
        ms = median_ms(step, args.iters, torch.cuda.synchronize if cuda else (lambda: None))
    except (RuntimeError, NotImplementedError) as e:  # a PyTorch build or device without this path: why
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ms": ms, "tokens_per_s": args.batch_size * t / (ms / 1000),
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def reference(args, full):
    """PyTorch SDPA on the whole sequence, float32 out (the fidelity reference)."""
    import torch
    from torch.nn import functional as F
    dev = torch.device(args.device if args.device.startswith("cuda") else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else getattr(torch, args.dtype)
    q, k, v = (torch.from_numpy(a.astype(np.float32)).to(dev, dtype) for a in full[:3])
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().cpu().numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="16384,65536")
    p.add_argument("--transports", default="p2p,all_gather,all_to_all")
    p.add_argument("--torch-methods", default="allgather,alltoall", help="PyTorch's rotate methods")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-reference", action="store_true", help="skip the whole-sequence SDPA (memory)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch.distributed as tdist

    import kiln.distributed as dist
    env = dist.detect()
    cuda = args.device.startswith("cuda")
    if cuda:
        args.device = f"cuda:{env.local_rank}"
    world = dist.init_process_group("nccl" if cuda else "mpi")  # from the launcher's own variables (mpiexec's)
    for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29534)):
        os.environ.setdefault(key, str(value))  # then torch's, from them
    tdist.init_process_group("nccl" if cuda else "gloo", rank=env.rank, world_size=env.world_size)
    rows = []
    for t in [int(s) for s in args.seq_lens.split(",")]:
        full = inputs(args, t, args.dtype)
        want = None if args.no_reference else reference(args, full)
        for transport in args.transports.split(","):
            rows.append({"framework": "kiln", "T": t, "transport": transport,
                         **run_kiln(args, world, t, transport, full, want)})
        for method in args.torch_methods.split(","):
            rows.append({"framework": "torch", "T": t, "transport": method, **run_torch(args, t, method, full)})
    if env.rank == 0:
        print(f"{'framework':9s} {'T':>7s} {'transport':11s} {'ms':>9s} {'tokens/s':>11s} {'peak B':>13s}  out diff")
        for row in rows:
            if "error" in row:
                print(f"{row['framework']:9s} {row['T']:7d} {row['transport']:11s} {row['error'][:90]}")
                continue
            print(f"{row['framework']:9s} {row['T']:7d} {row['transport']:11s} {row['ms']:9.2f} "
                  f"{row['tokens_per_s']:11.0f} {row['peak_bytes']!s:>13s}  {row.get('out_diff_vs_sdpa')}")
        result = {"benchmark": "cp", "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(),
                  "world_size": env.world_size, "device": args.device, "command": " ".join(sys.argv),
                  "args": vars(args), "rows": rows}
        write_json(result, Path(args.out) if args.out else
                   ROOT / "benchmarks" / "results" / "cp" / f"cp-{datetime.date.today()}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
