"""`kiln launch`: start the rank gang, watch it, and recover it (paper §4.4, Distributed Orchestration).

    kiln launch --nproc 2 --max-restarts 3 -- kiln train --steps 1000 --checkpoint-interval 100

The supervisor serves the per-job store (kiln.distributed.store), starts each rank with
torchrun's environment in its own process group (stdout and stderr to <run>/logs/rank-R.log),
and polls the gang: exit statuses, heartbeats (a hang is no progress within a timeout derived
from the measured step time), and the ranks' own failure reports. On a failure it kills the
gang, classifies the incident, verifies the checkpoints newest first (a corrupt or truncated
one is set aside and logged), and starts the gang again, up to --max-restarts times; every
incident is one line of <run>/incidents.jsonl under a run id kept across attempts. Over several
nodes each node runs a supervisor for its own ranks; they tear an attempt down and restart it
together through node 0's store (see "one gang over several nodes" below). SIGINT or
SIGTERM stop the gang (SIGTERM to each rank, which saves and exits). Whatever is left of a gang
being torn down is told through the store to abort (each rank aborts its communicators and exits:
kiln.launch.rank), then SIGKILLed; no child outlives the supervisor (each is also bound to it by
PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kiln.checkpoint.format import SUFFIX
from kiln.errors import ConfigError, NotBuiltError
from kiln.launch.exit_markers import ExitMarkers
from kiln.launch.health import Health
from kiln.launch.incidents import CLASSES, Incident, IncidentLog, describe_exit
from kiln.launch.rank import BAD_STEP_POLICIES

POLL_S = 0.1
ABORT_WAIT_S = 5.0  # after the abort through the store, how long the ranks get to exit before SIGKILL


@dataclass
class LaunchConfig:
    command: list[str]
    run_dir: Path
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master: str | None = None          # HOST:PORT of node 0's store; default: a free local port
    max_restarts: int = 3
    run_id: str | None = None          # default: kept in <run>/launch.json across launches
    bad_step: str = "restart"          # restart, skip (drop the step's update) or rollback in place
    spike_z: float = 6.0
    spike_window: int = 100
    spike_min_history: int = 10
    spike_ratio: float = 2.0           # ... and at least this many times the window's mean
    hang_factor: float = 20.0          # a rank is hung after hang_factor x its median step time ...
    hang_min_s: float = 60.0           # ... and never less than this
    startup_timeout_s: float = 900.0   # before the first step, and around evals and checkpoints
    grace_s: float = 15.0              # SIGTERM -> SIGKILL on a stop
    prometheus_port: int | None = None
    mpi: bool = False                  # start the ranks with `mpiexec -n nproc` (the MPI backend's CPU ranks)
    extra_env: dict = field(default_factory=dict)

    def validate(self) -> None:
        if not self.command:
            raise ConfigError("kiln launch needs a command after '--', e.g. -- kiln train --steps 100")
        for name in ("nproc", "nnodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not in 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.master:
            raise ConfigError("a launch over several nodes needs --master HOST:PORT (node 0's address)")
        if self.mpi and self.nnodes > 1:
            raise NotBuiltError("--mpi over several nodes (an mpiexec host list) is not built; "
                                "use --mpi on one node")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.bad_step not in BAD_STEP_POLICIES:
            raise ConfigError(f"--on-bad-step {self.bad_step!r}; allowed: {', '.join(BAD_STEP_POLICIES)}")
        if not (self.hang_factor > 0 and self.hang_min_s > 0 and self.startup_timeout_s > 0):
            raise ConfigError("hang factor and timeouts must be > 0 seconds")
        if self.master:
            host, _, port = self.master.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--master {self.master!r} is not HOST:PORT")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _libc_prctl():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


_PRCTL = _libc_prctl()  # looked up here: between fork and exec the child may not import


def _bind_to_parent() -> None:
    """In the child before exec: die with the supervisor (Linux PR_SET_PDEATHSIG), never orphaned."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def newest_good_checkpoint(run_dir: Path, run_id: str, attempt: int) -> tuple[int | None, list[Incident]]:
    """The step of the newest checkpoint under run_dir that verifies (None: start afresh), and an
    incident for every bad one found on the way. A sharded checkpoint (a manifest and one file per
    rank, kiln.distributed.checkpoint) is good only with every shard it names present and intact.
    A bad one is set aside, renamed *.corrupt with its shard files, so that it is no candidate of
    this or a later attempt (the ranks resume from CheckpointFolder's newest good one: this one)."""
    from kiln.checkpoint import CheckpointError, CheckpointFolder, load
    from kiln.checkpoint.sharded import verify_shards
    found, incidents = [], []
    folders = [run_dir / "checkpoints"] + sorted(run_dir.glob("*/checkpoints"))
    for folder in (f for f in folders if f.is_dir()):
        good = None
        for path in CheckpointFolder(folder).candidates():
            try:
                state = load(path)
                if isinstance(state, dict) and "sharded" in state:
                    verify_shards(path, state)
                    state = state["state"]  # the Trainer's state, saved with the manifest
            except CheckpointError as e:
                text = str(e)
                cls = "checkpoint_incomplete" if "is missing" in text else "checkpoint_truncated" \
                    if any(w in text for w in ("bytes long", "ends before", "truncated")) else "checkpoint_corrupt"
                aside = [path, *sorted(folder.glob(path.name.removesuffix(SUFFIX) + ".shard-*" + SUFFIX))]
                for f in aside:
                    f.rename(f.with_name(f.name + ".corrupt"))
                incidents.append(Incident(run_id, attempt, cls, None, None, text,
                                          f"set aside as {', '.join(f.name + '.corrupt' for f in aside)}; "
                                          "the previous checkpoint is used"))
                continue
            good = int(state.get("step", 0)) if isinstance(state, dict) else 0
            break
        found.append(good)
    if not found or any(g is None for g in found):
        return None, incidents
    return min(found), incidents


def _descendants(roots: list[int]) -> list[int]:
    """Every live descendant of these pids (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Supervisor:
    def __init__(self, config: LaunchConfig, out=sys.stderr):
        config.validate()
        self.config, self.out = config, out
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        # node 0 keeps the run id in launch.json; the other nodes take it from node 0's store (run())
        self.run_id = config.run_id or (self._stored_run_id() if config.node_rank == 0 else "")
        self.incidents = IncidentLog(self.run_dir / "incidents.jsonl")
        self.health = Health(self.run_dir / "health.jsonl", config.prometheus_port, self.say)
        self._stop: int | None = None
        self._procs: dict[int, subprocess.Popen] = {}
        self._exit_markers: ExitMarkers | None = None  # under mpiexec: the statuses the ranks' shells wrote
        self.attempt = 0

    def say(self, msg: str) -> None:
        print(f"kiln launch: {msg}", file=self.out, flush=True)

    def _stored_run_id(self) -> str:
        """One run id for the run folder, kept across attempts and across launches that resume it."""
        info = self.run_dir / "launch.json"
        if info.is_file():
            return json.loads(info.read_text())["run_id"]
        run_id = uuid.uuid4().hex[:16]
        info.write_text(json.dumps({"run_id": run_id, "command": self.config.command,
                                    "world_size": self.config.world_size}, indent=1))
        return run_id

    # ------------------------------------------------------------------ the store
    def _open_store(self):
        from kiln.distributed.store import TCPStore
        c = self.config
        if c.master:
            host, _, port = c.master.rpartition(":")
            port = int(port)
        else:
            host, port = "127.0.0.1", _free_port()
        self.store = TCPStore(host, port, is_server=c.node_rank == 0, timeout=60.0)
        self.master_addr, self.master_port = host, self.store.port

    def _clear_store(self) -> None:
        """Before an attempt (node 0): drop what the ranks of the last one left (NCCL ids, groups)."""
        for key in self.store.keys(""):
            if not key.startswith("launch/"):
                self.store.delete(key)

    # ------------------------------------------------------------------ the gang
    @property
    def ranks(self) -> list[int]:
        """The world ranks this node runs."""
        c = self.config
        return [c.node_rank * c.nproc + local for local in range(c.nproc)]

    def _rank_env(self, local_rank: int | None, gpus: list[int] | None) -> dict:
        """Each rank's environment: torchrun's variables (local_rank None: mpiexec sets the rank's
        own, PMI_RANK and the rest, and kiln.distributed.environment reads those) and kiln's."""
        c = self.config
        env = {**os.environ, **c.extra_env}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"):
            env.pop(name, None)
        if local_rank is not None:
            rank = c.node_rank * c.nproc + local_rank
            env.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(c.world_size),
                        "LOCAL_WORLD_SIZE": str(c.nproc), "GROUP_RANK": str(c.node_rank), "ROLE_RANK": str(rank)})
        env.update({
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
               "TORCHELASTIC_RESTART_COUNT": str(self.attempt), "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts),
               "TORCHELASTIC_RUN_ID": self.run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
               "KILN_LAUNCH_STORE": f"{self.master_addr}:{self.master_port}", "KILN_RUN_DIR": str(self.run_dir),
               "KILN_BAD_STEP": c.bad_step, "KILN_SPIKE_Z": str(c.spike_z),
               "KILN_SPIKE_WINDOW": str(c.spike_window), "KILN_SPIKE_MIN_HISTORY": str(c.spike_min_history),
               "KILN_SPIKE_RATIO": str(c.spike_ratio),
               "PYTHONUNBUFFERED": "1"})
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        return env

    def _spawn(self) -> None:
        c = self.config
        gpus = self.health.usable_gpus(c.nproc)
        for rank in self.ranks:
            with open(self.run_dir / "logs" / f"rank-{rank}.log", "ab") as log:
                log.write(f"=== kiln launch: run {self.run_id} attempt {self.attempt} rank {rank} "
                          f"at {time.strftime('%Y-%m-%dT%H:%M:%S')} ===\n".encode())
        if c.mpi:
            self._spawn_mpi(gpus)
            return
        for local, rank in enumerate(self.ranks):
            log = open(self.run_dir / "logs" / f"rank-{rank}.log", "ab", buffering=0)  # noqa: SIM115 (the child's)
            cpus = self.health.cpus_for(local, c.nproc, gpus[local] if gpus else None)

            def start(cpus=cpus):
                _bind_to_parent()
                if cpus:
                    os.sched_setaffinity(0, cpus)  # the CPU cores of this rank's GPU's NUMA node

            try:
                self._procs[rank] = subprocess.Popen(c.command, env=self._rank_env(local, gpus), stdout=log,
                                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                     start_new_session=True, preexec_fn=start)
            except OSError as e:
                raise ConfigError(f"kiln launch cannot start {c.command[0]!r}: {e}") from None
            finally:
                log.close()

    def _spawn_mpi(self, gpus) -> None:
        """The node's ranks as one `mpiexec -n nproc` (MPI connects them); each rank appends its
        output to its own log (PMI_RANK names it); mpiexec's own goes to logs/mpiexec.log. Each rank is
        a shell running the command as its child, which writes the command's exit status to
        logs/rank-R.exit when it ends (kiln.launch.exit_markers: which rank ended first, on
        its own, and that it ended at all: hydra may leave mpiexec running, _dead_under_mpiexec); the shell
        waits out TERM, INT and HUP (the rank, in the same process group, gets them and saves), and dies
        with the rank on hydra's SIGUSR1 and SIGKILL."""
        c = self.config
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
        if mpiexec is None:
            raise ConfigError("kiln launch --mpi needs mpiexec: pip install 'kiln[dist]' (mpi4py, mpich)")
        markers = {rank: self.run_dir / "logs" / f"rank-{rank}.exit" for rank in self.ranks}
        for path in markers.values():
            path.unlink(missing_ok=True)
        self._exit_markers = ExitMarkers(markers)
        per_rank = ('trap : TERM INT HUP; "$@" >> "$KILN_RUN_DIR/logs/rank-$PMI_RANK.log" 2>&1; s=$?; '
                    'echo $s > "$KILN_RUN_DIR/logs/rank-$PMI_RANK.exit"; exit $s')
        command = [mpiexec, "-n", str(c.nproc), "sh", "-c", per_rank, "sh", *c.command]
        with open(self.run_dir / "logs" / "mpiexec.log", "ab") as log:
            log.write(f"=== attempt {self.attempt} ===\n".encode())
            log.flush()
            self._procs["mpiexec"] = subprocess.Popen(command, env=self._rank_env(None, gpus), stdout=log,
                                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                      start_new_session=True, preexec_fn=_bind_to_parent)

    def _kill_gang(self, graceful: bool, reason: str | None = None) -> str | None:
        """Every child and its process group gone: SIGTERM first when graceful (the ranks save and
        exit); then, with a reason (a failure, a stop), the abort through the store (each rank
        aborts its communicators and exits, on every node: with several nodes it is set even when
        this node's ranks are all gone); SIGKILL for what is left after ABORT_WAIT_S. Returns how
        this node's ranks went, in words (None when none was left to abort)."""
        if graceful:
            self._signal_all(signal.SIGTERM)
            self._wait_for_exit(self.config.grace_s)
        alive = any(p.poll() is None for p in self._procs.values())
        key = f"launch/abort/{self.attempt}"
        if reason is not None and (alive or self.config.nnodes > 1) and self.store.try_get(key) is None:
            self.store.set(key, reason)
        teardown = None
        if alive and self.store.try_get(key) is not None:
            t0 = time.monotonic()
            self._wait_for_exit(ABORT_WAIT_S)
            aborted = {r: rec for r in self.ranks if (rec := self._record(f"launch/aborted/{self.attempt}/{r}"))}
            left = [k for k, p in self._procs.items() if p.poll() is None]
            teardown = (f"rank(s) {sorted(aborted)} aborted their communicators through the store "
                        f"({sorted({c for rec in aborted.values() for c in rec['communicators']})}) and exited "
                        f"within {time.monotonic() - t0:.2f} s" if aborted else "no rank aborted through the store")
            if left:
                teardown += f"; SIGKILL for {left} after {ABORT_WAIT_S:g} s"
        self._signal_all(signal.SIGKILL)
        for p in self._procs.values():
            p.wait()
        self._procs = {}
        self._exit_markers = None
        return teardown

    def _wait_for_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs.values()):
            time.sleep(POLL_S / 10)

    def _signal_all(self, sig: int) -> None:
        """The signal to every child's process group and to all their descendants (some, such as
        mpiexec's proxies, start their own groups)."""
        leaders = [p.pid for p in self._procs.values() if p.poll() is None]
        for pid in leaders:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in _descendants(leaders) if sig == signal.SIGKILL else []:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    # ------------------------------------------------------------------ watching
    def _record(self, key: str) -> dict | None:
        raw = self.store.try_get(key)
        return json.loads(raw) if raw is not None else None

    def _heartbeats(self) -> dict[int, dict]:
        beats = {}
        for rank in self.ranks:
            hb = self._record(f"launch/hb/{self.attempt}/{rank}")
            if hb is not None:
                beats[rank] = hb
        return beats

    def _hang_timeout(self, hb: dict) -> float:
        c = self.config
        if hb.get("phase") != "step" or not hb.get("step_s"):
            return c.startup_timeout_s
        return max(c.hang_min_s, c.hang_factor * hb["step_s"])

    def _write_recovered(self, pending: list[Incident], beats: dict) -> None:
        """Once a rank of the new attempt has finished a step, the pending incidents' time to recover
        is known (from that step's own time, so a gang that trains and ends between two polls counts)."""
        trained = [hb["trained_at"] for hb in beats.values() if hb.get("trained_at")]
        if pending and trained:
            for inc in pending:
                inc.recovery_s = round(min(trained) - inc.detected_at, 3)
                self.incidents.write(inc)
            pending.clear()

    def _watch(self, started: float, resumed_step: int | None, pending: list[Incident]) -> Incident | None:
        """Poll the gang until it finishes (None) or fails (the incident); write pending incidents
        once the gang trains again; relay in-place incidents; stop on a signal."""
        seen_incidents: set[str] = set()
        last_progress: dict[int, tuple[int, float]] = {}
        exited_ok: set[int] = set()
        while True:
            if self._stop is not None:
                return None
            if self.config.nnodes > 1:  # another node tears this attempt down: checked before our ranks'
                reason = self.store.try_get(f"launch/abort/{self.attempt}")  # exits, which it causes
                if reason is not None:
                    return Incident(self.run_id, self.attempt, "peer_node", None, None,
                                    f"another node tore attempt {self.attempt} down ({reason.decode()})", "")
            now = time.time()
            beats = self._heartbeats()
            self.health.update(beats, self.attempt)
            self._write_recovered(pending, beats)
            for key in self.store.keys(f"launch/incident/{self.attempt}/"):
                if key not in seen_incidents:
                    seen_incidents.add(key)
                    rec, rank = self._record(key), int(key.split("/")[3])
                    inc = Incident(self.run_id, self.attempt, rec["class"], rank, rec["step"], rec["evidence"],
                                   rec["action"], detect_s=0.0, recovery_s=rec["recovery_s"],
                                   steps_lost=rec["steps_lost"])
                    self.incidents.write(inc)
                    self.health.incident(inc)
                    self.say(f"rank {rank}: {rec['class']} at step {rec['step']}: {rec['action']}")
            failed = {}
            for rank, p in self._procs.items():
                rc = p.poll()
                if rc is None:
                    continue
                if rc == 0:
                    exited_ok.add(rank)
                else:
                    failed[rank] = rc
            if not failed and self._exit_markers is not None:
                failed = self._dead_under_mpiexec(beats)
            if failed:
                return self._exit_incident(failed, beats)
            if len(exited_ok) == len(self._procs):
                return None
            for rank, hb in beats.items():
                if rank in exited_ok:
                    continue
                step = hb["step"], hb.get("phase")
                if last_progress.get(rank, (None,))[0] != (step, hb["time"]):
                    last_progress[rank] = ((step, hb["time"]), now)
                waited, timeout = now - last_progress[rank][1], self._hang_timeout(hb)
                if waited > timeout:
                    return Incident(self.run_id, self.attempt, "hang", rank, hb["step"],
                                    f"no heartbeat progress for {waited:.1f} s (timeout {timeout:.1f} s: "
                                    f"{self.config.hang_factor:g} x the median step time {hb.get('step_s')} s, "
                                    f"at least {self.config.hang_min_s:g} s); last phase {hb.get('phase')!r}",
                                    "", detect_s=round(waited, 3))
            silent = [r for r in self.ranks if r not in beats and r not in exited_ok]
            if silent and now - started > self.config.startup_timeout_s:
                return Incident(self.run_id, self.attempt, "hang", silent[0], resumed_step,
                                f"no heartbeat within the startup timeout {self.config.startup_timeout_s:g} s", "")
            time.sleep(POLL_S)

    def _dead_under_mpiexec(self, beats: dict[int, dict]) -> dict[int, int]:
        """Under mpiexec: the ranks whose shells wrote an exit status other than 0 without finishing
        (rank -> status), while mpiexec may still be running. Its exit is no sign that a rank died:
        hydra's proxy ends a dead rank's peers only when it sees the rank's PMI socket close before it
        reaps the rank's process, or reaps a process killed by a signal. The rank's shell exits with
        the killed command's 128 + N, not by the signal, so when the proxy, woken by the shell's
        stdout closing, reaps the shell before it handles the PMI socket's close, it kills nobody
        (it takes the set exit status for a kill already sent), and the peers wait in their
        collective for the dead rank, mpiexec with them (kiln.launch.exit_markers)."""
        return {r: status for r, (status, _) in self._exit_markers.ended().items()
                if status != 0 and beats.get(r, {}).get("phase") != "finish"}

    def _exit_incident(self, failed: dict, beats: dict[int, dict]) -> Incident:
        """Classify a gang that exited with failures. The cause, in order: a rank's own report
        other than a collective failure (that is a consequence); a rank that died without one
        (killed), the first to end where several did, not counting ranks that ended after a rank
        reported (its MPI_Abort ends them all); a collective failure. Under mpiexec, whose ranks'
        exits the supervisor does not see, the ranks whose shells wrote an exit status other than 0
        without finishing, in the order they wrote it (ExitMarkers: mpiexec kills a dead rank's
        peers within milliseconds, when it does, and its own report goes in rank order); failed
        then holds them, or mpiexec's own status where mpiexec ended first."""
        time.sleep(2 * POLL_S)  # a report written just before the exit
        reports = {r: rec for r in self.ranks if (rec := self._record(f"launch/error/{self.attempt}/{r}"))}
        own = [r for r, rec in reports.items() if rec["class"] != "collective_failure"]
        ended = self._exit_markers.ended() if self._exit_markers is not None else {}
        if "mpiexec" in failed:
            failed = {**{r: status for r, (status, _) in ended.items()
                         if status != 0 and beats.get(r, {}).get("phase") != "finish"}, **failed}
        reported_at = min((rec.get("time", float("inf")) for rec in reports.values()), default=float("inf"))
        order = list(ended)
        silent = sorted((r for r in failed if isinstance(r, int) and r not in reports
                         and ended.get(r, (None, 0.0))[1] < reported_at),
                        key=lambda r: order.index(r) if r in order else len(order))
        if own:
            rank = own[0]
        elif silent:
            rank = silent[0]
        else:
            rank = next(iter(reports), None)
        rep = reports.get(rank)
        if rank in failed:
            exit_text = describe_exit(failed[rank])
            if len(silent) > 1:
                exit_text += f", the first to end (then rank(s) {silent[1:]})"
        elif "mpiexec" in failed:
            exit_text = f"mpiexec {describe_exit(failed['mpiexec'])}"
        else:  # it reported, and was still running when another rank's exit ended the gang
            exit_text = "still running when the gang failed"
        quiet = [r for r in self.ranks if r not in reports]
        if rep is not None and rep["class"] == "collective_failure" and quiet:
            exit_text += f"; rank(s) {quiet} did not report the failed collective: stalled or dead there"
        step = rep["step"] if rep else beats.get(rank, {}).get("step")
        detect_s = round(time.time() - beats[rank]["time"], 3) if rank in beats else None
        if rep is None:
            return Incident(self.run_id, self.attempt, "dead_rank", rank, step, f"exit: {exit_text}", "",
                            detect_s=detect_s)
        return Incident(self.run_id, self.attempt, rep["class"], rank, step, f"{rep['evidence']} ({exit_text})", "",
                        detect_s=detect_s)

    # ------------------------------------------------------------------ one gang over several nodes
    # Every node's supervisor watches its own ranks; node 0's store carries what they must agree on:
    #   launch/run_id                  node 0's run id, for the other nodes
    #   launch/abort/<attempt>         set by the node that tears the attempt down first (every rank
    #                                  on every node aborts; the other nodes' supervisors follow)
    #   launch/down/<attempt>/<node>   this node's gang of the attempt is gone ({"failed": class or None})
    #   launch/restart/<attempt>       node 0's decision once every node is down: {"give_up", "resumed"}
    #   launch/done/<attempt>/<node>   this node's gang finished
    # Checkpoints are read from the run folder, which several nodes must share (one file system).
    def _share_run_id(self) -> None:
        if self.config.node_rank == 0:
            self.store.set("launch/run_id", self.run_id)
        elif self.config.run_id is None:
            self.run_id = self.store.get("launch/run_id", timeout=self.config.startup_timeout_s).decode()

    def _first_checkpoint(self) -> int | None:
        """The step the first attempt resumes from (node 0 checks the checkpoints, the others ask)."""
        if self.config.node_rank != 0:
            return json.loads(self.store.get("launch/restart/-1", timeout=self.config.startup_timeout_s))["resumed"]
        self._clear_store()
        resumed, bad = newest_good_checkpoint(self.run_dir, self.run_id, self.attempt)
        for inc in bad:
            self.incidents.write(inc)
        self.store.set("launch/restart/-1", json.dumps({"give_up": None, "resumed": resumed}))
        return resumed

    def _node_down(self, failed: str | None) -> None:
        """This node's gang of this attempt is gone; failed: the class of the failure found here
        (None: a peer's failure or a stop brought it down)."""
        self.store.set(f"launch/down/{self.attempt}/{self.config.node_rank}", json.dumps({"failed": failed}))

    def _restart_decision(self) -> dict:
        """{"give_up": why or None, "resumed": step or None} for the next attempt, the same on every
        node: node 0 decides once every node's gang is down (the restart budget, a failure a restart
        cannot fix, the newest good checkpoint), clears the ranks' keys and publishes it."""
        c, a = self.config, self.attempt
        key = f"launch/restart/{a}"
        if c.node_rank != 0:
            return json.loads(self.store.get(key, timeout=c.startup_timeout_s + ABORT_WAIT_S))
        downs = [f"launch/down/{a}/{n}" for n in range(c.nnodes)]
        self.store.wait(downs, timeout=c.startup_timeout_s + ABORT_WAIT_S)
        failed = [json.loads(self.store.get(k))["failed"] for k in downs]
        give_up, resumed = None, None
        if "stopped" in failed:
            give_up = f"gave up: node {failed.index('stopped')} was stopped"
        elif any(f is not None and not CLASSES.get(f, True) for f in failed):
            give_up = "gave up: not recoverable by a restart"
        elif a >= c.max_restarts:
            give_up = f"gave up: the restart budget ({c.max_restarts}) is spent"
        else:
            resumed, bad = newest_good_checkpoint(self.run_dir, self.run_id, a)
            for inc in bad:
                inc.attempt = a + 1
                self.incidents.write(inc)
            self._clear_store()
        decision = {"give_up": give_up, "resumed": resumed}
        self.store.set(key, json.dumps(decision))
        return decision

    def _finish(self) -> int:
        """This node's gang finished: 0. Node 0 serves the store, so it waits for every node's gang
        to finish or go down first (1 if one went down)."""
        c = self.config
        self.store.set(f"launch/done/{self.attempt}/{c.node_rank}", "1")
        if c.node_rank == 0 and c.nnodes > 1:
            ends = [(f"launch/done/{self.attempt}/{n}", f"launch/down/{self.attempt}/{n}") for n in range(1, c.nnodes)]
            deadline = time.monotonic() + c.startup_timeout_s
            while time.monotonic() < deadline and not all(self.store.try_get(d) is not None
                                                          or self.store.try_get(f) is not None for d, f in ends):
                time.sleep(POLL_S)
            down = [n for n, (d, _) in enumerate(ends, 1) if self.store.try_get(d) is None]
            if down:  # the ranks here finished, so there is no gang left to restart with them
                why = f"gave up: node(s) {down} did not finish attempt {self.attempt}; node 0's ranks did"
                self.store.set(f"launch/restart/{self.attempt}", json.dumps({"give_up": why, "resumed": None}))
                self.say(why)
                return 1
        self.say(f"run {self.run_id} finished after {self.attempt} restart(s)")
        return 0

    # ------------------------------------------------------------------ the run
    def _on_signal(self, signum, frame) -> None:
        if self._stop is not None and signum == signal.SIGINT:  # a second Ctrl-C: no grace
            self._signal_all(signal.SIGKILL)
        self._stop = signum

    def run(self) -> int:
        """Run the gang to completion; 0 when it finished, 1 when the restart budget ran out or a
        failure was not recoverable, 128 + signal when stopped by SIGINT/SIGTERM."""
        c = self.config
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self._open_store()
        pending: list[Incident] = []
        try:
            self._share_run_id()
            resumed = self._first_checkpoint()
            while True:
                self.say(f"run {self.run_id} attempt {self.attempt}: {c.nproc} rank(s) of {c.world_size}"
                         + (f" (node {c.node_rank} of {c.nnodes})" if c.nnodes > 1 else "")
                         + (f", resuming from step {resumed}" if resumed is not None else ""))
                self.health.sample(self.attempt)
                started = time.time()
                self._spawn()
                incident = self._watch(started, resumed, pending)
                if self._stop is not None:
                    name = signal.Signals(self._stop).name
                    self.say(f"{name}: stopping the gang (SIGTERM; after {c.grace_s:g} s the abort through the "
                             f"store, SIGKILL after {ABORT_WAIT_S:g} s more)")
                    teardown = self._kill_gang(graceful=True, reason=f"{name}: the run is stopped")
                    if teardown:
                        self.say(teardown)
                    self._node_down("stopped")
                    if c.node_rank == 0 and c.nnodes > 1:
                        self._restart_decision()  # the other nodes give up too (and may leave the store)
                    for inc in pending:
                        inc.action += "; the run was stopped before it trained again"
                        self.incidents.write(inc)
                    return 128 + self._stop
                if incident is None:
                    self._kill_gang(graceful=False)  # nothing left, but never leave one behind
                    self._write_recovered(pending, self._heartbeats())
                    for inc in pending:  # it finished without a step heartbeat: no time to recover
                        self.incidents.write(inc)
                    return self._finish()
                peer = incident.cls == "peer_node"
                teardown = self._kill_gang(
                    graceful=False, reason=None if peer else f"{incident.cls} on rank {incident.rank} at step "
                                                             f"{incident.step}")
                if peer:
                    self.say(f"{incident.evidence}: this node's gang went down with it")
                else:
                    incident.teardown = teardown
                    self.health.incident(incident)
                    self.say(f"rank {incident.rank}: {incident.cls} at step {incident.step}: {incident.evidence}")
                for inc in pending:  # failed again before it trained: not recovered
                    inc.action += "; failed again before training resumed"
                    self.incidents.write(inc)
                pending = []
                self._node_down(None if peer else incident.cls)
                decision = self._restart_decision()
                if decision["give_up"]:
                    self.say(decision["give_up"])
                    if not peer:
                        incident.action = decision["give_up"]
                        self.incidents.write(incident)
                    return 1
                self.attempt += 1
                resumed = decision["resumed"]
                if not peer:
                    where = f"from step {resumed}" if resumed is not None else "from the start (no good checkpoint)"
                    incident.action = f"gang killed, restarted {where} (attempt {self.attempt})"
                    incident.resumed_from_step = resumed if resumed is not None else 0
                    if incident.step is not None:
                        incident.steps_lost = incident.step - incident.resumed_from_step
                    pending = [incident]
        finally:
            self._kill_gang(graceful=False)
            for s, h in previous.items():
                signal.signal(s, h)
            self.health.close()
            self.store.close()
