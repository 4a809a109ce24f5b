"""DP x TP x CP on one DeviceMesh: 5 AdamW steps of a GPT equal one process on the whole batch.

argv: dp tp cp transport chunks out_dir. Every rank also trains the single-process reference
(same seed, whole batch) and reports the largest difference of the dense parameters (TP shards
gathered) after the steps, of each step's loss (the mean over the dp x cp ranks) and of its gradient norm
(clipped at 0.5 on both sides). Then the
run's dense state is loaded into another layout (cp over the whole world, Ulysses where the heads allow) whose loss on a
fresh batch must equal the reference's, and rank 0 saves it as a kiln checkpoint for one process."""

import sys

import numpy as np
from mesh_reference import CLIP, STEPS, batches, cfg, gpt, optimizer
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.checkpoint import save
from kiln.distributed.model_parallel import ModelParallel

dp, tp, cp, transport, chunks, out_dir = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                          int(sys.argv[5]), sys.argv[6])
world = dist.init_process_group("mpi", timeout=60)
W, r = world.size, world.rank


data = batches()
ref = gpt()
ref_opt = optimizer(ref)
ref_losses, ref_norms, norms = [], [], []
for x, y in data[:STEPS]:
    ref_opt.zero_grad()
    loss = ref(kiln.tensor(x), kiln.tensor(y))[1]
    loss.backward()
    ref_losses.append(loss.item())
    ref_norms.append(ref_opt.clip_grad_norm_(CLIP).item())
    ref_opt.step()

mesh = dist.DeviceMesh({"dp": dp, "cp": cp, "tp": tp})  # tp fastest: neighbours, as Megatron places it
run = ModelParallel(gpt(), mesh, chunks=chunks, transport=transport)
opt = optimizer(run.model)
losses = []
for x, y in data[:STEPS]:
    opt.zero_grad()
    idx, tgt, pos = run.batch(x, y)
    loss = run.model(idx, tgt, pos)[1]
    loss.backward()
    run.wait_gradients()
    norms.append(opt.clip_grad_norm_(CLIP, run.grad_norm()).item())
    opt.step()
    mean = kiln.tensor(np.array([loss.item()]))
    world.all_reduce(mean, "avg")  # the tp ranks hold the same loss: the world's mean is the dp x cp one
    losses.append(float(mean.item()))
state = run.dense_state_dict()
param_diff = max(float(np.max(np.abs(state[n] - p.numpy()))) for n, p in ref.named_parameters())

# the checkpoint in another layout: the whole world one cp group (Ulysses), a fresh batch
x, y = data[STEPS]
ulysses = cfg.n_head % W == 0  # all-to-all splits the heads over the ranks
other = ModelParallel(gpt(state), dist.DeviceMesh({"cp": W}), transport="all_to_all" if ulysses else "p2p")
idx, tgt, pos = other.batch(x, y)
mean = kiln.tensor(np.array([other.model(idx, tgt, pos)[1].item()]))
world.all_reduce(mean, "avg")
ref_eval = ref(kiln.tensor(x), kiln.tensor(y))[1].item()
if r == 0:
    save(f"{out_dir}/mesh.kiln", {"model": state, "eval_loss": ref_eval})
write_result(r, {"param_diff": param_diff, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                 "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)), "ref_norms": ref_norms,
                 "other_layout_loss_diff": abs(float(mean.item()) - ref_eval),
                 "moved": max(float(np.max(np.abs(state[n] - p.numpy()))) for n, p in gpt().named_parameters()),
                 "coordinate": run.coordinate, "grad_group": run.grad_group.size})
