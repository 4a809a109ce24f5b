"""A data-parallel rank for `kiln launch --mpi` recovery tests: a small GPT under kiln's DDP over
the MPI backend, rank 0 checkpointing every INTERVAL steps into <run>/checkpoints, each step's
batch a function of the step alone (a restarted gang sees the same data). Heartbeats, failure
reports and KILN_FAULT's kill/hang faults go through kiln.launch.RankAgent; rank 0 writes the
final parameters to <run>/final.npz.

argv: steps interval"""

import sys
import time

import numpy as np

import kiln
import kiln.distributed as dist
from kiln.checkpoint import CheckpointFolder, save
from kiln.checkpoint.async_save import to_host
from kiln.launch import RankAgent
from kiln.nn import GPT, GPTConfig
from kiln.optim import AdamW, gpt_param_groups

STEPS, INTERVAL = int(sys.argv[1]), int(sys.argv[2])
ROWS, T = 8, 16
cfg = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32)

world = dist.init_process_group("mpi")  # timeout: KILN_DIST_TIMEOUT
agent = RankAgent.from_env()
r, W = world.rank, world.size
model = GPT(cfg, generator=kiln.Generator(0))
opt = AdamW(gpt_param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
folder = CheckpointFolder(agent.run_dir / "checkpoints")
step = 0
if folder.checkpoints():
    state, _ = folder.load_latest()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    step = int(state["step"])
ddp = dist.DistributedDataParallel(model)
agent.heartbeat(step, "start")
rows = slice(r * ROWS // W, (r + 1) * ROWS // W)
try:
    while step < STEPS:
        t0 = time.perf_counter()
        rng = np.random.default_rng(1000 + step)
        x, y = rng.integers(0, 64, (ROWS, T)), rng.integers(0, 64, (ROWS, T))
        opt.zero_grad()
        _, loss = model(kiln.tensor(x[rows]), kiln.tensor(y[rows]))
        loss.backward()
        ddp.wait_gradients()
        norm = opt.clip_grad_norm_(1.0).item()
        opt.step()
        step += 1
        agent.step_done(step, time.perf_counter() - t0, float(loss.item()), norm)
        if agent.faults is not None:
            agent.faults.after_step(step)
        if step % INTERVAL == 0 and step < STEPS:
            if r == 0:
                agent.heartbeat(step, "checkpoint")
                names = {id(p): n for n, p in model.named_parameters()}
                optimizer = opt.state_dict()
                optimizer["params"] = [names[id(p)] for p in opt.params]
                folder.prepare()
                folder.commit(save(folder.path_for(step), to_host(
                    {"step": step, "model": {n: p.data for n, p in model.named_parameters()},
                     "optimizer": optimizer})))
            world.barrier()  # no rank runs ahead of a checkpoint that is not durable yet
except BaseException as e:
    agent.report_failure(e, step + 1)
    raise
if r == 0:
    np.savez(agent.run_dir / "final.npz", **{n: p.numpy() for n, p in model.named_parameters()})
agent.heartbeat(step, "finish")
