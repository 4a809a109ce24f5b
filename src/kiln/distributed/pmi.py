"""MPI for CPU ranks that no mpiexec started (torchrun, SLURM's srun without PMI, `kiln launch`):
each rank serves its own MPI library the process manager's protocol, over the run's store.

MPI_Init asks a process manager (mpiexec's hydra) for its rank and size and exchanges every
rank's address through the manager's key-value space, with barriers between; then the ranks
talk to each other directly. Here a process forked from each rank answers that rank's MPI
library on a socket pair (PMI_FD), in MPICH's PMI-1.1 wire protocol (MPICH's
src/pmi/maint/pmi-1.1.txt: one `cmd=NAME key=value ...` line a message): puts and gets go to
the run's rendezvous store, which every rank's server shares, and a barrier is a counter in it.
MPI itself moves every byte after that. (A thread cannot serve: MPI_Init holds the GIL.) Rank
0's server also holds the store when no launcher does (srun), until every rank's MPI is done.
As mpiexec does, the servers end the job when one rank fails: a rank that calls MPI_Abort, or
whose process ends without MPI_Finalize, sets the store's abort key, and every server that sees
it kills its rank (SIGKILL) within ABORT_POLL_S. Not under `kiln launch` (KILN_LAUNCH_STORE set):
its supervisor sees the rank end, names it and tears the gang down through the store (the others
abort their communicators and exit); a server killing the others too would end them within one
of the supervisor's polls, and which rank died first could no longer be told.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid

from kiln.errors import DistributedError

PMI_VARIABLES = ("PMI_FD", "PMI_RANK", "PMI_SIZE")
VALLEN_MAX = 1024  # longer values (addresses) MPICH splits over several keys
ABORT_POLL_S = 0.2


class PMIServer:
    """The process manager of one rank's MPI library: the keys of all ranks in `store` under
    `prefix` (one per attempt of a run: a restarted run must not read the last attempt's)."""

    def __init__(self, store, prefix: str, rank: int, size: int, local_size: int, timeout: float):
        self.store, self.prefix, self.rank, self.size, self.timeout = store, prefix, rank, size, timeout
        self.abort_key = f"{prefix}/abort"
        self.finalized = False
        # the job's name: MPI names its shared-memory segments after it, so it must be new for every
        # job (a killed job leaves its segments behind) and one for all ranks: rank 0's choice
        if rank == 0:
            store.set(f"{prefix}/kvsname", f"kiln-{uuid.uuid4().hex[:16]}")
        self.kvsname = store.get(f"{prefix}/kvsname", timeout).decode()
        # ranks 0..size-1 on size / local_size nodes of local_size ranks each, in order (as torchrun and
        # SLURM's block distribution place them); MPI uses it to find the ranks it shares memory with
        self.mapping = f"(vector,(0,{size // local_size},{local_size}))" if size % local_size == 0 else None
        self._barriers = 0

    def serve(self, sock, rank_pid: int) -> None:
        """Answer the MPI library at the other end of sock until it closes it (its process, rank_pid,
        ended), killing that process if another rank aborts the job (not under kiln launch); the
        store's host then waits for every rank's MPI to be done with the store."""
        if not os.environ.get("KILN_LAUNCH_STORE"):  # kiln launch's supervisor tears its gangs down itself
            threading.Thread(target=self._watch_abort, args=(rank_pid,), name="kiln-pmi-abort", daemon=True).start()
        for line in sock.makefile("rb"):
            fields = dict(f.split("=", 1) for f in line.decode().split() if "=" in f)
            try:
                reply = self._answer(fields)
            except DistributedError as e:
                reply = f"cmd={fields.get('cmd')} rc=-1 msg={str(e).replace(' ', '_')}"
            if reply is not None:
                sock.sendall((reply + "\n").encode())
        if not self.finalized:
            self._abort(f"rank {self.rank} ended without MPI_Finalize")
        done = self.store.add(f"{self.prefix}/closed", 1)
        if getattr(self.store, "server", None) is not None:
            # The rank's output ends with it: this process inherited the rank's stdout and stderr, and a
            # reader of those (a launcher's pipe) must not wait on the store's lingering host for them
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            os.close(quiet)
            deadline = time.monotonic() + self.timeout
            while done < self.size and time.monotonic() < deadline:
                time.sleep(0.05)
                done = self.store.add(f"{self.prefix}/closed", 0)

    def _answer(self, q: dict) -> str | None:
        cmd = q.get("cmd")
        if cmd == "init":
            return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
        if cmd == "get_maxes":
            return f"cmd=maxes kvsname_max=256 keylen_max=256 vallen_max={VALLEN_MAX} rc=0"
        if cmd == "get_universe_size":
            return f"cmd=universe_size size={self.size} rc=0"
        if cmd == "get_appnum":
            return "cmd=appnum appnum=0 rc=0"
        if cmd == "get_my_kvsname":
            return f"cmd=my_kvsname kvsname={self.kvsname} rc=0"
        if cmd == "put":
            self.store.set(f"{self.prefix}/kvs/{q['key']}", q["value"])
            return "cmd=put_result rc=0"
        if cmd == "get":
            value = self.mapping if q["key"] == "PMI_process_mapping" else \
                self.store.try_get(f"{self.prefix}/kvs/{q['key']}")
            if value is None:
                return "cmd=get_result rc=-1 found=FALSE msg=no_such_key"
            return f"cmd=get_result rc=0 found=TRUE value={value if isinstance(value, str) else value.decode()}"
        if cmd == "barrier_in":
            self._barrier()
            return "cmd=barrier_out rc=0"
        if cmd == "finalize":
            self.finalized = True
            return "cmd=finalize_ack rc=0"
        if cmd == "abort":  # MPI_Abort (which reads no answer): every server ends its rank
            self._abort(f"rank {self.rank} called MPI_Abort")
            return None
        raise DistributedError(f"kiln's PMI server does not serve {cmd!r}")

    def _abort(self, why: str) -> None:
        """End the job: every server (this one too) kills its rank."""
        if self.store.try_get(self.abort_key) is None:
            self.store.set(self.abort_key, why)

    def _watch_abort(self, rank_pid: int) -> None:
        """Kill this server's rank once another rank has aborted the job."""
        while True:
            time.sleep(ABORT_POLL_S)
            why = self.store.try_get(self.abort_key)
            if why is not None and not self.finalized:
                sys.stderr.write(f"kiln: ending rank {self.rank}: the job was aborted ({why.decode()})\n")
                sys.stderr.flush()
                if os.getppid() == rank_pid:
                    os.kill(rank_pid, signal.SIGKILL)
                return

    def _barrier(self) -> None:
        """Return once every rank has entered this barrier (the n-th of each rank); DistributedError
        when the job is aborted or the others do not come within the timeout."""
        self._barriers += 1
        key = f"{self.prefix}/barrier/{self._barriers}"
        if self.store.add(key, 1) == self.size:
            self.store.set(f"{key}/done", "1")
            return
        deadline = time.monotonic() + self.timeout
        while self.store.try_get(f"{key}/done") is None:
            if self.store.try_get(self.abort_key) is not None:
                raise DistributedError("the job was aborted")
            if time.monotonic() > deadline:
                raise DistributedError(f"not every rank reached PMI barrier {self._barriers} within {self.timeout:g} s")
            time.sleep(0.01)


def serve_mpi_init(env, timeout: float) -> None:
    """Before MPI_Init (the first import of mpi4py's MPI): fork this rank's PMI server and set the
    variables MPI_Init reads (PMI_VARIABLES). DistributedError when MPI is already initialised."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        raise DistributedError("MPI was initialised before kiln.distributed.init_process_group (something imported "
                               "mpi4py.MPI first), so it cannot learn this run's "
                               f"{env.world_size} ranks; call init_process_group first")
    mine, theirs = socket.socketpair()
    rank_pid = os.getpid()
    if os.fork() == 0:  # the server: pure Python, never MPI; it ends when this rank's MPI is done
        code = 1
        try:
            # a rank's SIGINT/SIGTERM is for the rank (kiln's trainer saves, then exits through
            # MPI_Finalize, which still needs this server); the server ends when its rank has
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            mine.close()
            from kiln.distributed.process_group import rendezvous_store
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            PMIServer(rendezvous_store(env, timeout), f"kiln/pmi/{attempt}", env.rank, env.world_size,
                      env.local_world_size, timeout).serve(theirs, rank_pid)
            code = 0
        except BaseException as e:  # noqa: BLE001 - report anything, then leave without the parent's atexit
            sys.stderr.write(f"kiln: the PMI server of rank {env.rank} failed: {type(e).__name__}: {e}\n")
        finally:
            sys.stderr.flush()
            os._exit(code)
    theirs.close()
    os.environ.update({"PMI_FD": str(mine.detach()), "PMI_RANK": str(env.rank), "PMI_SIZE": str(env.world_size)})
