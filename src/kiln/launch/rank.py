"""The rank's side of `kiln launch`: heartbeats, bad-step checks, failure reports, injected faults.

The supervisor (supervisor.py) serves the per-job store; each rank it started finds it in
KILN_LAUNCH_STORE and writes, under keys of its attempt:

    launch/hb/<attempt>/<rank>        {"step", "time", "phase", "step_s", "loss", "grad_norm"}
    launch/error/<attempt>/<rank>     {"class", "step", "evidence", "time"}: why this rank is exiting
    launch/incident/<attempt>/<rank>/<n>  a bad step handled in place (skipped or rolled back)
    launch/aborted/<attempt>/<rank>   {"time", "communicators"}: this rank obeyed the abort

and watches `launch/abort/<attempt>`, which the supervisor sets when it tears the gang down (a
rank died, hung or failed; a stop): the rank then aborts its communicators (ncclCommAbort) and
exits at once, instead of waiting in a collective for a peer that is gone until the collective
timeout, on every node of the gang (the supervisor's SIGKILL reaches only its own node).

A process not started by `kiln launch` has no agent (`RankAgent.from_env()` is None).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path

from kiln.errors import ConfigError
from kiln.launch.anomaly import BadStep, BadStepDetector
from kiln.launch.faults import FaultPlan
from kiln.launch.incidents import classify_exception

BAD_STEP_POLICIES = ("restart", "skip", "rollback")
ABORTED_EXIT = 70  # a rank's exit status after the supervisor's abort through the store


class BadStepError(RuntimeError):
    """A NaN/Inf or spiking step under the `restart` policy: the rank exits, the gang restarts."""

    def __init__(self, bad: BadStep):
        super().__init__(bad.evidence)
        self.bad = bad


class RankAgent:
    """This rank's link to its supervisor."""

    def __init__(self, store, rank: int, attempt: int, run_dir: Path, policy: str = "restart",
                 detector: BadStepDetector | None = None, faults: FaultPlan | None = None):
        if policy not in BAD_STEP_POLICIES:
            raise ConfigError(f"KILN_BAD_STEP={policy!r}; allowed: {', '.join(BAD_STEP_POLICIES)}")
        self.store, self.rank, self.attempt, self.run_dir = store, rank, attempt, Path(run_dir)
        self.policy = policy
        self.detector = detector or BadStepDetector()
        self.faults = faults
        self.step_times: deque[float] = deque(maxlen=20)
        self._incidents = 0
        self.trained_at: float | None = None  # when this attempt's first step finished

    @classmethod
    def from_env(cls, env=None) -> RankAgent | None:
        env = os.environ if env is None else env
        where = env.get("KILN_LAUNCH_STORE")
        if not where:
            return None
        from kiln.distributed.environment import detect
        from kiln.distributed.store import TCPStore
        host, _, port = where.rpartition(":")
        rank, attempt = detect(env).rank, int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        detector = BadStepDetector(z=float(env.get("KILN_SPIKE_Z", "6")),
                                   window=int(env.get("KILN_SPIKE_WINDOW", "100")),
                                   min_history=int(env.get("KILN_SPIKE_MIN_HISTORY", "10")),
                                   ratio=float(env.get("KILN_SPIKE_RATIO", "2")))
        agent = cls(TCPStore(host, int(port), timeout=60.0), rank, attempt, Path(env["KILN_RUN_DIR"]),
                    env.get("KILN_BAD_STEP", "restart"), detector, FaultPlan.from_env(rank, attempt, env))
        # its own connection: the heartbeats' is not held up by a wait that lasts the whole attempt
        agent.watch_for_abort(TCPStore(host, int(port), timeout=60.0))
        return agent

    def watch_for_abort(self, store) -> threading.Thread:
        """A daemon thread that waits for the supervisor's `launch/abort/<attempt>`; then aborts this
        process's communicators (kiln.distributed.abort_communicators), tells the supervisor so,
        and ends the process with ABORTED_EXIT. It ends quietly when the store goes away."""
        def watch():
            from kiln.distributed.process_group import abort_communicators
            from kiln.errors import DistributedError
            key = f"launch/abort/{self.attempt}"
            try:
                while True:
                    try:
                        store.wait(key, timeout=600.0)
                        break
                    except DistributedError as e:
                        if "were not set within" not in str(e):
                            return  # the store is gone: the supervisor is too (PR_SET_PDEATHSIG ends us)
                reason = store.get(key).decode()
                done = abort_communicators()
                store.set(self._key("aborted"), json.dumps({"time": time.time(), "communicators": done}))
                sys.stderr.write(f"kiln: rank {self.rank}: kiln launch tears attempt {self.attempt} down "
                                 f"({reason}): aborted {len(done)} communicator(s) {done}, exiting\n")
                sys.stderr.flush()
            except Exception:  # the store went away mid-abort: exit all the same
                pass
            os._exit(ABORTED_EXIT)

        thread = threading.Thread(target=watch, name="kiln-launch-abort", daemon=True)
        thread.start()
        return thread

    def _key(self, kind: str) -> str:
        return f"launch/{kind}/{self.attempt}/{self.rank}"

    def heartbeat(self, step: int, phase: str = "step", **values) -> None:
        """Tell the supervisor this rank is alive at `step` (phase: start, step, eval, checkpoint, finish)."""
        step_s = sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else None
        now = time.time()
        if phase == "step" and self.trained_at is None:
            self.trained_at = now
        self.store.set(self._key("hb"), json.dumps({"step": step, "time": now, "phase": phase, "step_s": step_s,
                                                    "trained_at": self.trained_at, **values}))

    def step_done(self, step: int, seconds: float, loss: float | None, grad_norm: float | None) -> BadStep | None:
        """Heartbeat for a finished step; the bad step it was, if it was one (detector verdict)."""
        self.step_times.append(seconds)
        self.heartbeat(step, "step", loss=loss, grad_norm=grad_norm)
        return self.detector.check(step, loss, grad_norm)

    def report_incident(self, bad: BadStep, action: str, recovery_s: float, steps_lost: int) -> None:
        """A bad step this rank handled in place (the supervisor writes it to incidents.jsonl)."""
        self._incidents += 1
        self.store.set(f"{self._key('incident')}/{self._incidents}", json.dumps(
            {"class": f"bad_step_{bad.kind}", "step": bad.step, "evidence": bad.evidence,
             "action": action, "recovery_s": recovery_s, "steps_lost": steps_lost}))

    def report_failure(self, e: BaseException, step: int) -> None:
        """Before this rank exits on an exception in `step`: its class and evidence, for the supervisor."""
        if isinstance(e, BadStepError):
            cls, evidence, step = f"bad_step_{e.bad.kind}", e.bad.evidence, e.bad.step
        else:
            cls, evidence = classify_exception(e), f"{type(e).__name__}: {e}"
        try:
            self.store.set(self._key("error"), json.dumps({"class": cls, "step": step, "evidence": evidence,
                                                        "time": time.time()}))
        except Exception:  # the store is gone: the exit status still tells the supervisor
            pass


def launched_run_dir(env=None) -> Path | None:
    """The run folder `kiln launch` gave this rank (the same in every attempt), or None."""
    env = os.environ if env is None else env
    return Path(env["KILN_RUN_DIR"]) if env.get("KILN_LAUNCH_STORE") and env.get("KILN_RUN_DIR") else None
