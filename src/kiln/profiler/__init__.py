"""The profiler (paper §2.3): one span per backend kernel call, timed with device events, with
its FLOPs and bytes against the device's measured ceilings, an NVTX range around it on CUDA,
and the allocation timeline of kiln's allocator.

    with Profiler(device) as prof:
        trainer.train_step()
    prof.write(run_dir)   # trace.json (Perfetto), profile.txt/.json, memory.png, allocations.csv, report.html/.png

It wraps every named kernel of the backend interface (`kiln.backend.interface.KERNELS`: the names
`kiln.ops`, the optimizer and autograd's gradient sums call), so each span is one kernel call;
work outside them (the array library's own elementwise arithmetic) shows as untracked time.
A step replayed as a CUDA graph runs no Python, so it is profiled op by op (eager);
benchmarks/step_profile.py times the kernels inside the replayed graph with CUPTI (through
torch.profiler) and sets them against the ceilings by family.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import ExitStack

from kiln.backend.interface import KERNELS
from kiln.profiler.cost import FAMILIES, kernel_bytes, kernel_flops
from kiln.profiler.timeline import AllocationTimeline


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
    """Records (kernel, start, end, FLOPs, bytes) for every backend kernel call inside the `with`
    block, and every allocation and free of kiln's allocator (`timeline`).

    ceilings: the device's measured ceilings (`kiln.profiler.ceilings.ceilings(device)`), for the
    fraction of the limit each kernel reaches; nvtx: open an NVTX range per kernel (CUDA)."""

    def __init__(self, device, ceilings: dict | None = None, nvtx: bool = True):
        self.device = device
        self.backend = device.backend
        self.clock = _Clock(self.backend)
        self.records = []      # (name, start mark, end mark, host seconds, flops, bytes, dtype)
        self._saved = {}
        self.total_ms = None
        self.ceilings = ceilings
        self.nvtx = nvtx  # range_push/pop are no-ops on the CPU backend
        self.timeline = AllocationTimeline()
        self._exit = ExitStack()

    def _wrap(self, name, fn):
        clock, records, timeline, backend = self.clock, self.records, self.timeline, self.backend
        nvtx = self.nvtx

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            timeline.op = name
            if nvtx:
                backend.range_push(name)
            a = clock.mark()
            out = fn(*args, **kwargs)
            b = clock.mark()
            if nvtx:
                backend.range_pop()
            timeline.op = AllocationTimeline.OUTSIDE
            first = next((x for x in args if hasattr(x, "dtype") and hasattr(x, "shape")), None)
            records.append((name, a, b, time.perf_counter() - t0, kernel_flops(name, args, out),
                            kernel_bytes(args, out), None if first is None else str(first.dtype)))
            return out
        return timed

    def __enter__(self):
        for name in KERNELS:
            fn = getattr(self.backend, name)
            self._saved[name] = fn
            setattr(self.backend, name, self._wrap(name, fn))
        self.clock.synchronize()
        stats = self.backend.memory_stats()
        self.timeline.start_bytes = stats.get("allocated_bytes", 0)
        self.allocator = self._exit.enter_context(self.backend.observe_allocations(self.timeline))
        self._start = self.clock.mark()
        self._host_start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        end = self.clock.mark()
        self.clock.synchronize()
        self.host_ms = 1000.0 * (time.perf_counter() - self._host_start)
        self._exit.close()
        for name, fn in self._saved.items():
            setattr(self.backend, name, fn)
        self._saved.clear()
        self.total_ms = self.clock.elapsed_ms(self._start, end)
        self.spans = [(name, self.clock.elapsed_ms(self._start, a), self.clock.elapsed_ms(a, b), host)
                      for name, a, b, host, *_ in self.records]
        self.costs = [(flops, nbytes, dtype) for *_, flops, nbytes, dtype in self.records]

    def _ceiling_fraction(self, flops, nbytes, ms, dtype):
        """The kernel's achieved rate over the device's limit for it: GEMM TFLOP/s for the GEMM and
        attention families (of the kernel's dtype and the matmul precision), copy GB/s otherwise."""
        c = self.ceilings
        if not c or ms <= 0:
            return None
        if flops:
            gemm = c["gemm_tflops"]
            mode = {"bfloat16": "bf16", "float64": "fp64"}.get(dtype)
            if mode is None:
                mode = self.backend.get_matmul_precision()
            peak = gemm.get(mode) or gemm.get("fp32")
            return flops / (ms * 1e-3) / 1e12 / peak
        return nbytes / (ms * 1e-3) / 1e9 / c["copy_gbps"]

    def summary(self) -> dict:
        """Per kernel: calls, device ms, host ms, FLOPs, bytes, TFLOP/s, GB/s and the fraction of the
        device's ceiling; device ms per family; the whole region's device and host time; the
        allocation timeline's summary."""
        per = defaultdict(lambda: [0, 0.0, 0.0, 0, 0, 0.0, 0.0])
        for (name, _, dur, host), (flops, nbytes, dtype) in zip(self.spans, self.costs):
            v = per[name]
            v[0] += 1
            v[1] += dur
            v[2] += 1000.0 * host
            v[3] += flops
            v[4] += nbytes
            frac = self._ceiling_fraction(flops, nbytes, dur, dtype)
            if frac is not None:  # time-weighted: the kernel's fraction over its calls
                v[5] += frac * dur
                v[6] += dur
        tracked = sum(v[1] for v in per.values())
        kernels = {}
        for k, v in sorted(per.items(), key=lambda kv: -kv[1][1]):
            sec = v[1] * 1e-3
            kernels[k] = {"calls": v[0], "ms": v[1], "host_ms": v[2], "flops": v[3], "bytes": v[4],
                          "tflops": v[3] / sec / 1e12 if sec > 0 else None,
                          "gbps": v[4] / sec / 1e9 if sec > 0 else None,
                          "ceiling_fraction": v[5] / v[6] if v[6] > 0 else None}
        families = defaultdict(float)
        for k, v in kernels.items():
            families[FAMILIES.get(k, k)] += v["ms"]
        families["(untracked)"] = self.total_ms - tracked
        return {"total_ms": self.total_ms, "host_ms": self.host_ms, "tracked_ms": tracked,
                "untracked_ms": self.total_ms - tracked, "kernels": kernels,
                "families_ms": dict(sorted(families.items(), key=lambda kv: -kv[1])),
                "flops": sum(v["flops"] for v in kernels.values()),
                "ceilings": self.ceilings, "allocations": self.timeline.summary()}

    def table(self, top: int = 15) -> str:
        s = self.summary()
        lines = [(f"{'kernel':20}{'calls':>7}{'device ms':>11}{'%':>7}{'host ms':>10}{'TFLOP/s':>9}{'GB/s':>9}"
                  f"{'% ceil':>8}")]
        for name, k in list(s["kernels"].items())[:top]:
            frac = "" if k["ceiling_fraction"] is None else f"{100 * k['ceiling_fraction']:.1f}"
            tf = f"{k['tflops']:.3f}" if k["flops"] and k["tflops"] is not None else ""
            gb = f"{k['gbps']:.1f}" if k["gbps"] is not None else ""
            lines.append(f"{name:20}{k['calls']:7d}{k['ms']:11.2f}{100 * k['ms'] / s['total_ms']:7.1f}"
                         f"{k['host_ms']:10.2f}{tf:>9}{gb:>9}{frac:>8}")
        lines.append(f"{'(untracked)':20}{'':7}{s['untracked_ms']:11.2f}"
                     f"{100 * s['untracked_ms'] / s['total_ms']:7.1f}")
        lines.append(f"{'total':20}{'':7}{s['total_ms']:11.2f}{100.0:7.1f}{s['host_ms']:10.2f}")
        a = s["allocations"]
        if a["allocs"] or a["frees"]:
            lines.append(f"timeline: {a['allocs']} allocations, {a['frees']} frees, peak {a['peak_bytes'] / 2 ** 20:.1f} "
                         f"MiB allocated")
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
        events += self.timeline.to_chrome_counter()
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def write(self, folder, title: str = "kiln profile") -> dict:
        """Everything into folder: trace.json (Perfetto), profile.txt and profile.json (the table and the
        summary), allocations.csv and memory.png (the timeline), report.html and report.png (one page)."""
        from pathlib import Path

        from kiln.profiler.report import write_report
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.export_chrome_trace(folder / "trace.json")
        s = self.summary()
        (folder / "profile.txt").write_text(self.table() + "\n")
        (folder / "profile.json").write_text(json.dumps(s, indent=1))
        self.timeline.write_csv(folder / "allocations.csv")
        self.timeline.plot(folder / "memory.png")
        write_report(s, self.timeline, folder, title)
        return s
