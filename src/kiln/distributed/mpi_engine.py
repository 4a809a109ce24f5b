"""The MPI engine: collectives on CPU (NumPy) arrays through mpi4py, started by `mpiexec`.

Every collective is MPI's non-blocking form (Iallreduce, Ialltoall, ...), so a `Work` can poll
it against the group's deadline: a dead or stalled peer becomes a clear DistributedError on every
rank still running within the timeout, and MPI_Abort at exit tears the job down
(kiln.distributed.work.fail). Without mpiexec, MPI starts as a singleton: world 1.

The reduce-scatter sums in one fixed order, rank 0's block first: MPI's own (MPICH's pairwise
exchange for large messages) sums an element in an order that depends on which rank owns it,
so DDP's buckets, ZeRO's shards and FSDP's units, which put the same gradient at different
places, would differ in the last bits. Here MPI moves the blocks (Ialltoall) and each rank adds
the W blocks it received in rank order: a gradient element gets the same bits in every layout.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kiln.distributed.work import Work, fail
from kiln.errors import DistributedError, DTypeError

REDUCIBLE = ("float32", "float64", "int8", "uint8", "int32", "int64")


def mpi():
    """mpi4py's MPI module (initialises MPI at first use)."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistributedError(f"the mpi backend needs mpi4py and an MPI: pip install 'kiln[dist]' ({e})") from e
    return MPI


def _reducible(array) -> np.ndarray:
    if np.dtype(array.dtype).name not in REDUCIBLE:
        raise DTypeError(f"MPI cannot reduce {array.dtype}; allowed: {', '.join(REDUCIBLE)} "
                         "(cast first, or use the nccl backend on a GPU)")
    return array


def _bytes(array) -> np.ndarray:
    """The array's memory as bytes: MPI moves any dtype (bfloat16 too) when nothing is reduced."""
    return array.reshape(-1).view(np.uint8)


class MPIEngine:
    device_type = "cpu"

    def __init__(self, comm, timeout: float):
        self.comm, self.timeout = comm, float(timeout)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.broken = False
        # reduce_scatter_all_gather's all-gathers start when their reduce-scatter is done, which the
        # host learns at different moments on different ranks: they run on a communicator of their
        # own, launched in the order of their reduce-scatters (MPI: one order of collectives per
        # communicator on every rank)
        self._gather_comm = comm.Dup()
        self._chains: deque = deque()

    def _work(self, what: str, request, finish=None) -> Work:
        if self.broken:
            raise DistributedError(f"rank {self.rank}: this process group failed before; it cannot run {what}")
        return Work(self, what, request.Test, finish)

    def _op(self, op: str):
        MPI = mpi()
        return {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}[op]

    def all_reduce(self, array, op: str) -> Work:
        MPI = mpi()
        req = self.comm.Iallreduce(MPI.IN_PLACE, _reducible(array), op=self._op(op))
        finish = (lambda: np.divide(array, self.size, out=array, casting="unsafe")) if op == "avg" else None
        return self._work(f"all_reduce({op}) of {array.size} {array.dtype}", req, finish)

    def reduce_scatter(self, output, input, op: str) -> Work:
        """output <- op of every rank's block `rank` of input, summed in rank order (see above).
        output may be input's own block (in place)."""
        blocks = np.empty((self.size, output.size), dtype=_reducible(input).dtype)
        req = self.comm.Ialltoall(_bytes(input), _bytes(blocks))

        def finish():
            flat = output.reshape(-1)
            if op == "max":
                np.max(blocks, axis=0, out=flat)
                return
            flat[...] = blocks[0]
            for block in blocks[1:]:
                flat += block
            if op == "avg":
                np.divide(flat, self.size, out=flat, casting="unsafe")
        return self._work(f"reduce_scatter({op}) of {input.size} {input.dtype}", req, finish)

    def reduce_scatter_all_gather(self, array, op: str) -> Work:
        """array <- op over every rank's array, in place: reduce_scatter of its W equal blocks into
        this rank's block, then an all-gather of the blocks."""
        n = array.size // self.size
        flat = array.reshape(-1)
        mine = flat[self.rank * n:(self.rank + 1) * n]
        in_place = mpi().IN_PLACE  # this rank's block of flat is already in place
        chain = _Chain(self.reduce_scatter(mine, flat, op), lambda: self._gather_comm.Iallgather(in_place, _bytes(flat)))
        self._chains.append(chain)

        def test() -> bool:
            while self._chains and self._chains[0].first.is_completed():
                self._chains.popleft().start_second()
            return chain.second is not None and chain.second.Test()
        return self._work(f"reduce_scatter_all_gather({op}) of {array.size} {array.dtype}", _Polled(test))

    def all_gather(self, output, input) -> Work:
        req = self.comm.Iallgather(_bytes(input), _bytes(output))
        return self._work(f"all_gather of {input.size} {input.dtype}", req)

    def broadcast(self, array, src: int) -> Work:
        req = self.comm.Ibcast(_bytes(array), root=src)
        return self._work(f"broadcast from {src} of {array.size} {array.dtype}", req)

    def send(self, array, dst: int) -> Work:
        return self._work(f"send to {dst} of {array.size} {array.dtype}", self.comm.Isend(_bytes(array), dest=dst))

    def recv(self, array, src: int) -> Work:
        return self._work(f"recv from {src} of {array.size} {array.dtype}", self.comm.Irecv(_bytes(array), source=src))

    def send_recv(self, send, dst: int, recv, src: int) -> Work:
        reqs = [self.comm.Isend(_bytes(send), dest=dst), self.comm.Irecv(_bytes(recv), source=src)]
        return self._work(f"send_recv of {send.size} {send.dtype} to {dst}, from {src}", _Both(reqs))

    def all_to_all(self, output, input) -> Work:
        req = self.comm.Ialltoall(_bytes(input), _bytes(output))
        return self._work(f"all_to_all of {input.size} {input.dtype}", req)

    def barrier(self) -> Work:
        return self._work("barrier", self.comm.Ibarrier())

    def exchange(self, obj) -> list:
        """Every rank's obj (small, picklable), in rank order: for agreeing on sub-groups and ids."""
        return self.comm.allgather(obj)

    def split(self, color, key: int):
        MPI = mpi()
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else MPIEngine(sub, self.timeout)

    def error(self):
        return None  # MPI reports a failed peer by aborting the job; a stalled one by our timeout

    def timed_out(self, what: str) -> DistributedError:
        return fail(self, f"rank {self.rank} of {self.size}: {what} did not complete within "
                          f"{self.timeout:g} s: a peer rank is dead or stalled (the timeout is "
                          "init_process_group(timeout=) or KILN_DIST_TIMEOUT); aborting the job")

    def order_after(self, work) -> None:  # CPU work is complete when waited
        raise AssertionError("MPI work has no event")

    def abort(self, job: bool = True) -> None:
        """MPI_Abort of the job (job False: nothing; an MPI communicator ends with its process)."""
        if job:
            mpi().COMM_WORLD.Abort(1)


class _Chain:
    """A collective (a Work) and the MPI request that starts once it is complete."""

    def __init__(self, first: Work, start):
        self.first, self.start, self.second = first, start, None

    def start_second(self) -> None:
        self.second = self.start()


class _Polled:
    """A request-like object whose Test() is a function."""

    def __init__(self, test):
        self.Test = test


class _Both:
    """Requests that complete together: Test() is true once all of them are."""

    def __init__(self, requests):
        self.requests = requests

    def Test(self) -> bool:
        from mpi4py import MPI
        return MPI.Request.Testall(self.requests)
