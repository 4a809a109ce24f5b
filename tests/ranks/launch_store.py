"""A rank under `kiln launch --nproc N`: rendezvous through the launcher's store (the one store of
the run: rank 0 serves none) and exchange a value with every rank, as the NCCL id exchange does."""

import json
import os
from pathlib import Path

from kiln.distributed.environment import detect
from kiln.distributed.nccl_engine import StoreChannel
from kiln.distributed.process_group import rendezvous_store

env = detect()
store = rendezvous_store(env, timeout=30.0)
channel = StoreChannel(store, "kiln/world", env.rank, env.world_size, 30.0)
got = channel.exchange({"rank": env.rank, "pid": os.getpid()})
Path(os.environ["KILN_RUN_DIR"], f"store-{env.rank}.json").write_text(json.dumps(
    {"agent_store": env.agent_store, "serves": store.server is not None, "launcher": env.launcher,
     "ranks": [g["rank"] for g in got]}))
