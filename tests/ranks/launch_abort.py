"""A rank for the abort-through-the-store tests: N steps heartbeated as launch_steps.py's, with
KILN_FAULT's kill/hang faults. At the end of step 3 of the first attempt every rank meets the
others in a store exchange (the path of NCCL's id without MPI; here it stands for a collective),
which a peer killed at step 3 never joins. With --nccl the rank first makes its NCCL world group
(world size 1 on one GPU) and all-reduces through it, so that the abort has a communicator to
abort. Writes its last step and attempt to <run>/rank-R.json when it finishes."""

import json
import os
import sys
import time

from kiln.distributed.nccl_engine import StoreChannel
from kiln.distributed.store import TCPStore
from kiln.launch import RankAgent

steps, seconds = int(sys.argv[1]), float(sys.argv[2])
agent = RankAgent.from_env()
if "--nccl" in sys.argv:
    import kiln
    import kiln.distributed as dist
    world = dist.init_process_group("nccl")
    t = kiln.tensor([1.0, 2.0], device="cuda")
    world.all_reduce(t)
    assert t.numpy().tolist() == [1.0, 2.0]
host, _, port = os.environ["KILN_LAUNCH_STORE"].rpartition(":")
meeting = StoreChannel(TCPStore(host, int(port)), "test/meeting", agent.rank, int(os.environ["WORLD_SIZE"]), 300.0)
agent.heartbeat(0, "start")
for step in range(1, steps + 1):
    time.sleep(seconds)
    agent.step_done(step, seconds, loss=1.0 + 1.0 / step, grad_norm=1.0)
    if agent.faults is not None:
        agent.faults.after_step(step)
    if step == 3 and agent.attempt == 0:
        meeting.exchange(step)
(agent.run_dir / f"rank-{agent.rank}.json").write_text(json.dumps({"step": steps, "attempt": agent.attempt}))
