"""Tensor-parallel GPT-2 training steps: kiln (plain and async TP) beside PyTorch DTensor TP, in one call.

    mpiexec -n W python benchmarks/tp.py [--preset gpt2-124m] [--chunks 1,2,4] [--steps 20]
    torchrun --nproc-per-node W benchmarks/tp.py ...          (either launcher; W GPUs, one per rank)

Every rank holds a 1/W shard of each block (paper §4.2); kiln runs once per async-TP chunk count N
(N=1 is plain TP). PyTorch runs the same nanoGPT-style GPT under parallelize_module, every
parameter a DTensor: the blocks' Linears ColwiseParallel/RowwiseParallel, the embedding and the
tied head split over the vocabulary with loss_parallel (as kiln's), LayerNorms and position
embeddings replicated DTensors, so fused AdamW and clip_grad_norm_ take them all. --torch-sp adds
sequence parallelism (LayerNorms on T/W tokens, each all-reduce an all-gather + reduce-scatter);
--torch-async is PyTorch's async TP: that, compiled with inductor's micro-pipeline TP, which
overlaps those all-gather / reduce-scatter matmuls (CUDA only: symmetric memory). Same initial weights,
same batches, AdamW, fp32 or bf16. Reports tokens/s (median over the steps after the first 3),
peak memory per rank and the largest per-step loss and gradient-norm differences from PyTorch
(the norm before the clip at 1.0). Rank 0 writes
benchmarks/results/tp/tp-<date>.json. At W=1 on one GPU it exercises the NCCL code paths; --device
cpu runs over MPI (kiln) and gloo (PyTorch) in fp32 (tests/test_tensor_parallel.py runs it on 2 ranks).
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
WARMUP = 3


def batches(args, vocab):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, vocab, (args.batch_size, args.seq_len)), rng.integers(0, vocab, (args.batch_size, args.seq_len)))
            for _ in range(args.steps)]


def run_kiln(args, cfg, data, chunks):
    import kiln
    import kiln.distributed as dist
    from kiln.distributed.model_parallel import ModelParallel
    from kiln.nn import GPT
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision
    dev = kiln.device(args.device)
    world = dist.get_world()
    model = GPT(cfg, generator=kiln.Generator(1234)).to(dev)
    apply_precision(model, args.precision, dev)
    run = ModelParallel(model, dist.DeviceMesh({"tp": world.size}), chunks=chunks)
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95))
    losses, norms, times = [], [], []
    for i, (x, y) in enumerate(data):
        if i == 1:
            dev.backend.end_warmup()
        t0 = time.perf_counter()
        opt.zero_grad()
        _, loss = model(kiln.tensor(x, device=dev), kiln.tensor(y, device=dev))
        loss.backward()
        norms.append(opt.clip_grad_norm_(1.0, run.grad_norm()))  # fused into the step, no host sync
        opt.step()
        losses.append(loss.item())  # the host sync that ends the step
        times.append(time.perf_counter() - t0)
    peak = dev.backend.memory_stats().get("peak_allocated_bytes")
    return losses, [n.item() for n in norms], times, peak


def run_torch(args, cfg, data, kiln_state):
    """PyTorch's own TP of the same GPT, every parameter a DTensor (so fused AdamW and
    clip_grad_norm_ take them all): the blocks' Linears Colwise/Rowwise, the embedding and the tied
    head vocabulary-parallel with loss_parallel (the logits never gathered, as kiln's), LayerNorms and
    position embeddings replicated DTensors. With sequence parallelism (--torch-sp, --torch-async)
    the residual stream and the LayerNorms hold T/W tokens per rank (SequenceParallel) and each
    all-reduce is an all-gather before the column-parallel Linear and a reduce-scatter after the
    row-parallel one: the pattern inductor's micro-pipeline TP overlaps."""
    import torch
    import torch.distributed as tdist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )
    from torch.nn import functional as F
    cuda = args.device.startswith("cuda")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    h = cfg.n_head // world

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            c = cfg.n_embd
            self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
            self.attn = nn.ModuleDict({"c_attn": nn.Linear(c, 3 * c), "c_proj": nn.Linear(c, c)})
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(c, 4 * c), "c_proj": nn.Linear(4 * c, c)})

        def forward(self, x):
            b, t, _ = x.shape
            qkv = self.attn["c_attn"](self.ln_1(x))  # local: this rank's heads of q, k and v
            q, k, v = qkv.view(b, t, 3, h, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + self.attn["c_proj"](y)
            return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))  # GPT-2's, kiln's

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
            self.h = nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            # the tied head on the vocabulary shard: logits Shard(-1); from_local's backward is Megatron's f
            x = self.ln_f(x)
            x = x.redistribute(mesh, [Replicate()]) if sp else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            logits = F.linear(x, self.wte.weight)
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    model = Model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.ascontiguousarray(kiln_state[name])))
    model.to(dev)
    mesh = init_device_mesh(dev.type, (world,))
    sp = args.torch_sp or args.torch_async
    tokens = Shard(1) if sp else Replicate()  # the residual stream's layout between the parallel Linears
    # c_attn's rows are q|k|v: sharding them in W contiguous pieces gives each rank whole heads only
    # after interleaving, so the rows are reordered (q_r, k_r, v_r per rank) before the split
    for block in model.h:
        w, b = block.attn["c_attn"].weight.data, block.attn["c_attn"].bias.data
        for t in (w, b):
            parts = [p.chunk(world) for p in t.chunk(3)]
            t.copy_(torch.cat([parts[s][r] for r in range(world) for s in range(3)]))
        plan = {name: ColwiseParallel(input_layouts=tokens) for name in ("attn.c_attn", "mlp.c_fc")}
        plan.update({name: RowwiseParallel(output_layouts=tokens, use_local_output=not sp)
                     for name in ("attn.c_proj", "mlp.c_proj")})
        plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel()} if sp else {})
        parallelize_module(block, mesh, plan)
    parallelize_module(model, mesh, {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens,
                                                            use_local_output=not sp),  # vocabulary rows split
                                     **({"ln_f": SequenceParallel()} if sp else {})})
    replicated = [model.wpe] if sp else [model.wpe, model.ln_f] + [m for b in model.h for m in (b.ln_1, b.ln_2)]
    for module in replicated:  # Replicate DTensors; with sp, wpe's rows join the Shard(1) stream as a DTensor
        distribute_module(module, mesh, input_fn=_replicated_input(mesh), output_fn=None if sp else _local_output)
    fwd = torch.compile(model) if args.torch_async else model
    if args.torch_async:
        import torch._inductor.config as inductor
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        inductor._micro_pipeline_tp = True
        enable_symm_mem_for_group(mesh.get_group().group_name)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    losses, norms, times = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for x, y in data:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with loss_parallel(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = fwd(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev))
            loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True))
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    norms = [(n.full_tensor() if isinstance(n, DTensor) else n).item() for n in norms]
    return losses, norms, times, torch.cuda.max_memory_allocated() if cuda else None


def _replicated_input(mesh):
    from torch.distributed.tensor import DTensor, Replicate

    def input_fn(module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)
    return input_fn


def _local_output(module, output, device_mesh):
    return output.to_local()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chunks", default="1,2,4", help="kiln's async-TP chunk counts (1: plain TP)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--torch-sp", action="store_true", help="PyTorch's TP with sequence parallelism (eager)")
    p.add_argument("--torch-async", action="store_true",
                   help="PyTorch's async TP: sequence parallelism, compiled with inductor's micro-pipeline TP")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import kiln
    from kiln.distributed import detect, init_process_group
    from kiln.nn import GPT, preset
    env = detect()
    init_process_group("nccl" if args.device.startswith("cuda") else "mpi")  # from the launcher's own variables
    os.environ.setdefault("RANK", str(env.rank))  # then torch's, from them
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device.startswith("cuda"):
        args.device = f"cuda:{env.local_rank}"
    cfg = preset(args.preset)
    data = batches(args, cfg.vocab_size)
    state = {n: p.numpy() for n, p in GPT(cfg, generator=kiln.Generator(1234)).named_parameters()}
    rows = []
    torch_losses, torch_norms, torch_times, torch_peak = run_torch(args, cfg, data, state)
    tokens = args.batch_size * args.seq_len
    for chunks in [int(c) for c in args.chunks.split(",")]:
        losses, norms, times, peak = run_kiln(args, cfg, data, chunks)
        rows.append({"framework": "kiln", "chunks": chunks, "tokens_per_s": tokens / float(np.median(times[WARMUP:])),
                     "peak_bytes": peak, "loss_diff": max(abs(a - b) for a, b in zip(losses, torch_losses)),
                     "grad_norm_diff": max(abs(a - b) for a, b in zip(norms, torch_norms))})
    rows.append({"framework": "torch-async" if args.torch_async else "torch-sp" if args.torch_sp else "torch",
                 "chunks": None,
                 "tokens_per_s": tokens / float(np.median(torch_times[WARMUP:])), "peak_bytes": torch_peak,
                 "loss_diff": 0.0, "grad_norm_diff": 0.0, "grad_norms": torch_norms})
    if env.rank == 0:
        for row in rows:
            print(f"{row['framework']:12s} N={row['chunks']!s:5s} {row['tokens_per_s']:12.0f} tok/s  "
                  f"peak {row['peak_bytes']!s:>12s} B  loss diff {row['loss_diff']:.2e}  "
                  f"grad norm diff {row['grad_norm_diff']:.2e}")
        result = {"benchmark": "tp", "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(),
                  "world_size": env.world_size, "device": args.device, "command": " ".join(sys.argv),
                  "args": vars(args), "rows": rows}
        write_json(result, Path(args.out) if args.out else
                   ROOT / "benchmarks" / "results" / "tp" / f"tp-{datetime.date.today()}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
