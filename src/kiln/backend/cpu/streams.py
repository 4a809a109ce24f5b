"""The CPU's streams, events, pinned buffers and copies: the verbs of `kiln.backend.cuda.streams`
where every kernel has run to completion when it returns, so that code written with them (the
loader's staging, asynchronous checkpoints, the profiler, a communication stream) runs unchanged
on the CPU. Streams and events order nothing; a timing event records the host clock.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np


class HostStream:
    """A stream of work that has always finished."""

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def use(self) -> None:
        pass


class HostEvent:
    """An event that is complete once recorded; it keeps the host time of its recording."""

    def __init__(self, timing: bool = False):
        self.timing, self.time = timing, None

    def record(self, stream=None) -> None:
        if self.timing:
            self.time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return True


_STREAM = HostStream()


def stream() -> HostStream:
    """The stream kiln's work goes to (one, since work on the host runs where it is called)."""
    return _STREAM


def new_stream(high_priority: bool = False) -> HostStream:
    return HostStream()


@contextlib.contextmanager
def use_stream(stream):
    yield stream


def event(timing: bool = False) -> HostEvent:
    return HostEvent(timing)


def elapsed_ms(start: HostEvent, end: HostEvent) -> float:
    """Milliseconds of host time between two recorded timing events."""
    if start.time is None or end.time is None:
        raise ValueError("elapsed_ms needs two timing events (event(timing=True)) that were recorded")
    return 1000.0 * (end.time - start.time)


def pinned_empty(shape, dtype) -> np.ndarray:
    """Host memory (there is no device to pin it for)."""
    return np.empty(shape, dtype=dtype)


def copy_async(dst, src, stream=None) -> None:
    """dst[...] = src, done when it returns."""
    np.copyto(dst, src)


def on_device(index: int):
    return contextlib.nullcontext()
