"""kiln's caching allocator for CuPy: exact-size small blocks, best-fit split large ones, a rounding learned from the first steps.

After the paper's "Custom Caching Allocator": no fixed size classes. A request is rounded up (to
`small` bytes below LARGE_THRESHOLD, to `large` bytes from it on) and served from two bands:

- Small blocks (below 1 MiB) are one cudaMalloc each, cached on free and reused only by a request
  of the same rounded size. During a warm-up window (the first step, or however long the caller
  lets it run) every request is recorded as an alloc/free trace; `end_warmup()` replays its small
  requests under candidate granularities and keeps the one that would have held the fewest bytes
  from the driver (coarse rounding wastes bytes inside blocks, fine rounding wastes whole cached
  blocks no later request fits), then returns what step 0 alone needed to the driver ("targeted
  cache flush following the 0th step").
- Large blocks live in segments (one cudaMalloc each, rounded up to 2 MiB). A request takes the
  smallest free block that holds it (best fit; of equal sizes the lowest address) and the rest of
  that block stays free; a freed block merges with its free neighbours of the same owner. So the
  cache needs about the peak of live large bytes, not, for every size, the most blocks of that size
  ever live at once: a step whose activations and gradients peak at different times in different
  sizes fits in what either needs (the 76-layer fp32 GPT could not be captured without it).

The same sequence of requests (and driver addresses) always gives the same addresses: every
choice above is a function of the request sequence, which kiln's bitwise reproducible training
and its graph replays rely on.

Every block is cached on free and reused at once: safe because all of kiln's work is ordered on its
one stream (device.stream()). Memory handed to another stream (NCCL, a copy stream) must be
ordered with events by its user, and stay referenced until the compute stream has waited on that
stream's work: a freed block records no stream, so the compute stream's next request may get it
while the other stream still uses it. NCCL's Work keeps its operands until it is waited on
(kiln.distributed.work); one dropped unwaited (a prefetched FSDP gather freed without `_wait`)
does not. Only a segment that is wholly free goes back to the driver.

A captured CUDA graph replays into the addresses it was recorded with, long after Python freed
them. So every block has an owner: the eager cache or the GraphPool of a graph. While a graph is
captured (`capture_into(pool)`) a block allocated or freed belongs to that pool: it is taken from
the pool's free blocks, else from the eager cache's (a split leaves the rest eager), else from a
new segment of the pool's; a block freed during the capture is reused only by later requests of
the same capture; a block stays its owner's (never merged with or handed to another owner) until
the graph is dropped (`release_pool`), when the pool's blocks become eager cache. A buffer the host
writes between replays (a scalar the next replay reads) must not be one of those recycled blocks:
the graph's own temporaries overwrite them during every replay. It is allocated under
`host_written()`, from the eager cache, which the graph never touches.
The bookkeeping is pure Python with injectable driver calls, so CPU tests can check it.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
import threading
import warnings

from kiln.errors import KilnError

SMALL_GRANULARITIES = (512, 1024, 2048, 4096, 8192, 16384, 65536)
LARGE_GRANULARITY = 512
LARGE_THRESHOLD = 1 << 20
SEGMENT_GRANULARITY = 1 << 21
MAX_TRACE_EVENTS = 1 << 21


class OutOfMemoryError(KilnError):
    """The device has no memory left for a request, even after the cache was returned to the driver."""


class Rounding:
    """round(size) = size rounded up to `small` bytes below `threshold`, to `large` bytes from it on."""

    __slots__ = ("small", "large", "threshold")

    def __init__(self, small: int = 512, large: int = LARGE_GRANULARITY, threshold: int = LARGE_THRESHOLD):
        for name, g in (("small", small), ("large", large)):
            if g < 1 or g & (g - 1):
                raise KilnError(f"allocator {name} granularity must be a power of two >= 1, got {g}")
        if large < 256:
            raise KilnError(f"allocator large granularity must be >= 256 (blocks cut from one segment stay "
                            f"aligned as cudaMalloc's), got {large}")
        self.small, self.large, self.threshold = int(small), int(large), int(threshold)

    def __call__(self, size: int) -> int:
        g = self.small if size < self.threshold else self.large
        return max(g, -(-int(size) // g) * g)

    def as_dict(self) -> dict:
        return {"small": self.small, "large": self.large, "threshold": self.threshold}

    def __repr__(self) -> str:
        return f"Rounding(small={self.small}, large={self.large}, threshold={self.threshold})"


def simulate(trace, rounding) -> dict:
    """Replay an alloc/free trace through an exact-class block pool (the small band); what it would hold.

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


def small_requests(trace, threshold: int = LARGE_THRESHOLD) -> list:
    """The events of a trace's requests below `threshold` (the band of exact-size blocks)."""
    small, out = set(), []
    for kind, ident, size in trace:
        if kind == "alloc" and size < threshold:
            small.add(ident)
        if ident in small:
            out.append((kind, ident, size))
    return out


def choose_rounding(trace, smalls=SMALL_GRANULARITIES, threshold: int = LARGE_THRESHOLD):
    """(Rounding, report) minimising the bytes the trace's small requests would reserve; ties go to
    coarser rounding. Large requests keep LARGE_GRANULARITY: best-fit splitting, not a coarse size
    class, lets one block serve sizes that alternate."""
    trace = small_requests(trace, threshold)
    best = None
    for s in smalls if trace else ():  # no small request: nothing to learn from
        r = Rounding(s, LARGE_GRANULARITY, threshold)
        sim = simulate(trace, r)
        score = (sim["reserved"], -s)
        if best is None or score < best[0]:
            best = (score, r, sim)
    if best is None:
        return Rounding(), {}
    _, r, sim = best
    return r, {**sim, "wasted": sim["reserved"] - sim["peak_requested"]}


class _Block:
    """A range of one driver segment, handed out (live) or free in its owner's cache. Small blocks are
    a whole segment; large ones are linked to their neighbours in the segment (prev, next)."""

    __slots__ = ("ptr", "size", "device", "large", "prev", "next", "owner", "free")

    def __init__(self, ptr, size, device, large, owner):
        self.ptr, self.size, self.device, self.large, self.owner = ptr, size, device, large, owner
        self.prev = self.next = None
        self.free = False


class BlockCache:
    """The free blocks of one owner: small ones by (device, exact size), large ones by (size, address)."""

    def __init__(self):
        self._small: dict = {}   # (device, size) -> [block], the last freed reused first
        self._large: dict = {}   # device -> sorted [(size, ptr)]
        self._large_blocks: dict = {}  # ptr -> free large block

    def push(self, block: _Block) -> None:
        block.free = True
        if block.large:
            bisect.insort(self._large.setdefault(block.device, []), (block.size, block.ptr))
            self._large_blocks[block.ptr] = block
        else:
            self._small.setdefault((block.device, block.size), []).append(block)

    def remove(self, block: _Block) -> None:
        block.free = False
        if block.large:
            keys = self._large[block.device]
            del keys[bisect.bisect_left(keys, (block.size, block.ptr))]
            del self._large_blocks[block.ptr]
        else:
            blocks = self._small[(block.device, block.size)]
            if blocks[-1] is block:  # the one best_fit returns
                blocks.pop()
            else:
                blocks.remove(block)

    def best_fit(self, size: int, device: int, large: bool) -> _Block | None:
        """The free block a request of `size` rounded bytes takes (still in the cache), or None."""
        if not large:
            blocks = self._small.get((device, size))
            return blocks[-1] if blocks else None
        keys = self._large.get(device, ())
        i = bisect.bisect_left(keys, (size, -1))
        return self._large_blocks[keys[i][1]] if i < len(keys) else None

    def free_blocks(self) -> list:
        """Every free block, small ones first, each group in the order it was cached."""
        return [b for blocks in self._small.values() for b in blocks] + list(self._large_blocks.values())


class GraphPool(BlockCache):
    """The blocks a captured graph owns (`blocks`, live or free) and its cache (reused only inside its capture)."""

    def __init__(self):
        super().__init__()
        self.blocks: dict = {}   # ptr -> block

    @property
    def reserved_bytes(self) -> int:
        return sum(b.size for b in self.blocks.values())


class CachingAllocator:
    """Exact-size small blocks and best-fit split large ones over injectable driver malloc/free
    (cudaMalloc/cudaFree by default)."""

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
        self._eager = BlockCache()
        self._segments: dict = {}  # base ptr -> (its first block, size): what the driver gave
        self._live: dict = {}   # ptr -> (block, requested size, trace id)
        self._trace = [] if record else None
        self._capturing: GraphPool | None = None  # the pool new blocks go to (None inside host_written)
        self._capture: GraphPool | None = None  # the capture in progress: its stream captures, host_written or not
        self._pools: list = []  # pools of graphs that can still be replayed
        self._next_id = 0
        self.learned: dict | None = None
        self.observers: list = []  # callables (event, ptr, requested size, block size): the profiler's timeline
        self._stats = dict.fromkeys(("allocated_bytes", "requested_bytes", "reserved_bytes",
                                     "peak_allocated_bytes", "peak_requested_bytes", "peak_reserved_bytes",
                                     "num_allocs", "num_frees", "num_driver_mallocs", "num_driver_frees",
                                     "num_ooms", "num_splits", "num_merges"), 0)

    # cupy_malloc calls malloc(size, device_id) -> ptr, and a _Lease calls free(ptr, device_id).
    def malloc(self, size: int, device_id: int = 0) -> int:
        size = int(size)
        with self._locked():
            r = self.rounding(size)
            large = r >= self.rounding.threshold
            graph = self._capturing
            owner = graph if graph is not None else self._eager
            block = owner.best_fit(r, device_id, large)
            if block is None and graph is not None:
                block = self._eager.best_fit(r, device_id, large)  # the graph takes it: its own from now on
            if block is not None:
                block.owner.remove(block)
            else:
                block = self._grow(r, size, device_id, large, owner)
            if block.large and block.size > r:
                self._split(block, r)
            if block.owner is not owner:
                block.owner = owner
            if graph is not None:
                graph.blocks[block.ptr] = block
            ident = None
            if self._trace is not None:
                ident = self._next_id
                self._next_id += 1
                self._trace.append(("alloc", ident, size))
                if len(self._trace) >= MAX_TRACE_EVENTS:
                    self._trace = None  # end_warmup never came: keep the sizes bounded
            self._live[block.ptr] = (block, size, ident)
            st = self._stats
            st["num_allocs"] += 1
            st["allocated_bytes"] += r
            st["requested_bytes"] += size
            st["peak_allocated_bytes"] = max(st["peak_allocated_bytes"], st["allocated_bytes"])
            st["peak_requested_bytes"] = max(st["peak_requested_bytes"], st["requested_bytes"])
            for observer in self.observers:  # last: one that raises leaves the bookkeeping whole
                observer("alloc", block.ptr, size, r)
            return block.ptr

    def free(self, ptr: int, device_id: int = 0) -> None:
        with self._locked() as inside:
            if inside:  # a finalizer inside one of this thread's locked sections
                self._deferred.append(lambda: self.free(ptr, device_id))
                return
            got = self._live.pop(ptr, None)
            if got is None:
                return
            block, size, ident = got
            r = block.size
            if block.owner is self._eager and self._capture is not None:
                # the graph being captured may have recorded reads of it: it keeps the block
                block.owner = self._capture
                self._capture.blocks[block.ptr] = block
            self._cache(block)
            if self._trace is not None and ident is not None:
                self._trace.append(("free", ident, 0))
            st = self._stats
            st["num_frees"] += 1
            st["allocated_bytes"] -= r
            st["requested_bytes"] -= size
            for observer in self.observers:  # last: one that raises leaves the bookkeeping whole
                observer("free", ptr, size, r)

    def _split(self, block: _Block, size: int) -> None:
        """Cut a large block to `size` bytes; the rest is a free block of the same owner after it."""
        rest = _Block(block.ptr + size, block.size - size, block.device, True, block.owner)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        if isinstance(rest.owner, GraphPool):
            rest.owner.blocks[rest.ptr] = rest
        self._stats["num_splits"] += 1
        self._cache(rest)

    def _cache(self, block: _Block) -> None:
        """Put a block that is no longer handed out into its owner's cache, merged with its free neighbours
        of the same owner (never another graph's: a graph's blocks stay its own). The graph being captured
        also takes free neighbours from the eager cache, as its requests may: one range, not two."""
        owner = block.owner
        if block.large:
            prev = block.prev
            if prev is not None and self._joins(prev, owner):
                block = self._merge(prev, block, owner)
            nxt = block.next
            if nxt is not None and self._joins(nxt, owner):
                block = self._merge(block, nxt, owner)
        owner.push(block)

    def _joins(self, neighbour: _Block, owner: BlockCache) -> bool:
        return neighbour.free and (neighbour.owner is owner
                                   or (owner is self._capturing and neighbour.owner is self._eager))

    def _merge(self, first: _Block, second: _Block, owner: BlockCache) -> _Block:
        """One block of `owner` from two neighbours (the free one leaves its cache)."""
        for b in (first, second):
            if b.free:
                b.owner.remove(b)
            if isinstance(b.owner, GraphPool):
                del b.owner.blocks[b.ptr]
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.owner = owner
        if isinstance(owner, GraphPool):
            owner.blocks[first.ptr] = first
        self._stats["num_merges"] += 1
        return first

    def _grow(self, r: int, size: int, device_id: int, large: bool, owner: BlockCache) -> _Block:
        """A new segment holding r bytes (a large one rounded up to SEGMENT_GRANULARITY), as one block."""
        seg = -(-r // SEGMENT_GRANULARITY) * SEGMENT_GRANULARITY if large else r
        try:
            ptr = self._driver_malloc(seg, device_id)
        except MemoryError:
            if self._capture is not None:  # host_written() too: the stream still captures
                # Giving the cache back needs cudaDeviceSynchronize and cudaFree, which a capturing
                # stream refuses (cudaErrorStreamCaptureUnsupported, and the capture is lost);
                # graph.capture returns the cache before it starts, so there is little to give (a
                # graph released during the capture leaves some), and it fails this capture cleanly.
                self._stats["num_ooms"] += 1
                raise OutOfMemoryError(
                    f"out of device memory allocating {size} bytes (rounded to {r}) on cuda:{device_id} while "
                    f"a CUDA graph was captured; reserved {self._stats['reserved_bytes']} bytes. The step needs "
                    "more memory than the device has: reduce the batch size or the sequence length") from None
            self._release_locked()  # give the cache back and try once more
            try:
                ptr = self._driver_malloc(seg, device_id)
            except MemoryError:
                self._stats["num_ooms"] += 1
                stats = self._stats_locked()
                raise OutOfMemoryError(
                    f"out of device memory allocating {size} bytes (rounded to {r}) on cuda:{device_id}; "
                    f"allocated {stats['allocated_bytes']}, reserved {stats['reserved_bytes']}, "
                    f"peak allocated {stats['peak_allocated_bytes']}, wasted {stats['wasted_bytes']} bytes. "
                    "Reduce the batch size or the sequence length.") from None
        block = _Block(ptr, seg, device_id, large, owner)
        self._segments[ptr] = (block, seg)
        st = self._stats
        st["num_driver_mallocs"] += 1
        st["reserved_bytes"] += seg
        st["peak_reserved_bytes"] = max(st["peak_reserved_bytes"], st["reserved_bytes"])
        return block

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
                            call = self._deferred.pop(0)
                            try:
                                call()  # depth 0 again: the deferred call runs now
                            except Exception as e:
                                # A finalizer's error, which Python reports and ignores: raised here it
                                # would replace this section's result (malloc's block, leased to no one,
                                # leaked). A warning, not sys.excepthook: distributed runs abort on that.
                                warnings.warn(f"an allocator call deferred from a finalizer failed: "
                                              f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=1)
                    finally:
                        self._draining = False

    def _release_locked(self) -> int:
        """Return every wholly free segment of the eager cache to the driver; the bytes released."""
        whole = [b for b in self._eager.free_blocks() if b.prev is None and b.next is None]
        if whole:
            self._driver_sync()  # a cached block may still be read by queued kernels
        released = 0
        for block in whole:
            self._eager.remove(block)
            del self._segments[block.ptr]
            self._driver_free(block.ptr, block.device)
            released += block.size
            self._stats["num_driver_frees"] += 1
        self._stats["reserved_bytes"] -= released
        return released

    @contextlib.contextmanager
    def capture_into(self, pool: GraphPool):
        """While a graph is captured: blocks come from `pool` (or from the eager cache's free blocks, which
        become the pool's) and are freed into it; the eager cache never gets them back before release_pool."""
        with self._locked():
            if self._capture is not None:
                raise KilnError("a CUDA graph is already being captured; captures do not nest")
            self._capture = self._capturing = pool
        try:
            yield pool
        finally:
            with self._locked():
                self._capture = self._capturing = None
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
        """The graph is dropped: its blocks join the eager cache (merged with free neighbours); blocks
        still live follow on free."""
        with self._locked() as inside:
            if inside:
                self._deferred.append(lambda: self.release_pool(pool))
                return
            if pool in self._pools:
                self._pools.remove(pool)
            blocks = list(pool.blocks.values())
            pool.blocks = {}
            for block in blocks:
                if block.free:
                    pool.remove(block)
                    block.owner = self._eager
                    self._cache(block)
                else:
                    block.owner = self._eager

    def release_unused(self) -> int:
        """Return every cached (free) block to the driver; the number of bytes released."""
        with self._locked():
            return self._release_locked()

    @property
    def capturing(self) -> bool:
        """Whether a graph is being captured now (its blocks come from its pool)."""
        return self._capturing is not None

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
        st["num_segments"] = len(self._segments)
        st["rounding"] = self.rounding.as_dict()
        st["warmup"] = self._trace is not None
        return st

    def integrity_problems(self) -> list:
        """What is wrong with the bookkeeping (empty when nothing is): every segment is tiled by its blocks
        without gap or overlap, each block is handed out once or free in exactly its owner's cache, free
        neighbours of one owner are merged, a graph pool lists exactly the blocks it owns, and the byte
        counts equal the blocks'."""
        with self._locked():
            bad = []
            owners = [self._eager] + self._pools + ([self._capture] if self._capture not in (None, *self._pools) else [])
            cached = {}
            for owner in owners:
                for b in owner.free_blocks():
                    if id(b) in cached:
                        bad.append(f"{b.ptr:#x} free twice")
                    cached[id(b)] = owner
            listed = {}
            for pool in owners[1:]:
                for ptr, b in pool.blocks.items():
                    if b.ptr != ptr or b.owner is not pool:
                        bad.append(f"{ptr:#x} listed by a pool that does not own it")
                    listed[id(b)] = pool
            live = reserved = 0
            for base, (block, size) in self._segments.items():
                reserved += size
                end, b, prev = base + size, block, None
                while b is not None:
                    if b.prev is not prev or b.ptr != (base if prev is None else prev.ptr + prev.size) or b.size <= 0:
                        bad.append(f"{b.ptr:#x} breaks the tiling of segment {base:#x}")
                    if b.free != (id(b) in cached) or (b.free and cached[id(b)] is not b.owner):
                        bad.append(f"{b.ptr:#x} free={b.free} but cached by {cached.get(id(b))!r}")
                    if b.free == (b.ptr in self._live and self._live[b.ptr][0] is b):
                        bad.append(f"{b.ptr:#x} both handed out and free, or neither")
                    if isinstance(b.owner, GraphPool) != (id(b) in listed):
                        bad.append(f"{b.ptr:#x} owned by a pool that does not list it")
                    if prev is not None and b.free and prev.free and b.owner is prev.owner:
                        bad.append(f"{b.ptr:#x} free beside free {prev.ptr:#x} of the same owner, not merged")
                    live += 0 if b.free else b.size
                    prev, b = b, b.next
                if prev.ptr + prev.size != end:
                    bad.append(f"segment {base:#x} of {size} bytes ends at {prev.ptr + prev.size:#x}")
            if len(cached) + len(self._live) != sum(1 for _ in self._all_blocks()):
                bad.append("a cached or live block is in no segment")
            st = self._stats
            if (live, reserved) != (st["allocated_bytes"], st["reserved_bytes"]):
                bad.append(f"allocated/reserved {st['allocated_bytes']}/{st['reserved_bytes']} bytes, "
                           f"the blocks hold {live}/{reserved}")
            return bad

    def _all_blocks(self):
        for block, _ in self._segments.values():
            while block is not None:
                yield block
                block = block.next

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


class _Lease:
    """One block of kiln's allocator held by a CuPy memory object: given back when that lets go of it.

    Not CuPy's PythonFunctionAllocator: its memory object calls the free function from a Cython
    `__dealloc__`, and when a garbage collection breaks a reference cycle holding the memory, Cython's
    clear sets that function to None first, so the block was never given back (the H200 logs of
    2026-12-05: "Exception ignored in PythonFunctionAllocatorMemory.__dealloc__ ... 'NoneType' object is
    not callable"). A Python object's `__del__` runs however it dies: collected in a cycle, or released
    when the collector clears the memory object that held it."""

    __slots__ = ("alloc", "ptr", "device_id")

    def __init__(self, alloc: CachingAllocator, ptr: int, device_id: int):
        self.alloc, self.ptr, self.device_id = alloc, ptr, device_id

    def __del__(self, _finalizing=sys.is_finalizing):  # bound now: module teardown may have cleared `sys`
        # At interpreter exit the process gives all device memory back anyway, and a daemon thread
        # (the NCCL watchdog, the store) frozen there inside a locked section holds the allocator's
        # lock for good: taking it would hang the exit.
        if not _finalizing():
            self.alloc.free(self.ptr, self.device_id)


def cupy_malloc(alloc: CachingAllocator, memory, get_device):
    """CuPy's allocator function (size -> MemoryPointer) over `alloc`: `memory` is cupy.cuda.memory,
    `get_device` gives the current device id. Each block is lent to an UnownedMemory through a _Lease."""
    def malloc(size: int):
        device_id = get_device()
        if size == 0:  # as CuPy's own: no block, a null pointer on the device
            return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, device_id), 0)
        lease = _Lease(alloc, alloc.malloc(size, device_id), device_id)
        return memory.MemoryPointer(memory.UnownedMemory(lease.ptr, size, lease, device_id), 0)
    return malloc


_installed: CachingAllocator | None = None


def install() -> CachingAllocator:
    """Make kiln's allocator CuPy's device allocator (pinned memory stays with CuPy)."""
    global _installed
    if _installed is None:
        import cupy
        alloc = CachingAllocator()
        cupy.cuda.set_allocator(cupy_malloc(alloc, cupy.cuda.memory, cupy.cuda.runtime.getDevice))
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
