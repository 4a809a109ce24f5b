"""DDP on W ranks, each with its slice of every micro-batch, against one process on the whole batch.

argv: dtype accum bucket_mb clip. Every rank runs the single-process reference itself (same seed,
whole batch) and reports the largest parameter difference after 5 AdamW steps, the grad norms of
both, and how many all-reduces each step launched (Algorithm 1: one per bucket on the last
micro-step, none on accumulation micro-steps)."""

import contextlib
import sys

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups

dtype, accum, bucket_mb, clip = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
STEPS, ROWS, T = 5, 8, 16
cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32)


def model_and_optimizer(seed):
    model = GPT(cfg, generator=kiln.Generator(seed))
    model.to(dtype=dtype)
    return model, AdamW(gpt_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))


def batches():
    rng = np.random.default_rng(7)
    return [[(rng.integers(0, 64, (ROWS, T)), rng.integers(0, 64, (ROWS, T))) for _ in range(accum)]
            for _ in range(STEPS)]


def train(model, opt, data, rows, ddp=None):
    norms = []
    for step in data:
        opt.zero_grad()
        for m, (x, y) in enumerate(step):
            last = m == accum - 1
            with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():
                _, loss = model(kiln.tensor(x[rows]), kiln.tensor(y[rows]))
                (loss / accum).backward()
        if ddp is not None:
            ddp.wait_gradients()
        norms.append(opt.clip_grad_norm_(clip).item() if clip > 0 else None)
        opt.step()
    return norms


world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank
data = batches()
ref, ref_opt = model_and_optimizer(0)
start = [p.numpy().copy() for p in ref.parameters()]
ref_norms = train(ref, ref_opt, data, slice(None))

model, opt = model_and_optimizer(0 if r == 0 else 1000 + r)  # other ranks start elsewhere: the broadcast fixes it
start_diff = max(float(np.max(np.abs(p.numpy() - q))) for p, q in zip(model.parameters(), start))
launches = []
count = world.reduce_scatter_all_gather  # DDP's all-reduce of a bucket


def counting_all_reduce(*args, **kwargs):
    launches[-1] += 1
    return count(*args, **kwargs)


ddp = dist.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
world.reduce_scatter_all_gather = counting_all_reduce
n_buckets = len(ddp.buckets)
per = ROWS // W
norms = []
for step in data:  # one step at a time, to count each step's all-reduces
    launches.append(0)
    norms += train(model, opt, [step], slice(r * per, (r + 1) * per), ddp)
diff = max(float(np.max(np.abs(p.numpy() - q.numpy()))) for p, q in zip(model.parameters(), ref.parameters()))
write_result(r, {"max_param_diff": diff, "norms": norms, "ref_norms": ref_norms, "launches": launches,
                 "buckets": n_buckets, "buckets_after": len(ddp.buckets), "start_diff": start_diff})
