"""Streams, events, pinned host buffers and asynchronous copies on the GPU: the backend verbs that
the loader's staging (Algorithm 2), asynchronous checkpoints, the profiler and the distributed
layer's communication stream (Algorithm 1) are written with, once for both devices.

The CPU backend has the same verbs (`kiln.backend.cpu.streams`): no-op streams and events, plain
copies. Streams and events here are CuPy's own objects: `event.record(stream)`,
`stream.wait_event(event)`, `event.synchronize()`, `event.done`, `stream.synchronize()`.
"""

from __future__ import annotations

import contextlib

from kiln.backend.cuda import device as rt


def new_stream(high_priority: bool = False):
    """A new non-blocking stream on the current device (never ordered with the legacy null stream);
    `high_priority`: the device's greatest priority, so that short work on it (a collective) is
    scheduled ahead of the compute stream's queued kernels."""
    cp = rt.cupy()
    rt.compute_stream()  # kiln's allocator is installed before any stream work
    # CUDA clamps a priority beyond the device's range to its greatest (lower numbers run first)
    return cp.cuda.Stream(non_blocking=True, priority=-1000 if high_priority else 0)


@contextlib.contextmanager
def use_stream(stream):
    """Run kiln's kernels, GEMMs and CuPy's own ops issued inside the block on `stream` (in this
    thread), then go back to the stream that was in use. Memory allocated inside and freed after
    must be ordered with events by the caller: the caching allocator assumes one stream. `stream`
    is pushed onto CuPy's stream stack (kiln.backend.cuda.device), so that a CuPy `with` block
    inside comes back to it, not to the stream below."""
    previous = getattr(rt._current, "stream", None)
    rt.compute_stream()
    rt._current.stream = stream
    try:
        with stream:
            yield stream
    finally:
        rt._current.stream = previous
        rt.stream()  # makes the previous stream current again


def event(timing: bool = False):
    """A CUDA event; `timing=True` for one that `elapsed_ms` can measure between (costlier to record)."""
    return rt.cupy().cuda.Event(disable_timing=not timing)


def elapsed_ms(start, end) -> float:
    """Milliseconds between two recorded timing events (waits for `end`)."""
    cp = rt.cupy()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)


def pinned_empty(shape, dtype):
    """A page-locked host NumPy array: device copies from and to it run asynchronously, at full
    PCIe speed. Raises what the driver raises when none can be had (a locked-memory limit)."""
    import cupyx
    return cupyx.empty_pinned(shape, dtype=dtype)


def copy_async(dst, src, stream=None) -> None:
    """dst[...] = src, queued on `stream` (default: the stream in use), host to device, device to
    host or device to device. Asynchronous when the host side is pinned; the host array must stay
    untouched until an event recorded after it on `stream` has completed."""
    cp = rt.cupy()
    stream = stream if stream is not None else rt.stream()
    dst_on_device, src_on_device = isinstance(dst, cp.ndarray), isinstance(src, cp.ndarray)
    if dst_on_device and not src_on_device:
        dst.set(src, stream=stream)
    elif src_on_device and not dst_on_device:
        src.get(stream=stream, out=dst, blocking=False)
    elif src_on_device and dst_on_device:
        with stream:
            cp.copyto(dst, src)
    else:
        raise TypeError("copy_async moves data between host and device; both arrays are on the host")


def on_device(index: int):
    """A context in which the current device is GPU `index` (streams and buffers are made there)."""
    return rt.cupy().cuda.Device(index)
