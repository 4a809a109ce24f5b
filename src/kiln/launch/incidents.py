"""Incidents: each failure classified and written as one JSON line to the run's incidents.jsonl.

    {"run_id": "...", "attempt": 0, "class": "dead_rank", "rank": 1, "step": 7,
     "evidence": "exit: killed by SIGKILL", "action": "restart from step 4 (ckpt-00000004.kiln)",
     "detected_at": 1764790000.1, "detect_s": 0.2, "recovery_s": 3.2, "steps_lost": 3,
     "teardown": "rank(s) [0] aborted their communicators through the store ([...]) and exited within 0.1 s"}

The classes follow paper §4.4's taxonomy, as far as a process can tell them apart.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# class -> may a restart fix it (a configuration or data error would fail the same way again)
CLASSES = {
    "dead_rank": True,          # exited by a signal or with a failure status and no report
    "hang": True,               # alive, but no heartbeat progress within the hang timeout
    "bad_step_nan": True,       # a NaN/Inf loss or gradient norm
    "bad_step_spike": True,     # a loss or gradient-norm spike (rolling z-score)
    "host_oom": True,           # MemoryError in the rank
    "device_oom": True,         # the device allocator ran out of memory
    "collective_failure": True,  # a collective failed or timed out (a peer died or stalled)
    "checkpoint_corrupt": True,  # a checkpoint failed its checksum or cannot be parsed
    "checkpoint_truncated": True,
    "checkpoint_incomplete": True,  # a sharded checkpoint's manifest names a shard file that is not there
    "crash": True,              # any other exception in the rank
    "user_error": False,        # a kiln error about the run's input: restarting would not help
    "rank_incomplete": True,    # the rank exited 0 before the gang was done
}


@dataclass
class Incident:
    run_id: str
    attempt: int
    cls: str
    rank: int | None
    step: int | None
    evidence: str
    action: str
    detected_at: float = field(default_factory=time.time)
    detect_s: float | None = None       # from the rank's last heartbeat to the detection
    recovery_s: float | None = None     # from the detection to training again
    steps_lost: int | None = None
    resumed_from_step: int | None = None
    teardown: str | None = None         # how the gang's ranks went: aborted through the store, or SIGKILLed

    def record(self) -> dict:
        d = asdict(self)
        d["class"] = d.pop("cls")
        return d


def classify_exception(e: BaseException) -> str:
    """The incident class of an exception that ended a rank."""
    from kiln.errors import DistributedError, KilnError
    if isinstance(e, MemoryError):
        return "host_oom"
    if type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower():
        return "device_oom"
    if isinstance(e, DistributedError):
        return "collective_failure"
    from kiln.checkpoint import CheckpointError
    if isinstance(e, CheckpointError):
        return "checkpoint_corrupt"
    if isinstance(e, KilnError):
        return "user_error"
    return "crash"


def describe_exit(returncode: int) -> str:
    """'killed by SIGKILL' / 'exit status 3' for a child's return code (negative: a signal)."""
    if returncode < 0 or returncode > 128:
        number = -returncode if returncode < 0 else returncode - 128
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    return f"exit status {returncode}"


class IncidentLog:
    """Appends incidents to <run>/incidents.jsonl, one flushed line each (thread-safe)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def write(self, incident: Incident) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(incident.record()) + "\n")
            f.flush()

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
