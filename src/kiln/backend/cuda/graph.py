"""CUDA graph capture and replay on kiln's stream (the backend half of kiln.graph).

`capture(fn)` records everything `fn` queues on kiln's stream into one CUDA graph instead of
running it; `launch(graph)` replays it. The caching allocator serves the capture from a
GraphPool of its own, so the addresses the graph recorded stay reserved for it (allocator.py).
"""

from __future__ import annotations

import gc
import traceback
import weakref

from kiln.backend.cuda import allocator, device as rt
from kiln.errors import GraphCaptureError


class CapturedGraph:
    """An instantiated CUDA graph, the allocator pool its memory lives in, and fn's result.

    Dropped without release() (a CapturedStep that goes out of scope), its pool still returns to
    the allocator when the object is collected: nothing can replay it then, and a replay still
    running is ordered before any later eager work on kiln's one stream."""

    def __init__(self, graph, pool, result):
        self.graph, self.pool, self.result = graph, pool, result
        alloc = allocator.installed()
        self._finalizer = weakref.finalize(self, alloc.release_pool, pool) if alloc is not None else None

    def launch(self) -> None:
        self.graph.launch(stream=rt.stream())

    def release(self) -> None:
        """Drop the graph; its memory goes back to the allocator's eager cache."""
        if self.graph is not None:
            rt.stream().synchronize()
            self.graph = None
            if self._finalizer is not None:
                self._finalizer()  # release_pool, once


def capture(fn) -> CapturedGraph:
    """Record fn() on kiln's stream as a CUDA graph (nothing runs until launch); fn's result rides along."""
    alloc = allocator.installed()
    if alloc is None:
        raise GraphCaptureError("CUDA graph capture needs kiln's caching allocator "
                                "(KILN_CUDA_ALLOCATOR=cupy turns it off)")
    s = rt.stream()
    s.synchronize()
    # The eager cache goes back to the driver first: a capture cannot return it (cudaFree and
    # cudaDeviceSynchronize are refused while a stream captures), and cached segments too small for
    # the graph's requests would hold a full device (the 76-layer fp32 model) while the capture runs
    # out. Only segments with live blocks stay (the capture may take their free parts); the rest of
    # what the graph needs is new cudaMallocs, which the relaxed capture mode allows.
    alloc.release_unused()
    pool = allocator.GraphPool()
    failure = None
    with alloc.capture_into(pool):
        s.begin_capture()
        try:
            result = fn()
        except BaseException as e:
            failure = e
        try:  # also after fn failed: the stream must leave capture mode
            # A side stream that never joined back (cudaErrorStreamCaptureUnjoined) is reported here only
            graph = s.end_capture()
        except BaseException as e:
            failure = failure or e  # after fn's failure, the invalidated capture's error says nothing new
        if failure is not None:
            # What the failed step allocated (its activations, its gradients) is held by the
            # traceback's frames, some in reference cycles: free it now, into the pool, which the
            # eager cache gets below. Left to a later collection, the step that runs op by op after
            # the failure found the device full (the 76-layer fp32 model OOMed so on the H200).
            traceback.clear_frames(failure.__traceback__)
            gc.collect()
    if failure is None:
        try:
            graph.upload(stream=s)
        except BaseException as e:
            failure = e
    if failure is not None:
        # No CapturedGraph will release this pool, so its segments would stay reserved for good. It is
        # released after capture_into has left: a free arriving while the pool is still the capture's
        # (a collection, another thread) would move an eager block into the released pool.
        alloc.release_pool(pool)
        result = None  # a step that ran but did not record: its outputs go now, not with the error
        try:
            if not isinstance(failure, Exception):
                raise failure  # Ctrl-C, an exit: the run stops, it does not go on op by op
            raise GraphCaptureError(f"recording the step as a CUDA graph failed: {type(failure).__name__}: "
                                    f"{failure}. Something in the step synchronises with the host or cannot be "
                                    "captured; run it without the graph (cuda_graph=False)") from failure
        finally:
            # This frame holding its own failure is a cycle (frame -> failure -> traceback -> frame)
            # that kept the frames above it, and what they hold (CapturedStep's copies of the inputs),
            # until a collection, long after the caller had handled the error.
            del failure
    return CapturedGraph(graph, pool, result)
