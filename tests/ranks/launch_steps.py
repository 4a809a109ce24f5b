"""A rank for `kiln launch` tests without a model: N 'steps' of a fixed length, each heartbeated
through the supervisor's store, with KILN_FAULT's kill/hang faults; writes its last step and
attempt to <run>/rank-R.json when it finishes."""

import json
import sys
import time

from kiln.launch import RankAgent

steps, seconds = int(sys.argv[1]), float(sys.argv[2])
agent = RankAgent.from_env()
agent.heartbeat(0, "start")
for step in range(1, steps + 1):
    time.sleep(seconds)
    agent.step_done(step, seconds, loss=1.0 + 1.0 / step, grad_norm=1.0)
    if agent.faults is not None:
        agent.faults.after_step(step)
(agent.run_dir / f"rank-{agent.rank}.json").write_text(json.dumps({"step": steps, "attempt": agent.attempt}))
