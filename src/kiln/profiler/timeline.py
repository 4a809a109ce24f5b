"""The allocation timeline: every allocation and free of kiln's allocator while profiling, with its
size, the kernel (op) running when it happened, the stream and the time; memory over time from it.

The allocator calls the timeline's observer inside its lock, so the events are in the order the
allocator saw them, and the running sum of their rounded sizes is the allocator's
`allocated_bytes` at every event (the test holds it to that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class AllocationEvent:
    t_ms: float         # host time since the timeline started
    kind: str           # "alloc" or "free"
    ptr: int
    requested: int      # bytes asked for
    rounded: int        # bytes of the block (the allocator's rounding)
    op: str             # the backend kernel running, or "(between kernels)"
    stream: str


class AllocationTimeline:
    """Observer for `backend.observe_allocations`; `op` is set by the profiler around each kernel."""

    OUTSIDE = "(between kernels)"

    def __init__(self, stream: str = "kiln"):
        self.events: list[AllocationEvent] = []
        self.op = self.OUTSIDE
        self.stream = stream
        self.start_bytes = 0   # allocated bytes already live when the timeline started
        self._t0 = time.perf_counter()

    def __call__(self, kind, ptr, requested, rounded):
        self.events.append(AllocationEvent(1000.0 * (time.perf_counter() - self._t0), kind, ptr, requested,
                                           rounded, self.op, self.stream))

    def curve(self):
        """(times ms, allocated bytes after each event), starting from start_bytes."""
        ts, ys, live = [0.0], [self.start_bytes], self.start_bytes
        for e in self.events:
            live += e.rounded if e.kind == "alloc" else -e.rounded
            ts.append(e.t_ms)
            ys.append(live)
        return ts, ys

    def summary(self) -> dict:
        """Counts, bytes allocated and freed, the peak, and bytes allocated per op."""
        _, ys = self.curve()
        per_op: dict = {}
        for e in self.events:
            if e.kind == "alloc":
                n, b = per_op.get(e.op, (0, 0))
                per_op[e.op] = (n + 1, b + e.rounded)
        allocs = [e for e in self.events if e.kind == "alloc"]
        return {"allocs": len(allocs), "frees": len(self.events) - len(allocs),
                "allocated_bytes": sum(e.rounded for e in allocs),
                "freed_bytes": sum(e.rounded for e in self.events if e.kind == "free"),
                "start_bytes": self.start_bytes, "end_bytes": ys[-1], "peak_bytes": max(ys),
                "per_op": {op: {"allocs": n, "bytes": b}
                           for op, (n, b) in sorted(per_op.items(), key=lambda kv: -kv[1][1])}}

    def to_chrome_counter(self, pid=0) -> list:
        """The curve as Chrome-trace counter events ("C"): Perfetto draws memory under the kernels."""
        ts, ys = self.curve()
        return [{"name": "allocated", "ph": "C", "pid": pid, "tid": "memory", "ts": 1000.0 * t, "args": {"MiB": y / 2 ** 20}}
                for t, y in zip(ts, ys)]

    def write_csv(self, path) -> None:
        with open(path, "w") as f:
            f.write("t_ms,kind,ptr,requested,rounded,op,stream\n")
            f.writelines(f"{e.t_ms:.4f},{e.kind},{e.ptr:#x},{e.requested},{e.rounded},{e.op},{e.stream}\n"
                         for e in self.events)

    def plot(self, path, title="memory over time") -> None:
        """allocated bytes against time (PNG), one point per allocation or free."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ts, ys = self.curve()
        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.step(ts, [y / 2 ** 20 for y in ys], where="post")
        ax.set_xlabel("ms since the profiled region began")
        ax.set_ylabel("allocated MiB")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
