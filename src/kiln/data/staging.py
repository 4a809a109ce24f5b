"""Host-to-device staging of token batches: the copy half of the paper's Algorithm 2.

A staging engine holds two slots. `put(slot, window)` starts moving one batch's B·T+1 tokens
(a view of the memory-mapped shard) to the device; `take(slot)` gives that batch as (x, y) int64
device arrays on kiln's compute stream. `ShardLoader` calls `put` for batch i+1 right after `take`
of batch i, so the next batch lands while this one trains.

`PinnedStaging` (§5 "Data Loader"): pinned host buffers, device buffers allocated once and kept,
an asynchronous copy on a dedicated copy stream, and two events per slot: `copied` (the copy
has landed; the compute stream waits on it before reading) and `consumed` (the compute stream is
done with the device buffer; the copy stream waits on it before overwriting). `SyncStaging` is
the fallback when pinned memory cannot be had: the same batches, copied on the compute stream
when they are taken, with no overlap. Both are written with the backend's stream, event, pinned
memory and copy verbs, so this module never touches a device library itself.
"""

from __future__ import annotations

import warnings

import numpy as np


def split_window(window, batch_size: int, seq_len: int):
    """(x, y), int64 arrays of shape (B, T), from B·T+1 tokens: y is x shifted by one.

    NumPy or CuPy alike: the one conversion of both devices, so CUDA batches equal CPU batches."""
    bt = batch_size * seq_len
    x = window[:bt].astype(np.int64).reshape(batch_size, seq_len)
    y = window[1:bt + 1].astype(np.int64).reshape(batch_size, seq_len)
    return x, y


class PinnedMemoryUnavailable(RuntimeError):
    """Page-locked host memory cannot be had: the loader falls back to SyncStaging."""


class PinnedStaging:
    """Two pinned host buffers, two device buffers, a copy stream and copied/consumed events."""

    synchronous = False

    def __init__(self, num_tokens: int, dtype, batch_size: int, seq_len: int, backend, device_index: int = 0):
        be = self.backend = backend
        self.shape, self.device_index = (batch_size, seq_len), device_index
        with be.on_device(device_index):
            self.compute_stream = be.stream()  # installs kiln's allocator before the buffers below
            try:
                self.host = [be.pinned_empty((num_tokens,), dtype) for _ in range(2)]
            except Exception as e:  # cudaErrorMemoryAllocation, a locked-memory limit, a driver refusal
                raise PinnedMemoryUnavailable(f"{type(e).__name__}: {e}") from e
            # Allocated once and referenced until close(): the caching allocator reuses a freed block
            # at once, which is safe only on kiln's stream, and these are written on the copy stream.
            self.dev = [be.empty((num_tokens,), dtype) for _ in range(2)]
            self.copy_stream = be.new_stream()
            self.copied = [be.event() for _ in range(2)]
            self.consumed = [be.event() for _ in range(2)]
        self._copy_issued = [False, False]
        self._consumed_recorded = [False, False]

    def put(self, slot: int, window: np.ndarray) -> None:
        """Copy the window into pinned slot `slot`, then start its H2D copy on the copy stream."""
        with self.backend.on_device(self.device_index):
            if self._copy_issued[slot]:
                # The host refills this pinned buffer only once the copy that read it (issued two
                # calls ago) has finished: a wait on a copy-stream event, not on the compute stream
                # (that copy followed the compute stream only up to the batch three calls ago).
                self.copied[slot].synchronize()
            np.copyto(self.host[slot], window)
            if self._consumed_recorded[slot]:
                self.copy_stream.wait_event(self.consumed[slot])  # Algorithm 2, line 12
            self.backend.copy_async(self.dev[slot], self.host[slot], self.copy_stream)
            self.copied[slot].record(self.copy_stream)  # line 23: h2d_done
            self._copy_issued[slot] = True

    def take(self, slot: int):
        """The batch in `slot` as (x, y) on the compute stream, once its copy has landed."""
        with self.backend.on_device(self.device_index):
            compute = self.backend.stream()  # kiln's stream, made current: split_window's kernels run on it
            compute.wait_event(self.copied[slot])  # line 14: the data has landed
            x, y = split_window(self.dev[slot], *self.shape)
            # x and y are fresh arrays on the compute stream, so the caller may keep them; the
            # device buffer is free again once these two conversions have run.
            self.consumed[slot].record(compute)  # line 11: consumer_done
            self._consumed_recorded[slot] = True
        return x, y

    def close(self) -> None:
        """Wait for copies in flight, so no buffer goes back to a pool while a copy writes it."""
        if getattr(self, "copy_stream", None) is not None:
            self.copy_stream.synchronize()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: CuPy may already be gone
            pass


class SyncStaging:
    """The fallback: no pinned memory, each batch copied on the compute stream when it is taken."""

    synchronous = True

    def __init__(self, num_tokens: int, dtype, batch_size: int, seq_len: int, backend, device_index: int = 0):
        self.backend = backend
        self.shape, self.device_index, self.dtype = (batch_size, seq_len), device_index, np.dtype(dtype)
        self._windows: list = [None, None]

    def put(self, slot: int, window: np.ndarray) -> None:
        self._windows[slot] = window  # a view of the memory-mapped shard; read at take()

    def take(self, slot: int):
        window, self._windows[slot] = self._windows[slot], None
        host = np.ascontiguousarray(window, dtype=self.dtype)
        with self.backend.on_device(self.device_index):
            compute = self.backend.stream()
            dev = self.backend.empty(host.shape, host.dtype)
            # From pageable memory on the compute stream: the host waits while the driver stages the
            # bytes, and the copy is ordered with kiln's work (no other stream touches `dev`).
            self.backend.copy_async(dev, host, compute)
            return split_window(dev, *self.shape)

    def close(self) -> None:
        pass


def open_staging(num_tokens: int, dtype, batch_size: int, seq_len: int, backend, device_index: int = 0,
                 pinned: bool = True, what: str = "ShardLoader"):
    """PinnedStaging, or SyncStaging when `pinned` is False or pinned memory cannot be had (said
    once, with a RuntimeWarning naming the reason); `backend` is the device's backend module."""
    if pinned:
        try:
            return PinnedStaging(num_tokens, dtype, batch_size, seq_len, backend, device_index)
        except PinnedMemoryUnavailable as e:
            warnings.warn(f"{what}: pinned host memory for 2 x {num_tokens} tokens cannot be had "
                          f"({e}); batches are copied synchronously on the compute "
                          "stream instead (the same batches, without overlap)", RuntimeWarning, stacklevel=3)
    return SyncStaging(num_tokens, dtype, batch_size, seq_len, backend, device_index)
