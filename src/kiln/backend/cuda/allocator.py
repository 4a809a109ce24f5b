"""kiln's caching block-pool allocator for CuPy, with a rounding learned from the first steps.

After the paper's "Custom Caching Allocator": no fixed size classes. During a warm-up window
(the first step, or however long the caller lets it run) every request size is recorded as
an alloc/free trace. `end_warmup()` replays the trace under candidate roundings (one
granularity for small requests, one for large ones) and keeps the one that would have held
the fewest bytes from the driver, i.e. minimises wasted bytes: coarse rounding wastes bytes
inside blocks, fine rounding wastes whole cached blocks that no later request fits. It then
returns what step 0 alone needed to the driver ("targeted cache flush following the 0th
step"). A block is reused only by a request of the same rounded size, so a static training
step finds its blocks again every step and the pool stops growing.

Every block is one cudaMalloc (256-byte aligned), cached on free and reused at once: safe
because all of kiln's work is ordered on its one stream (device.stream()). Memory handed to
another stream (NCCL, a copy stream) must be ordered with events by its user.

A captured CUDA graph replays into the addresses it was recorded with, long after Python
freed them. So while a graph is captured (`capture_into(pool)`) every block allocated or
freed belongs to that GraphPool: a block freed during capture is reused only by later
requests of the same capture, never by eager work, and the pool's blocks stay reserved
until the graph is dropped (`release_pool`). A buffer the host writes between replays (a
scalar the next replay reads) must not be one of those recycled blocks: the graph's own
temporaries overwrite them during every replay. It is allocated under `host_written()`, from
the eager cache, which the graph never touches.
The bookkeeping is pure Python with injectable driver calls, so CPU tests can check it.
"""

from __future__ import annotations

import contextlib
import threading

from kiln.errors import KilnError

SMALL_GRANULARITIES = (512, 1024, 2048, 4096, 8192, 16384, 65536)
LARGE_GRANULARITIES = (512, 4096, 65536, 131072, 524288, 1 << 21, 1 << 22)
LARGE_THRESHOLD = 1 << 20
MAX_TRACE_EVENTS = 1 << 21


class OutOfMemoryError(KilnError):
    """The device has no memory left for a request, even after the cache was returned to the driver."""


class Rounding:
    """round(size) = size rounded up to `small` bytes below `threshold`, to `large` bytes from it on."""

    __slots__ = ("small", "large", "threshold")

    def __init__(self, small: int = 512, large: int = 131072, threshold: int = LARGE_THRESHOLD):
        for name, g in (("small", small), ("large", large)):
            if g < 1 or g & (g - 1):
                raise KilnError(f"allocator {name} granularity must be a power of two >= 1, got {g}")
        self.small, self.large, self.threshold = int(small), int(large), int(threshold)

    def __call__(self, size: int) -> int:
        g = self.small if size < self.threshold else self.large
        return max(g, -(-int(size) // g) * g)

    def as_dict(self) -> dict:
        return {"small": self.small, "large": self.large, "threshold": self.threshold}

    def __repr__(self) -> str:
        return f"Rounding(small={self.small}, large={self.large}, threshold={self.threshold})"


def simulate(trace, rounding) -> dict:
    """Replay an alloc/free trace through an exact-class block pool; what it would hold.

    trace: ("alloc", id, size) and ("free", id, 0) events. Returns reserved (bytes taken from
    the driver, which never shrinks), peak_requested, peak_allocated and blocks.
    """
    free: dict = {}
    live: dict = {}
    reserved = requested = allocated = peak_req = peak_alloc = blocks = 0
    for kind, ident, size in trace:
        if kind == "alloc":
            r = rounding(size)
            if free.get(r):
                free[r] -= 1
            else:
                reserved += r
                blocks += 1
            live[ident] = (r, size)
            requested += size
            allocated += r
            peak_req = max(peak_req, requested)
            peak_alloc = max(peak_alloc, allocated)
        else:
            got = live.pop(ident, None)
            if got is None:
                continue  # freed a block allocated before the trace began
            r, s = got
            free[r] = free.get(r, 0) + 1
            requested -= s
            allocated -= r
    return {"reserved": reserved, "peak_requested": peak_req, "peak_allocated": peak_alloc,
            "blocks": blocks}


def choose_rounding(trace, smalls=SMALL_GRANULARITIES, larges=LARGE_GRANULARITIES,
                    threshold: int = LARGE_THRESHOLD):
    """(Rounding, report) minimising the bytes the trace would reserve; ties go to coarser rounding."""
    best = None
    for s in smalls:
        for g in larges:
            r = Rounding(s, g, threshold)
            sim = simulate(trace, r)
            score = (sim["reserved"], -s, -g)
            if best is None or score < best[0]:
                best = (score, r, sim)
    if best is None:
        return Rounding(), {}
    _, r, sim = best
    return r, {**sim, "wasted": sim["reserved"] - sim["peak_requested"]}


class GraphPool:
    """The blocks a captured graph owns: its free list (reused only inside its capture) and all of them."""

    def __init__(self):
        self.free: dict = {}     # (device, rounded size) -> [ptr]
        self.blocks: dict = {}   # ptr -> (device, rounded size)

    @property
    def reserved_bytes(self) -> int:
        return sum(r for _, r in self.blocks.values())


class CachingAllocator:
    """Exact-size block pools over injectable driver malloc/free (cudaMalloc/cudaFree by default)."""

    def __init__(self, driver_malloc=None, driver_free=None, rounding: Rounding | None = None,
                 record: bool = True, driver_sync=None):
        self._driver_malloc = driver_malloc or _cuda_malloc
        self._driver_free = driver_free or _cuda_free
        self._driver_sync = driver_sync or (_cuda_sync if driver_malloc is None else (lambda: None))
        self.rounding = rounding or Rounding()
        self._lock = threading.RLock()
        self._depth = 0  # how many locked sections the lock's holder is inside (see _locked)
        self._draining = False  # the outermost section is running the deferred calls
        self._deferred: list = []  # frees and pool releases asked for by finalizers inside a locked section
        self._free: dict = {}   # (device, rounded size) -> [ptr]
        self._live: dict = {}   # ptr -> (device, rounded size, requested size, trace id)
        self._trace = [] if record else None
        self._capturing: GraphPool | None = None
        self._pools: list = []  # pools of graphs that can still be replayed
        self._next_id = 0
        self.learned: dict | None = None
        self.observers: list = []  # callables (event, ptr, requested size, rounded size): the profiler's timeline
        self._stats = dict.fromkeys(("allocated_bytes", "requested_bytes", "reserved_bytes",
                                     "peak_allocated_bytes", "peak_requested_bytes", "peak_reserved_bytes",
                                     "num_allocs", "num_frees", "num_driver_mallocs", "num_driver_frees",
                                     "num_ooms"), 0)

    # CuPy's PythonFunctionAllocator calls malloc(size, device_id) -> ptr and free(ptr, device_id).
    def malloc(self, size: int, device_id: int = 0) -> int:
        size = int(size)
        with self._locked():
            r = self.rounding(size)
            graph = self._capturing
            pool = graph.free.get((device_id, r)) if graph is not None else None
            if not pool:
                pool = self._free.get((device_id, r))
            if pool:
                ptr = pool.pop()
            else:
                ptr = self._grow(r, size, device_id)
            if graph is not None:
                graph.blocks[ptr] = (device_id, r)
            ident = None
            if self._trace is not None:
                ident = self._next_id
                self._next_id += 1
                self._trace.append(("alloc", ident, size))
                if len(self._trace) >= MAX_TRACE_EVENTS:
                    self._trace = None  # end_warmup never came: keep the sizes bounded
            self._live[ptr] = (device_id, r, size, ident)
            for observer in self.observers:
                observer("alloc", ptr, size, r)
            st = self._stats
            st["num_allocs"] += 1
            st["allocated_bytes"] += r
            st["requested_bytes"] += size
            st["peak_allocated_bytes"] = max(st["peak_allocated_bytes"], st["allocated_bytes"])
            st["peak_requested_bytes"] = max(st["peak_requested_bytes"], st["requested_bytes"])
            return ptr

    def free(self, ptr: int, device_id: int = 0) -> None:
        with self._locked() as inside:
            if inside:  # a finalizer inside one of this thread's locked sections
                self._deferred.append(lambda: self.free(ptr, device_id))
                return
            got = self._live.pop(ptr, None)
            if got is None:
                return
            dev, r, size, ident = got
            graph = self._owner(ptr)
            (graph.free if graph is not None else self._free).setdefault((dev, r), []).append(ptr)
            if self._trace is not None and ident is not None:
                self._trace.append(("free", ident, 0))
            for observer in self.observers:
                observer("free", ptr, size, r)
            st = self._stats
            st["num_frees"] += 1
            st["allocated_bytes"] -= r
            st["requested_bytes"] -= size

    def _grow(self, r: int, size: int, device_id: int) -> int:
        try:
            ptr = self._driver_malloc(r, device_id)
        except MemoryError:
            if self._capturing is not None:
                # Giving the cache back needs cudaDeviceSynchronize and cudaFree, which a capturing
                # stream refuses (cudaErrorStreamCaptureUnsupported, and the capture is lost);
                # graph.capture returns the cache before it starts, so there is nothing to give.
                self._stats["num_ooms"] += 1
                raise OutOfMemoryError(
                    f"out of device memory allocating {size} bytes (rounded to {r}) on cuda:{device_id} while "
                    f"a CUDA graph was captured; reserved {self._stats['reserved_bytes']} bytes. The step needs "
                    "more memory than the device has: reduce the batch size or the sequence length") from None
            self._release_locked()  # give the cache back and try once more
            try:
                ptr = self._driver_malloc(r, device_id)
            except MemoryError:
                self._stats["num_ooms"] += 1
                stats = self._stats_locked()
                raise OutOfMemoryError(
                    f"out of device memory allocating {size} bytes (rounded to {r}) on cuda:{device_id}; "
                    f"allocated {stats['allocated_bytes']}, reserved {stats['reserved_bytes']}, "
                    f"peak allocated {stats['peak_allocated_bytes']}, wasted {stats['wasted_bytes']} bytes. "
                    "Reduce the batch size or the sequence length.") from None
        st = self._stats
        st["num_driver_mallocs"] += 1
        st["reserved_bytes"] += r
        st["peak_reserved_bytes"] = max(st["peak_reserved_bytes"], st["reserved_bytes"])
        return ptr

    @contextlib.contextmanager
    def _locked(self):
        """The allocator's lock; yields whether this thread was already inside a locked section.

        Python's garbage collector can run anywhere in a locked section (any object allocation may
        trigger it) and collect an array or a dropped graph, whose finalizer calls free or
        release_pool on this same thread. The lock is reentrant, so that call does not deadlock, and
        free/release_pool see `inside` and defer themselves (running them there would change the pools
        under the outer section's feet); the outermost section runs the deferred calls as it leaves.
        A collection between taking the lock and counting the depth, or between uncounting and
        leaving, finds depth 0 and runs at once, which is safe: the outer section has not begun or is
        done."""
        with self._lock:
            inside = self._depth > 0
            self._depth += 1
            try:
                yield inside
            finally:
                self._depth -= 1
                if not inside and not self._draining:  # one loop runs them all: a collection may defer
                    self._draining = True                # hundreds of frees, and nesting would recurse
                    try:
                        while self._deferred:
                            self._deferred.pop(0)()  # depth 0 again: the deferred call runs now
                    finally:
                        self._draining = False

    def _release_locked(self) -> int:
        released = 0
        if any(self._free.values()):
            self._driver_sync()  # a cached block may still be read by queued kernels
        for (dev, r), ptrs in self._free.items():
            for p in ptrs:
                self._driver_free(p, dev)
                released += r
                self._stats["num_driver_frees"] += 1
        self._free.clear()
        self._stats["reserved_bytes"] -= released
        return released

    def _owner(self, ptr: int) -> GraphPool | None:
        """The graph pool a freed block returns to: the one it was captured into (that graph may still
        replay into it), else the pool being captured now, else none (the eager cache)."""
        for pool in self._pools:
            if ptr in pool.blocks:
                return pool
        return self._capturing

    @contextlib.contextmanager
    def capture_into(self, pool: GraphPool):
        """While a graph is captured: blocks come from (and are freed into) `pool`, never the eager cache."""
        with self._locked():
            if self._capturing is not None:
                raise KilnError("a CUDA graph is already being captured; captures do not nest")
            self._capturing = pool
        try:
            yield pool
        finally:
            with self._locked():
                self._capturing = None
                if pool.blocks and pool not in self._pools:
                    self._pools.append(pool)

    @contextlib.contextmanager
    def host_written(self):
        """Allocations in this block come from the eager cache even while a graph is captured: for
        buffers written outside the graph and read by its replays (a block recycled within the
        capture would be overwritten by the graph's temporaries before the replay reads it)."""
        with self._locked():
            saved, self._capturing = self._capturing, None
        try:
            yield
        finally:
            with self._locked():
                self._capturing = saved

    def release_pool(self, pool: GraphPool) -> None:
        """The graph is dropped: its free blocks join the eager cache; blocks still live follow on free."""
        with self._locked() as inside:
            if inside:
                self._deferred.append(lambda: self.release_pool(pool))
                return
            if pool in self._pools:
                self._pools.remove(pool)
            live = {p for p in pool.blocks if p in self._live}
            for key, ptrs in pool.free.items():
                self._free.setdefault(key, []).extend(ptrs)
            pool.free.clear()
            pool.blocks = {p: v for p, v in pool.blocks.items() if p in live}

    def release_unused(self) -> int:
        """Return every cached (free) block to the driver; the number of bytes released."""
        with self._locked():
            return self._release_locked()

    def end_warmup(self, release: bool = True) -> dict:
        """Learn the rounding from the recorded trace, stop recording, and (by default) flush the cache."""
        with self._locked():
            trace, self._trace = self._trace, None
        if trace:
            rounding, report = choose_rounding(trace)
            self.rounding = rounding
            self.learned = {"rounding": rounding.as_dict(), "events": len(trace), **report}
        released = self.release_unused() if release else 0
        return {**(self.learned or {}), "released_bytes": released}

    def _stats_locked(self) -> dict:
        st = dict(self._stats)
        st["cached_bytes"] = st["reserved_bytes"] - st["allocated_bytes"]
        st["wasted_bytes"] = st["reserved_bytes"] - st["requested_bytes"]  # rounding + idle cache
        st["rounding_waste_bytes"] = st["allocated_bytes"] - st["requested_bytes"]
        st["graph_pool_bytes"] = sum(pool.reserved_bytes for pool in self._pools)  # held for graph replays
        st["rounding"] = self.rounding.as_dict()
        st["warmup"] = self._trace is not None
        return st

    def memory_stats(self) -> dict:
        """Allocated, requested, reserved, cached and wasted bytes now, their peaks, and call counts."""
        with self._locked():
            return self._stats_locked()

    def reset_peak_stats(self) -> None:
        with self._locked():
            st = self._stats
            st["peak_allocated_bytes"] = st["allocated_bytes"]
            st["peak_requested_bytes"] = st["requested_bytes"]
            st["peak_reserved_bytes"] = st["reserved_bytes"]


def _cuda_malloc(size: int, device_id: int) -> int:
    import cupy
    try:
        return cupy.cuda.runtime.malloc(size)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        if getattr(e, "status", None) == 2:  # cudaErrorMemoryAllocation
            raise MemoryError(str(e)) from None
        raise


def _cuda_sync() -> None:
    import cupy
    cupy.cuda.runtime.deviceSynchronize()


def _cuda_free(ptr: int, device_id: int) -> None:
    import cupy
    with cupy.cuda.Device(device_id):
        cupy.cuda.runtime.free(ptr)


_installed: CachingAllocator | None = None
_cupy_allocator = None


def install() -> CachingAllocator:
    """Make kiln's allocator CuPy's device allocator (pinned memory stays with CuPy)."""
    global _installed, _cupy_allocator
    if _installed is None:
        import cupy
        alloc = CachingAllocator()
        _cupy_allocator = cupy.cuda.memory.PythonFunctionAllocator(alloc.malloc, alloc.free)
        cupy.cuda.set_allocator(_cupy_allocator.malloc)
        _installed = alloc
    return _installed


def installed() -> CachingAllocator | None:
    return _installed


def memory_stats() -> dict:
    """kiln's allocator statistics (empty before the first device allocation)."""
    return _installed.memory_stats() if _installed is not None else {}


def end_warmup(release: bool = True) -> dict:
    """Call after step 0 (or the first few steps): learn the rounding and flush step 0's cache."""
    return _installed.end_warmup(release) if _installed is not None else {}


def host_written():
    """The installed allocator's `host_written()` context (a no-op without kiln's allocator)."""
    return _installed.host_written() if _installed is not None else contextlib.nullcontext()


@contextlib.contextmanager
def observe_allocations(callback):
    """Call callback(event, ptr, requested, rounded) for every alloc and free inside the block; yields
    the installed allocator (None when kiln's allocator is not installed: then nothing is observed)."""
    alloc = _installed
    if alloc is None:
        yield None
        return
    alloc.observers.append(callback)
    try:
        yield alloc
    finally:
        alloc.observers.remove(callback)


def release_unused() -> int:
    return _installed.release_unused() if _installed is not None else 0
