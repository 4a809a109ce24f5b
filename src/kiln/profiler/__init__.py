"""The profiler, first version: one span per backend kernel call, timed with device events.

    with Profiler(device) as prof:
        trainer.train_step()
    prof.export_chrome_trace("trace.json")   # open in Perfetto (ui.perfetto.dev) or chrome://tracing
    print(prof.table())

It wraps every named kernel of the backend interface (`kiln.backend.interface.KERNELS`: the names
`kiln.ops`, the optimizer and autograd's gradient sums call), so each span is one kernel call;
work outside them (the array library's own elementwise arithmetic) shows as untracked time.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from kiln.backend.interface import KERNELS


class _Clock:
    """Timing marks from the backend's timing events: device time on CUDA, host time on the CPU."""

    def __init__(self, backend):
        self.backend = backend

    def mark(self):
        ev = self.backend.event(timing=True)
        ev.record(self.backend.stream())
        return ev

    def elapsed_ms(self, a, b):
        return self.backend.elapsed_ms(a, b)

    def synchronize(self):
        self.backend.synchronize()


class Profiler:
    """Records (kernel, start, end) for every backend kernel call inside the `with` block."""

    def __init__(self, device):
        self.backend = device.backend
        self.clock = _Clock(self.backend)
        self.records = []      # (name, start mark, end mark, host seconds)
        self._saved = {}
        self.total_ms = None

    def _wrap(self, name, fn):
        clock, records = self.clock, self.records

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            a = clock.mark()
            out = fn(*args, **kwargs)
            records.append((name, a, clock.mark(), time.perf_counter() - t0))
            return out
        return timed

    def __enter__(self):
        for name in KERNELS:
            fn = getattr(self.backend, name)
            self._saved[name] = fn
            setattr(self.backend, name, self._wrap(name, fn))
        self.clock.synchronize()
        self._start = self.clock.mark()
        self._host_start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        end = self.clock.mark()
        self.clock.synchronize()
        self.host_ms = 1000.0 * (time.perf_counter() - self._host_start)
        for name, fn in self._saved.items():
            setattr(self.backend, name, fn)
        self._saved.clear()
        self.total_ms = self.clock.elapsed_ms(self._start, end)
        self.spans = [(name, self.clock.elapsed_ms(self._start, a), self.clock.elapsed_ms(a, b), host)
                      for name, a, b, host in self.records]

    def summary(self) -> dict:
        """Per kernel: calls, device ms, host ms; plus the whole region's device and host time."""
        per = defaultdict(lambda: [0, 0.0, 0.0])
        for name, _, dur, host in self.spans:
            per[name][0] += 1
            per[name][1] += dur
            per[name][2] += 1000.0 * host
        tracked = sum(v[1] for v in per.values())
        return {"total_ms": self.total_ms, "host_ms": self.host_ms, "tracked_ms": tracked,
                "untracked_ms": self.total_ms - tracked,
                "kernels": {k: {"calls": v[0], "ms": v[1], "host_ms": v[2]}
                            for k, v in sorted(per.items(), key=lambda kv: -kv[1][1])}}

    def table(self, top: int = 15) -> str:
        s = self.summary()
        lines = [f"{'kernel':20}{'calls':>7}{'device ms':>11}{'%':>7}{'host ms':>10}"]
        for name, k in list(s["kernels"].items())[:top]:
            lines.append(f"{name:20}{k['calls']:7d}{k['ms']:11.2f}{100 * k['ms'] / s['total_ms']:7.1f}"
                         f"{k['host_ms']:10.2f}")
        lines.append(f"{'(untracked)':20}{'':7}{s['untracked_ms']:11.2f}"
                     f"{100 * s['untracked_ms'] / s['total_ms']:7.1f}")
        lines.append(f"{'total':20}{'':7}{s['total_ms']:11.2f}{100.0:7.1f}{s['host_ms']:10.2f}")
        stats = self.backend.memory_stats()
        if stats:
            gib = 2 ** 30
            lines.append("allocator: " + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in stats.items()
                                                   if k.endswith("_bytes")))
        return "\n".join(lines)

    def export_chrome_trace(self, path) -> None:
        """The spans as Chrome-trace JSON: one row for the device, times in microseconds."""
        events = [{"name": name, "ph": "X", "pid": 0, "tid": "device", "ts": 1000.0 * start,
                   "dur": 1000.0 * dur, "args": {"host_ms": 1000.0 * host}}
                  for name, start, dur, host in self.spans]
        events.append({"name": "profiled region", "ph": "X", "pid": 0, "tid": "region", "ts": 0.0,
                       "dur": 1000.0 * self.total_ms})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
