"""Asynchronous save: the step waits only while the state's copy to host memory is queued; a
background thread writes the file (the paper's "asynchronous staging path", Appendix B.14).

Device arrays are copied into pinned host buffers on a side stream, after the work already queued
on kiln's stream, and kiln's stream then waits for those copies on the GPU (the next step's AdamW
must not change an array mid-copy): the host never waits for the GPU, and the GPU pauses only for
the copy itself (1.49 GB for GPT-2 124M with AdamW: ~21 ms on the H200) when the next step's
kernels reach it first. The writer thread waits for the copies before it writes.

At most one save is in flight: the next one first waits for it. A background failure is kept and
raised by the next `check()` (the Trainer calls it every step), never swallowed.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kiln.backend import array_backend, is_device_array
from kiln.checkpoint.format import CheckpointError, save

_COPY_CHUNK = 32 * 1024 * 1024  # bytes: big copies split so every core helps


def to_host(state):
    """The tree with device arrays copied to host NumPy arrays and NumPy arrays as they are: what a
    synchronous save writes (the step is blocked anyway, so host arrays need no copy)."""
    if is_device_array(state):
        return array_backend(state).to_numpy(state)
    if isinstance(state, dict):
        return {k: to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [to_host(v) for v in state]
    return state


class HostStaging:
    """Host buffers for a state tree's arrays, kept from save to save.

    Fresh host memory costs a page fault per page at first touch, more than the copy itself, so
    each array's buffer is allocated once (pinned, for device arrays: the device-to-host copy then
    runs at full PCIe speed) and reused while the shapes stay the same (they do: section 3's
    static step)."""

    def __init__(self, threads: int | None = None):
        self._buffers: dict = {}
        self._side_stream = None  # the device-to-host copies' stream, made at the first device save
        self._pool = ThreadPoolExecutor(max_workers=threads or max(1, os.cpu_count() or 1),
                                        thread_name_prefix="kiln-ckpt-copy")

    def _buffer(self, key, a) -> np.ndarray:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
            if is_device_array(a):
                buf = array_backend(a).pinned_empty(a.shape, a.dtype)
            else:  # NumPy's allocation (transparent huge pages): fewer faults at the first copy
                buf = np.empty(a.shape, dtype=a.dtype)
            self._buffers[key] = buf
        return buf

    def snapshot(self, state):
        """(tree, ready): a copy of the tree whose arrays are host NumPy arrays that training no longer
        touches, complete once ready() returns (ready is None when nothing was left in flight)."""
        jobs, device_copies = [], []

        def walk(node, path):
            if isinstance(node, np.ndarray) or is_device_array(node):
                buf = self._buffer(path, node)
                (device_copies if is_device_array(node) else jobs).append((buf, node))
                return buf
            if isinstance(node, dict):
                return {k: walk(v, path + (k,)) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return [walk(v, path + (i,)) for i, v in enumerate(node)]
            return node

        tree = walk(state, ())
        ready = None
        if device_copies:
            # Device arrays: asynchronous copies into pinned buffers on the side stream, after the
            # work queued on kiln's stream; kiln's stream's later work waits for them (on the GPU).
            backend = array_backend(device_copies[0][1])
            main = backend.stream()
            if self._side_stream is None:
                self._side_stream = backend.new_stream()
            side = self._side_stream
            queued = backend.event()
            queued.record(main)
            side.wait_event(queued)
            for buf, a in device_copies:
                backend.copy_async(buf, a, side)
            copied = backend.event()
            copied.record(side)
            main.wait_event(copied)
            ready = copied.synchronize
        # NumPy arrays: chunked copies on all cores (np.copyto releases the GIL)
        pieces = []
        for buf, a in jobs:
            flat_dst, flat_src = buf.reshape(-1), np.ascontiguousarray(a).reshape(-1)
            step = max(1, _COPY_CHUNK // max(1, a.dtype.itemsize))
            pieces += [(flat_dst[i:i + step], flat_src[i:i + step]) for i in range(0, flat_src.size, step)]
        for fut in [self._pool.submit(np.copyto, d, s) for d, s in pieces]:
            fut.result()
        return tree, ready


class AsyncSaver:
    """Save state trees in the background, one at a time; `save` returns the seconds it stalled."""

    def __init__(self):
        self._staging = HostStaging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_path = None
        self.last_result: dict | None = None
        self.last_write_s: float | None = None  # seconds the last background write took
        self.last_wait_s: float | None = None  # of the last stall: seconds waiting for the save before it

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, path, state, on_done=None) -> float:
        """Snapshot `state` to host memory and write it to `path` on a background thread; then
        call on_done(result) there (e.g. to move the run folder's pointer). Waits first for a
        save still in flight (and raises its error)."""
        t0 = time.perf_counter()
        self.wait()
        self.last_wait_s = time.perf_counter() - t0
        host, ready = self._staging.snapshot(state)
        self._thread = threading.Thread(target=self._write, args=(path, host, ready, on_done),
                                        name="kiln-checkpoint-writer", daemon=False)
        self._thread.start()
        return time.perf_counter() - t0

    def _write(self, path, host, ready, on_done) -> None:
        try:
            if ready is not None:
                ready()  # the device-to-host copies have landed
            t0 = time.perf_counter()
            result = save(path, host)
            self.last_write_s = time.perf_counter() - t0
            if on_done is not None:
                on_done(result)
            self.last_result = result
        except BaseException as e:  # kept for check(): a background failure is never swallowed
            self._error, self._error_path = e, path

    def check(self) -> None:
        """Raise the error of a background save that failed since the last check."""
        if self._error is not None:
            error, path = self._error, self._error_path
            self._error = self._error_path = None
            if isinstance(error, CheckpointError):
                raise CheckpointError(f"the background save of {path} failed: {error}") from error
            raise CheckpointError(f"the background save of {path} failed: "
                                  f"{type(error).__name__}: {error}") from error

    def wait(self) -> None:
        """Block until no save is in flight, then raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
