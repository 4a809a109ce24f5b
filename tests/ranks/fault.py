"""A rank that dies, stalls or raises in the middle of an all-reduce (argv: kill|stall|raise, timeout s).

The other ranks must leave with a DistributedError within the timeout: they write what they
caught (and how long the collective took) before the job is aborted."""

import os
import signal
import sys
import time

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist

mode, timeout = sys.argv[1], float(sys.argv[2])
world = dist.init_process_group("mpi", timeout=timeout)
t = kiln.tensor(np.full(1000, world.rank, dtype=np.float64))
world.all_reduce(t, "sum")  # everyone is up and talking
if world.rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":  # an uncaught exception: its excepthook aborts the job, nobody waits for the timeout
        raise RuntimeError("rank 1 broke")
    time.sleep(600)  # stalled: never joins the next all-reduce
t0 = time.monotonic()
try:
    world.all_reduce(t, "sum")
    write_result(world.rank, {"error": None})
except dist.DistributedError as e:
    write_result(world.rank, {"error": str(e), "seconds": time.monotonic() - t0})
    raise SystemExit(3) from None
