"""The NCCL engine: collectives on CUDA arrays through the backend's NCCL communicator.

Each collective runs on the communicator's high-priority comm stream, ordered after kiln's
compute stream by an event, and returns a Work holding the event recorded after it; waiting
on the Work makes the compute stream wait on that event (no host block), so a step that uses
it can be captured as one CUDA graph. The host blocks only in `Work.synchronize()`, polling
the event and NCCL's async error against the deadline, then ncclCommAbort (DESIGN.md). Since
a host blocked elsewhere (`loss.item()` behind a collective that never ends) would wait forever,
a watchdog thread checks every eager collective in flight the same way, and on a timeout or an
NCCL error aborts the communicator and ends the process (as torch's NCCL watchdog does).
Collectives replayed inside a CUDA graph are not watched (their events belong to the graph).

The communicator's unique id, and the agreement on sub-groups, travel over a host channel:
MPI when the run is under mpiexec, else the rendezvous store (`StoreChannel`).
"""

from __future__ import annotations

import json
import os
import threading
import time

from kiln.distributed.work import Work, fail
from kiln.errors import DistributedError


class StoreChannel:
    """exchange() over the rendezvous store for `ranks` (global ranks; this process is `rank`)."""

    def __init__(self, store, prefix: str, rank: int, size: int, timeout: float):
        self.store, self.prefix, self.rank, self.size, self.timeout = store, prefix, rank, size, timeout
        self._round = 0

    def exchange(self, obj) -> list:
        self._round += 1
        base = f"{self.prefix}/x{self._round}"
        self.store.set(f"{base}/{self.rank}", json.dumps(obj))
        return [json.loads(self.store.get(f"{base}/{r}", self.timeout)) for r in range(self.size)]

    def sub(self, name: str, rank: int, size: int) -> StoreChannel:
        return StoreChannel(self.store, f"{self.prefix}/{name}", rank, size, self.timeout)


class SelfChannel:
    """exchange() in a world of one: nothing to send."""

    def exchange(self, obj) -> list:
        return [obj]

    def sub(self, name: str, rank: int, size: int) -> SelfChannel:
        return self


class MPIChannel:
    """exchange() over an MPI communicator (mpi4py's pickled allgather)."""

    def __init__(self, comm):
        self.comm = comm

    def exchange(self, obj) -> list:
        return self.comm.allgather(obj)

    def sub(self, name: str, rank: int, size: int):
        raise AssertionError("MPI channels split with the communicator")


class NCCLEngine:
    device_type = "cuda"

    def __init__(self, channel, rank: int, size: int, timeout: float):
        from kiln.backend.cuda import nccl
        self.nccl, self.channel = nccl, channel
        self.rank, self.size, self.timeout = rank, size, float(timeout)
        self.broken = False
        uid = nccl.unique_id() if rank == 0 else None
        if size > 1:
            uid = bytes.fromhex(channel.exchange(uid.hex() if uid is not None else None)[0])
        self.comm = nccl.Communicator(uid, size, rank)
        self._splits = 0
        self._inflight: list = []  # (event, start, what) of eager collectives, for the watchdog
        self._lock = threading.Lock()
        if size > 1:
            threading.Thread(target=self._watch, name="kiln-nccl-watchdog", daemon=True).start()

    def _work(self, what: str, launch, *operands) -> Work:
        if self.broken:
            raise DistributedError(f"rank {self.rank}: this process group failed before; it cannot run {what}")
        event = launch()
        from kiln.graph import capturing
        if not capturing():
            with self._lock:
                self._inflight.append((event, time.monotonic(), what))
        return Work(self, what, lambda: self.nccl.event_done(event), event=event, keep=operands)

    def _watch(self) -> None:
        from kiln.graph import capturing
        while not self.broken:
            time.sleep(min(1.0, self.timeout / 10))
            if capturing():  # no device queries while a graph records
                continue
            error = self.comm.async_error()
            now = time.monotonic()
            with self._lock:
                self._inflight = [w for w in self._inflight if not self.nccl.event_done(w[0])]
                late = next((w for w in self._inflight if now - w[1] > self.timeout), None)
            if error is None and late is None:
                continue
            message = f"rank {self.rank} of {self.size}: " + (
                f"NCCL reported an error: {error}" if error is not None else
                f"{late[2]} did not complete within {self.timeout:g} s: a peer rank is dead or stalled")
            fail(self, message + "; aborting NCCL and exiting")
            self.comm.abort()
            os._exit(1)

    def all_reduce(self, array, op: str) -> Work:
        return self._work(f"all_reduce({op}) of {array.size} {array.dtype}",
                          lambda: self.comm.all_reduce(array, array, op), array)

    def reduce_scatter(self, output, input, op: str) -> Work:
        return self._work(f"reduce_scatter({op}) of {input.size} {input.dtype}",
                          lambda: self.comm.reduce_scatter(input, output, op), output, input)

    def reduce_scatter_all_gather(self, array, op: str) -> Work:
        return self._work(f"reduce_scatter_all_gather({op}) of {array.size} {array.dtype}",
                          lambda: self.comm.reduce_scatter_all_gather(array, op), array)

    def all_gather(self, output, input) -> Work:
        return self._work(f"all_gather of {input.size} {input.dtype}", lambda: self.comm.all_gather(input, output),
                          output, input)

    def broadcast(self, array, src: int) -> Work:
        return self._work(f"broadcast from {src} of {array.size} {array.dtype}",
                          lambda: self.comm.broadcast(array, src), array)

    def send(self, array, dst: int) -> Work:
        return self._work(f"send to {dst} of {array.size} {array.dtype}", lambda: self.comm.send(array, dst), array)

    def recv(self, array, src: int) -> Work:
        return self._work(f"recv from {src} of {array.size} {array.dtype}", lambda: self.comm.recv(array, src), array)

    def send_recv(self, send, dst: int, recv, src: int) -> Work:
        return self._work(f"send_recv of {send.size} {send.dtype} to {dst}, from {src}",
                          lambda: self.comm.send_recv(send, dst, recv, src), send, recv)

    def all_to_all(self, output, input) -> Work:
        return self._work(f"all_to_all of {input.size} {input.dtype}", lambda: self.comm.all_to_all(input, output),
                          output, input)

    def barrier(self) -> Work:
        from kiln.backend import get_backend
        token = get_backend("cuda").zeros((1,), "float32")
        work = self.all_reduce(token, "sum")
        work.synchronize()
        return work

    def exchange(self, obj) -> list:
        return self.channel.exchange(obj)

    def split(self, color, key: int):
        """The engine of this rank's new group (None for color None): ranks of one color, by key."""
        self._splits += 1
        mine = self.channel.exchange([color, key])
        sub = None
        if isinstance(self.channel, MPIChannel):
            sub = self.channel.comm.Split(_mpi_undefined() if color is None else color, key)
        if color is None:
            return None
        ranks = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(mine) if c == color)]
        rank = ranks.index(self.rank)
        channel = MPIChannel(sub) if sub is not None else \
            self.channel.sub(f"s{self._splits}c{color}", rank, len(ranks))
        return NCCLEngine(channel, rank, len(ranks), self.timeout)

    def error(self):
        return self.comm.async_error()

    def timed_out(self, what: str) -> DistributedError:
        return fail(self, f"rank {self.rank} of {self.size}: {what} did not complete within "
                          f"{self.timeout:g} s: a peer rank is dead or stalled (the timeout is "
                          "init_process_group(timeout=) or KILN_DIST_TIMEOUT); aborting NCCL")

    def order_after(self, work) -> None:
        self.nccl.wait_event(work.event)

    def abort(self, job: bool = True) -> None:
        """ncclCommAbort; job: end the MPI job too when the ranks are MPI's."""
        self.comm.abort()
        if job and isinstance(self.channel, MPIChannel):
            self.channel.comm.Abort(1)


def _mpi_undefined():
    from mpi4py import MPI
    return MPI.UNDEFINED
