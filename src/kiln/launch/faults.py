"""Fault injection for recovery tests: `KILN_FAULT=kill@step=7,rank=1;nan@step=9`.

Each fault fires once, on the rank and step it names, in the attempt it names (default the
first, so that the restarted gang trains clean). Kinds, each a failure of paper §4.4's taxonomy:

    kill       SIGKILL this rank at the end of step k (a process killed by the OS)
    hang       stop making progress at the end of step k (a stalled rank or collective)
    nan        multiply step k's loss by NaN before backward: every gradient it reaches is NaN,
               and in a data-parallel run every rank's after the reduction, as a real NaN spreads
    spike      multiply step k's loss by `scale` (default 1e4) before backward: loss and
               gradient norm spike together
    oom        raise a host MemoryError (where=host) or the device's OutOfMemoryError
               (where=device) at the start of step k
    truncate   cut the checkpoint of step k to half its length once it is durable, then SIGKILL
               (a sharded checkpoint: this rank's own shard file)
    corrupt    flip bytes in the middle of the checkpoint of step k once durable, then SIGKILL
               (a sharded checkpoint: this rank's own shard file)
    kill_ckpt  SIGKILL this rank while the checkpoint of step k is being written
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import ConfigError

KINDS = ("kill", "hang", "nan", "spike", "oom", "truncate", "corrupt", "kill_ckpt")


@dataclass
class Fault:
    kind: str
    step: int
    rank: int = 0
    attempt: int = 0
    options: dict = field(default_factory=dict)
    fired: bool = False


def parse(spec: str) -> list[Fault]:
    """`kind@step=K[,rank=R][,attempt=A][,key=value]` items separated by ';'."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, _, rest = item.partition("@")
        if kind not in KINDS:
            raise ConfigError(f"KILN_FAULT: unknown fault {kind!r} in {item!r}; allowed: {', '.join(KINDS)}")
        fields = {}
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ConfigError(f"KILN_FAULT: {pair!r} in {item!r} is not KEY=VALUE")
            fields[key.strip()] = value.strip()
        try:
            numbers = {k: int(fields.pop(k)) for k in ("step", "rank", "attempt") if k in fields}
        except ValueError:
            raise ConfigError(f"KILN_FAULT: step, rank and attempt must be integers in {item!r}") from None
        if "step" not in numbers or numbers["step"] < 1:
            raise ConfigError(f"KILN_FAULT: {item!r} needs step=K with K >= 1")
        faults.append(Fault(kind, numbers["step"], numbers.get("rank", 0), numbers.get("attempt", 0), fields))
    return faults


class FaultPlan:
    """The faults meant for this rank in this attempt; each `due` one fires once."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int):
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]

    @classmethod
    def from_env(cls, rank: int, attempt: int, env=None) -> FaultPlan | None:
        spec = (os.environ if env is None else env).get("KILN_FAULT", "")
        plan = cls(parse(spec), rank, attempt) if spec.strip() else None
        return plan if plan is not None and plan.faults else None

    def due(self, kind: str, step: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.step == step and not f.fired:
                f.fired = True
                return f
        return None

    # ------------------------------------------------------------------ inside the step
    def acts_inside_step(self, step: int) -> bool:
        """True when a fault of `step` changes the step's own computation (nan, spike): that step
        runs op by op, since a captured CUDA graph replays without calling Python; every other
        step may replay the graph, as an unfaulted run's do."""
        return any(f.kind in ("nan", "spike") and f.step == step and not f.fired for f in self.faults)

    def loss_scale(self, step: int) -> float | None:
        """What step's loss is multiplied by before backward: a spike's scale, NaN, or None."""
        if self.due("nan", step) is not None:
            return float("nan")
        f = self.due("spike", step)
        return float(f.options.get("scale", 1e4)) if f is not None else None

    def before_step(self, step: int) -> None:
        f = self.due("oom", step)
        if f is None:
            return
        if f.options.get("where", "host") == "device":
            from kiln.backend.cuda.allocator import OutOfMemoryError
            raise OutOfMemoryError(f"injected fault: out of memory allocating 1.00 GiB on the device at step {step}")
        raise MemoryError(f"injected fault: host out of memory at step {step}")

    # ------------------------------------------------------------------ between steps
    def after_step(self, step: int) -> None:
        if self.due("kill", step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.due("hang", step) is not None:
            while True:  # a stalled rank: alive, silent, until the supervisor kills it
                time.sleep(3600)

    def after_checkpoint(self, step: int, path: Path, saver) -> None:
        """Called right after the checkpoint of `step` was handed to the saver (or written)."""
        if self.due("kill_ckpt", step) is not None:
            os.kill(os.getpid(), signal.SIGKILL)  # the background writer is mid-file
        for kind in ("truncate", "corrupt"):
            if self.due(kind, step) is not None:
                if saver is not None:
                    saver.wait()  # durable and committed as latest first
                data = bytearray(path.read_bytes())
                if kind == "truncate":
                    data = data[:len(data) // 2]
                else:
                    mid = len(data) // 2
                    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
                path.write_bytes(bytes(data))
                os.kill(os.getpid(), signal.SIGKILL)
