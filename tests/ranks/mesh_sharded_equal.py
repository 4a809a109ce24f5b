"""ZeRO-1, ZeRO-2 and FSDP on a dp x tp x cp mesh (sharding the tp/cp-local parameters over the dp x cp
ranks) against one process on the whole batch and against DDP on the same mesh: 5 AdamW steps with
the clip (float64). argv: dp tp cp.

Every rank trains the single-process reference (same seed, whole batch) for 6 steps, keeping its
state after 5. Per strategy the result holds the largest difference from the reference of the
dense parameters and AdamW moments after 5 steps (ModelParallel.dense_state: the dp x cp shards
gathered, then the tp shards), of each step's loss and clipped gradient norm, and of the dense
parameters from DDP's on this mesh; then that dense state is loaded into a fresh run of the next
strategy (load_dense_state), which takes step 6: its dense parameters against the reference's."""

import sys

import numpy as np
from mesh_reference import CLIP, STEPS, batches, gpt, optimizer
from rank_output import write_result

import kiln
import kiln.distributed as dist
from kiln.distributed.model_parallel import ModelParallel
from kiln.distributed.tensor_parallel import shard_layout

dp, tp, cp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
world = dist.init_process_group("mpi", timeout=60)


data = batches()
ref = gpt()
ref_opt = optimizer(ref)
ref_losses, ref_norms = [], []
for i, (x, y) in enumerate(data):
    if i == STEPS:  # the state the runs are compared with
        names = {id(p): n for n, p in ref.named_parameters()}
        ref_params = {n: p.numpy().copy() for n, p in ref.named_parameters()}
        ref_moments = {kind: {names[id(p)]: m.copy() for p, m in zip(ref_opt.params, ms)}
                       for kind, ms in zip(("exp_avg", "exp_avg_sq"), ref_opt._moments)}
    ref_opt.zero_grad()
    loss = ref(kiln.tensor(x), kiln.tensor(y))[1]
    loss.backward()
    ref_losses.append(loss.item())
    ref_norms.append(ref_opt.clip_grad_norm_(CLIP).item())
    ref_opt.step()
ref_after = {n: p.numpy() for n, p in ref.named_parameters()}


def step(run, x, y):
    """One step of run on the global batch x, y: (the loss's mean over the dp x cp ranks, the norm)."""
    opt = run.optimizer
    opt.zero_grad()
    loss = run.model(*run.batch(x, y))[1]
    loss.backward()
    run.wait_gradients()
    norm = opt.clip_grad_norm_(CLIP, run.grad_norm()).item()
    opt.step()
    mean = kiln.tensor(np.array([loss.item()]))
    world.all_reduce(mean, "avg")  # the tp ranks hold the same loss: the world's mean is the dp x cp one
    return float(mean.item()), norm


def biggest(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.max(np.abs(np.asarray(a[n]) - b[n]))) for n in b)


mesh = dist.DeviceMesh({"dp": dp, "cp": cp, "tp": tp})
result, ddp_params = {}, None
for s, strategy in enumerate(STRATEGIES):
    run = ModelParallel(gpt(), mesh, chunks=2 if tp > 1 else 1, parallel=strategy, optimizer=optimizer,
                        bucket_cap_mb=0.002)  # several buckets, parameters cut across shard boundaries
    losses, norms = zip(*(step(run, x, y) for x, y in data[:STEPS]))
    params, opt_state = run.dense_state()
    local = run._local_parameters()  # this rank's tp/cp-local parameters (FSDP's gathered)
    replicated = [n for n in sorted(local) if n not in shard_layout(run.model)]
    mine = np.concatenate([np.asarray(local[n]).reshape(-1) for n in replicated])
    every = np.empty((mesh.size("tp"),) + mine.shape)
    mesh["tp"].all_gather(kiln.Tensor._wrap(every, run.model.wte.weight.device), kiln.tensor(mine))
    held = run.data_parallel.memory() if run.sharded else None
    moments = {kind: dict(zip(opt_state["params"], opt_state[kind])) for kind in ("exp_avg", "exp_avg_sq")}
    ddp_params = params if strategy == "ddp" else ddp_params
    other = ModelParallel(gpt(), mesh, parallel=STRATEGIES[(s + 1) % len(STRATEGIES)], optimizer=optimizer,
                          bucket_cap_mb=0.002)
    other.load_dense_state(params, opt_state)
    step(other, *data[STEPS])
    result[strategy] = {
        "sharded": run.sharded, "grad_group": run.grad_group.size, "step_count": opt_state["step"],
        "param_diff": biggest(params, ref_params),
        "moment_diff": max(biggest(moments[k], ref_moments[k]) for k in moments),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
        "ddp_diff": biggest(params, ddp_params),
        "resumed_diff": biggest(other.dense_state_dict(), ref_after),
        "tp_replicas_differ": float(np.max(np.abs(every - mine))),  # tp-replicated parameters, across tp ranks
        "optimizer_bytes": held["optimizer"] if held else sum(m.nbytes for ms in run.adamw._moments for m in ms)}
moved = biggest(ref_params, {n: p.numpy() for n, p in gpt().named_parameters()})
write_result(world.rank, {"strategies": result, "ref_norms": ref_norms[:STEPS], "moved": moved,
                          "coordinate": mesh.coordinate})
