"""NCCL communicators on device arrays (cupy.cuda.nccl), each running on its own comm stream.

The distributed layer's NCCL engine (kiln.distributed) calls these verbs; CuPy stays in the
backend. Every collective is ordered after the work already queued on kiln's compute stream by
an event (the comm stream waits on it), runs on the communicator's high-priority stream, and
returns an event recorded after it: `wait_event` makes the compute stream wait for it (Algorithm
1: stream-to-stream ordering, no host barrier), `event_done` asks without blocking. All of it
is capturable into a CUDA graph (the comm stream joins the capture through the first event).
"""

from __future__ import annotations

import numpy as np

from kiln.backend.cuda import device as rt
from kiln.backend.cuda.streams import event, new_stream
from kiln.errors import DistributedError, DTypeError

# ncclDataType_t and ncclRedOp_t values (nccl.h; stable across NCCL 2.x)
_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
           "float32": 7, "float64": 8, "bfloat16": 9}
_OPS = {"sum": 0, "max": 2, "avg": 4}


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise DistributedError(f"the nccl backend needs CuPy built with NCCL: {e}") from e
    if not getattr(nccl, "available", True):
        raise DistributedError("this CuPy has no NCCL (cupy.cuda.nccl.available is False)")
    return nccl


def version() -> int:
    return _nccl().get_version()


def use_device(index: int) -> None:
    """Make GPU `index` this process's device (rank r of a node drives GPU LOCAL_RANK); with one
    visible GPU (CUDA_VISIBLE_DEVICES set per rank) that one."""
    cp = rt.cupy()
    count = cp.cuda.runtime.getDeviceCount()
    if count == 1:
        index = 0
    if not 0 <= index < count:
        raise DistributedError(f"local rank {index} has no GPU: this node has {count}; start at most "
                               f"{count} ranks per node")
    cp.cuda.Device(index).use()


def unique_id() -> bytes:
    """A fresh ncclUniqueId (128 bytes), made by one rank and sent to the others."""
    return bytes(b & 0xFF for b in _nccl().get_unique_id())


def _datatype(array) -> int:
    code = _DTYPES.get(np.dtype(array.dtype).name)
    if code is None:
        raise DTypeError(f"NCCL has no {array.dtype}; allowed: {', '.join(_DTYPES)}")
    return code


def _check_contiguous(*arrays) -> None:
    for a in arrays:
        if not a.flags.c_contiguous:
            raise DistributedError("NCCL collectives need contiguous arrays")


class Communicator:
    """One rank's NCCL communicator of `world_size` ranks made from `uid`, on the current device."""

    def __init__(self, uid: bytes, world_size: int, rank: int):
        nccl = _nccl()
        rt.compute_stream()  # kiln's stream and allocator first
        try:
            try:  # CuPy 14 takes the id as bytes, older CuPy as a tuple of signed chars
                self._comm = nccl.NcclCommunicator(world_size, uid, rank)
            except TypeError:
                self._comm = nccl.NcclCommunicator(world_size, tuple(b - 256 if b > 127 else b for b in uid), rank)
        except Exception as e:  # NcclError
            raise DistributedError(f"NCCL communicator of {world_size} ranks (rank {rank}) failed: {e}") from e
        self.stream = new_stream(high_priority=True)  # collectives jump the compute stream's queue
        self.world_size, self.rank = world_size, rank
        self.aborted = False

    def _run(self, call):
        """Order after kiln's stream, run call(stream_ptr) on the comm stream; the event after it."""
        ready = event()
        ready.record(rt.stream())
        self.stream.wait_event(ready)
        try:
            call(self.stream.ptr)
        except Exception as e:
            raise DistributedError(f"NCCL call failed on rank {self.rank}: {e}") from e
        done = event()
        done.record(self.stream)
        return done

    def all_reduce(self, send, recv, op: str):
        _check_contiguous(send, recv)
        return self._run(lambda s: self._comm.allReduce(send.data.ptr, recv.data.ptr, send.size,
                                                        _datatype(send), _OPS[op], s))

    def reduce_scatter(self, send, recv, op: str):
        _check_contiguous(send, recv)
        return self._run(lambda s: self._comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size,
                                                            _datatype(send), _OPS[op], s))

    def reduce_scatter_all_gather(self, array, op: str):
        """array <- op over the ranks, in place: ncclReduceScatter into this rank's block of array,
        then ncclAllGather of the blocks, back to back on the comm stream (both in place, as NCCL
        allows: the block at rank * n). Every element is reduced as the same reduce-scatter of
        this layout reduces it (ZeRO's), which NCCL's own all-reduce does not promise."""
        _check_contiguous(array)
        n = array.size // self.world_size
        full, mine, dtype = array.data.ptr, array.data.ptr + self.rank * n * array.itemsize, _datatype(array)

        def call(s):
            self._comm.reduceScatter(full, mine, n, dtype, _OPS[op], s)
            self._comm.allGather(mine, full, n, dtype, s)
        return self._run(call)

    def all_gather(self, send, recv):
        _check_contiguous(send, recv)
        return self._run(lambda s: self._comm.allGather(send.data.ptr, recv.data.ptr, send.size,
                                                        _datatype(send), s))

    def broadcast(self, array, root: int):
        _check_contiguous(array)
        return self._run(lambda s: self._comm.broadcast(array.data.ptr, array.data.ptr, array.size,
                                                        _datatype(array), root, s))

    def send(self, array, peer: int):
        _check_contiguous(array)
        return self._run(lambda s: self._comm.send(array.data.ptr, array.size, _datatype(array), peer, s))

    def recv(self, array, peer: int):
        _check_contiguous(array)
        return self._run(lambda s: self._comm.recv(array.data.ptr, array.size, _datatype(array), peer, s))

    def send_recv(self, send, dst: int, recv, src: int):
        """One grouped send and receive (ncclGroupStart/End): a ring step that cannot deadlock."""
        _check_contiguous(send, recv)
        nccl = _nccl()

        def call(s):
            nccl.groupStart()
            try:
                self._comm.send(send.data.ptr, send.size, _datatype(send), dst, s)
                self._comm.recv(recv.data.ptr, recv.size, _datatype(recv), src, s)
            finally:
                nccl.groupEnd()
        return self._run(call)

    def all_to_all(self, send, recv):
        """recv's block j <- rank j's send block (this rank): grouped sends and receives."""
        _check_contiguous(send, recv)
        nccl = _nccl()
        n = send.size // self.world_size
        step = n * send.itemsize
        s_ptr, r_ptr, dtype = send.data.ptr, recv.data.ptr, _datatype(send)

        def call(s):
            nccl.groupStart()
            try:
                for peer in range(self.world_size):
                    self._comm.send(s_ptr + peer * step, n, dtype, peer, s)
                    self._comm.recv(r_ptr + peer * step, n, dtype, peer, s)
            finally:
                nccl.groupEnd()
        return self._run(call)

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of this communicator (a peer that died, a network fault), if any."""
        try:
            self._comm.check_async_error()
        except _nccl().NcclError as e:
            return str(e)
        return None

    def abort(self) -> None:
        """Tear the communicator down without waiting for peers (ncclCommAbort): stuck kernels exit.
        Once: a watchdog, an exit handler and the launcher's abort may each ask."""
        if not self.aborted:
            self.aborted = True
            self._comm.abort()

    def destroy(self) -> None:
        self._comm.destroy()


def wait_event(event) -> None:
    """kiln's compute stream waits for event (GPU-side; the host does not block)."""
    rt.stream().wait_event(event)


def event_done(event) -> bool:
    """True once the work before event has run."""
    return event.done
