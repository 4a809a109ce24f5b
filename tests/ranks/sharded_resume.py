"""One leg of a resharded run: load the checkpoint the previous leg saved (any world size and
strategy), train STEPS more AdamW steps with this world size and strategy, save. argv: folder,
leg index, strategy, total legs. The last leg (on one rank) also trains one process from the
same start for every leg's steps and reports the largest parameter and moment differences."""

import sys
from pathlib import Path

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.distributed.checkpoint import load_sharded, save_sharded
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups

folder, leg, strategy, legs = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
STEPS, ROWS, T = 2, 8, 16
cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32)
world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank
rng = np.random.default_rng(11)
data = [(rng.integers(0, 64, (ROWS, T)), rng.integers(0, 64, (ROWS, T))) for _ in range(STEPS * legs)]


def build(strategy):
    model = GPT(cfg, generator=kiln.Generator(0))
    model.to(dtype="float64")
    adamw = AdamW(gpt_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    if strategy == "ddp":
        return model, adamw, dist.DistributedDataParallel(model, bucket_cap_mb=0.002), adamw
    if strategy == "fsdp":
        w = dist.FullyShardedDataParallel(model, adamw)
    elif strategy == "none":
        return model, adamw, None, adamw
    else:
        w = dist.ZeroDataParallel(model, adamw, stage=int(strategy[-1]), bucket_cap_mb=0.002)
    return model, adamw, w, w.optimizer


def train(model, wrapper, opt, steps, rows):
    for x, y in steps:
        opt.zero_grad()
        model(kiln.tensor(x[rows]), kiln.tensor(y[rows]))[1].backward()
        if wrapper is not None:
            wrapper.wait_gradients()
        opt.clip_grad_norm_(0.5)
        opt.step()


model, adamw, wrapper, opt = build(strategy)
if leg > 0:
    state = load_sharded(folder / f"ckpt-{leg:08d}.kiln", model, adamw, wrapper)
    assert state["leg"] == leg - 1
per = ROWS // W
train(model, wrapper, opt, data[leg * STEPS:(leg + 1) * STEPS], slice(r * per, (r + 1) * per))
save_sharded(folder / f"ckpt-{leg + 1:08d}.kiln", model, adamw, wrapper, state={"leg": leg})
result = {"world": W}
if leg == legs - 1:
    assert W == 1
    ref, ref_adamw, _, _ = build("none")
    train(ref, None, ref_adamw, data, slice(None))
    got = wrapper.full_parameters() if strategy == "fsdp" else {n: p.numpy() for n, p in model.named_parameters()}
    result["max_param_diff"] = max(float(np.max(np.abs(got[n] - p.numpy()))) for n, p in ref.named_parameters())
    # the moments, through a one-process reload of the checkpoint this leg just saved
    plain, plain_adamw, _, _ = build("none")
    load_sharded(folder / f"ckpt-{legs:08d}.kiln", plain, plain_adamw, None)
    result["max_moment_diff"] = max(float(np.max(np.abs(a - b))) for k in ("exp_avg", "exp_avg_sq")
                                    for a, b in zip(plain_adamw.state_dict()[k], ref_adamw.state_dict()[k]))
    result["reloaded_param_diff"] = max(float(np.max(np.abs(got[n] - p.numpy())))
                                        for n, p in plain.named_parameters())
    result["step"] = plain_adamw.step_count
write_result(r, result)
