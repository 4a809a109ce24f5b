"""ZeRO-1, ZeRO-2 and FSDP on W ranks against DDP on the same ranks (itself proven equal to one
process by ddp_equal.py): 5 AdamW steps with accumulation and clipping, each rank with its slice of
every micro-batch. argv: dtype accum clip (0: none) bucket_mb. The result holds, per strategy, the largest
parameter difference from DDP, the grad norms, and the model state bytes each rank held."""

import contextlib
import sys

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups

dtype, accum, clip, bucket_mb = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
STEPS, ROWS, T = 5, 8, 16
cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32)
world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank
rng = np.random.default_rng(7)
data = [[(rng.integers(0, 64, (ROWS, T)), rng.integers(0, 64, (ROWS, T))) for _ in range(accum)]
        for _ in range(STEPS)]
rows = slice(r * (ROWS // W), (r + 1) * (ROWS // W))


def run(strategy):
    model = GPT(cfg, generator=kiln.Generator(0 if r == 0 else 1000 + r))  # the wrapper broadcasts rank 0's
    model.to(dtype=dtype)
    adamw = AdamW(gpt_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    if strategy == "ddp":
        wrapper, opt = dist.DistributedDataParallel(model, bucket_cap_mb=bucket_mb), adamw
    elif strategy == "fsdp":
        wrapper = dist.FullyShardedDataParallel(model, adamw)
        opt = wrapper.optimizer
    else:
        wrapper = dist.ZeroDataParallel(model, adamw, stage=int(strategy[-1]), bucket_cap_mb=bucket_mb)
        opt = wrapper.optimizer
    norms = []
    for step in data:
        opt.zero_grad()
        for m, (x, y) in enumerate(step):
            with contextlib.nullcontext() if m == accum - 1 else wrapper.no_sync():
                _, loss = model(kiln.tensor(x[rows]), kiln.tensor(y[rows]))
                (loss / accum).backward()
        wrapper.wait_gradients()
        if clip > 0:
            norms.append(opt.clip_grad_norm_(clip).item())
        opt.step()
    if strategy == "fsdp":
        params = wrapper.full_parameters()
    else:
        params = {n: p.numpy().copy() for n, p in model.named_parameters()}
    return params, norms, (wrapper.memory() if strategy != "ddp" else None)


ref, ref_norms, _ = run("ddp")
result = {"ref_norms": ref_norms}
for strategy in ("zero1", "zero2", "fsdp"):
    params, norms, memory = run(strategy)
    diff = max(float(np.max(np.abs(params[n] - ref[n]))) for n in ref)
    result[strategy] = {"max_param_diff": diff, "norms": norms, "memory": memory}
write_result(r, result)
