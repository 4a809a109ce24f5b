"""Model-state memory per rank of DDP, ZeRO-1, ZeRO-2 and FSDP, measured by the allocator: NumPy
reports every buffer to tracemalloc, so the bytes a rank holds after a step (the autograd graph
and activations gone) are the parameters, gradients and AdamW moments each strategy keeps.
Also the peak inside the third step, and each wrapper's own count (memory()). argv: n_layer."""

import gc
import sys
import tracemalloc

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW

world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank
# Parameters dominate: 2 rows of 4 tokens make activations tiny beside the weights
cfg = GPTConfig(vocab_size=64, block_size=4, n_layer=int(sys.argv[1]), n_head=2, n_embd=64)
rng = np.random.default_rng(3)
x, y = kiln.tensor(rng.integers(0, 64, (2, 4))), kiln.tensor(rng.integers(0, 64, (2, 4)))


def measure(strategy):
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    model = GPT(cfg, generator=kiln.Generator(0))
    model.to(dtype="float64")
    n = model.num_parameters()
    adamw = AdamW(model.parameters(), lr=1e-3)
    if strategy == "ddp":
        wrapper, opt = dist.DistributedDataParallel(model), adamw
    elif strategy == "fsdp":
        wrapper = dist.FullyShardedDataParallel(model, adamw)
        opt = wrapper.optimizer
    else:
        wrapper = dist.ZeroDataParallel(model, adamw, stage=int(strategy[-1]))
        opt = wrapper.optimizer
    counted = None
    for step in range(3):
        if step == 2:
            gc.collect()
            tracemalloc.reset_peak()
            before_step = tracemalloc.get_traced_memory()[0] - base
        opt.zero_grad()
        model(x, y)[1].backward()
        wrapper.wait_gradients()
        opt.step()
        if strategy != "ddp":
            counted = sum(wrapper.memory().values())
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    out = {"held": held - base, "peak": peak - base, "before_step": before_step, "counted": counted, "numel": n}
    del model, adamw, wrapper, opt
    return out


tracemalloc.start()
write_result(r, {s: measure(s) for s in ("ddp", "zero1", "zero2", "fsdp")})
