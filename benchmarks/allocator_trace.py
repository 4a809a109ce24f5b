"""What a GPT training step asks of kiln's allocator, eagerly and captured as a CUDA graph, on the CPU.

Issue 14: the 76-layer fp32 GPT (d=3072, B2 T1024, 8.77B parameters) ran eagerly on the H200 but its
capture ran out of memory ("reserved 149,505,745,408 bytes"). The capture cannot give cached blocks
back to the driver, so its pool holds what the step's requests need without any flush: with blocks
reused only by requests of their exact size, that is, for every size, the most blocks of that size
live at once, summed over the sizes, far above the peak of live bytes when activations (forward)
and weight gradients (backward) peak at different times in different sizes.

This program writes a synthetic trace of the step (the requests kiln's GPT makes, in order: zero_grad
frees last step's gradients, the forward keeps each layer's activations, the backward frees them as
it makes the weight gradients) and replays it:
- before: the exact-size pool (`allocator.simulate`, the best of the old large roundings);
- after: kiln's CachingAllocator over a fake driver, as the benchmark runs it: parameters and AdamW
  moments, two eager steps (the first followed by end_warmup), the cache returned, then the step
  captured into a GraphPool.
It prints the bytes each needs from the driver beside the peak of live bytes. Nothing is timed.

    python benchmarks/allocator_trace.py --n-layer 76
    python benchmarks/allocator_trace.py --replay trace.json   # a trace recorded on the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kiln.backend.cuda.allocator import (  # noqa: E402
    CachingAllocator,
    GraphPool,
    OutOfMemoryError,
    Rounding,
    simulate,
)

OLD_LARGE_GRANULARITIES = (512, 4096, 65536, 131072, 524288, 1 << 21, 1 << 22)  # the exact-size allocator's


class FakeDevice:
    """cudaMalloc/cudaFree stand-ins: a capacity, increasing addresses, and the peak of bytes in use."""

    def __init__(self, capacity: int):
        self.capacity, self.used, self.peak, self.next, self.blocks = capacity, 0, 0, 1 << 30, {}

    def malloc(self, size, device_id):
        if self.used + size > self.capacity:
            raise MemoryError(f"fake device full: {self.used} + {size} > {self.capacity} bytes")
        ptr, self.next = self.next, self.next + size + (1 << 21)
        self.blocks[ptr] = size
        self.used += size
        self.peak = max(self.peak, self.used)
        return ptr

    def free(self, ptr, device_id):
        self.used -= self.blocks.pop(ptr)


class StepTrace:
    """Allocation events of an fp32 GPT step with AdamW, as ("alloc", id, bytes) and ("free", id, 0)."""

    def __init__(self, n_layer: int, d: int, batch: int, seq: int, vocab: int = 50304, head_dim: int = 128):
        self.n_layer, self.d, self.bt, self.seq, self.vocab = n_layer, d, batch * seq, seq, vocab
        self.lse = batch * (d // head_dim) * seq * 4
        self.events: list = []
        self._next = 0

    def alloc(self, nbytes: int) -> int:
        ident, self._next = self._next, self._next + 1
        self.events.append(("alloc", ident, int(nbytes)))
        return ident

    def free(self, *idents) -> None:
        self.events.extend(("free", i, 0) for i in idents)

    def param_shapes(self) -> list:
        d, layer = self.d, [(self.d,), (self.d,), (3 * self.d, self.d), (3 * self.d,), (self.d, self.d), (self.d,),
                            (self.d,), (self.d,), (4 * self.d, self.d), (4 * self.d,), (self.d, 4 * self.d), (self.d,)]
        return [(self.vocab, d), (self.seq, d)] + layer * self.n_layer + [(d,), (d,)]

    def persistent(self) -> None:
        """Parameters, then AdamW's two moments per parameter: live for the whole run."""
        for _ in range(3):
            for shape in self.param_shapes():
                n = 4
                for s in shape:
                    n *= s
                self.alloc(n)

    def step(self, grads: list) -> list:
        """One step; frees `grads` (last step's) first, returns this step's gradients (live at its end)."""
        d, bt, f = self.d, self.bt, 4
        act, row = bt * d * f, bt * f
        self.free(*grads)  # zero_grad(set_to_none=True)
        x = self.alloc(act)  # token + position embeddings
        saved = []
        for _ in range(self.n_layer):
            y1, s1 = self.alloc(act), self.alloc(2 * row)  # ln_1 out, mean and rstd
            qkv = self.alloc(3 * act)
            att, lse = self.alloc(act), self.alloc(self.lse)
            p = self.alloc(act)
            x1 = self.alloc(act)  # x + attn proj
            self.free(p)
            y2, s2 = self.alloc(act), self.alloc(2 * row)
            h = self.alloc(4 * act)
            g = self.alloc(4 * act)  # gelu
            m = self.alloc(act)
            x2 = self.alloc(act)  # x1 + mlp
            self.free(m)
            saved.append((x, y1, s1, qkv, att, lse, x1, y2, s2, h, g))
            x = x2
        yf, sf = self.alloc(act), self.alloc(2 * row)
        logits = self.alloc(bt * self.vocab * f)
        loss = self.alloc(4)
        # backward
        dlogits = self.alloc(bt * self.vocab * f)
        self.free(logits)
        gw = [self.alloc(self.vocab * d * f)]  # the tied wte gradient
        dyf = self.alloc(act)
        self.free(dlogits, loss)
        dx = self.alloc(act)
        gw += [self.alloc(d * f), self.alloc(d * f)]  # ln_f
        self.free(dyf, yf, sf, x)
        for (x_in, y1, s1, qkv, att, lse, x1, y2, s2, h, g) in reversed(saved):
            gw += [self.alloc(4 * d * d * f), self.alloc(d * f)]  # c_proj of the mlp
            dg = self.alloc(4 * act)
            self.free(g)
            dh = self.alloc(4 * act)
            self.free(dg, h)
            gw += [self.alloc(4 * d * d * f), self.alloc(4 * d * f)]  # c_fc
            dy2 = self.alloc(act)
            self.free(dh, y2)
            dx2 = self.alloc(act)
            gw += [self.alloc(d * f), self.alloc(d * f)]  # ln_2
            self.free(dy2, s2, x1)
            dxa = self.alloc(act)
            self.free(dx, dx2)
            gw += [self.alloc(d * d * f), self.alloc(d * f)]  # attn c_proj
            datt = self.alloc(act)
            dqkv = self.alloc(3 * act)
            self.free(datt, att, lse, qkv)
            gw += [self.alloc(3 * d * d * f), self.alloc(3 * d * f)]  # c_attn
            dy1 = self.alloc(act)
            self.free(dqkv, y1)
            dx1 = self.alloc(act)
            gw += [self.alloc(d * f), self.alloc(d * f)]  # ln_1
            self.free(dy1, s1, x_in)
            dx = self.alloc(act)
            self.free(dxa, dx1)
        gw.append(self.alloc(self.seq * d * f))  # wpe
        self.free(dx)
        norm = self.alloc(4)  # the fused clip's norm; AdamW updates in place
        self.free(norm)
        return gw


def exact_size_need(n_layer, d, batch, seq, vocab=50304) -> dict:
    """Bytes the exact-size pool's capture needs from the driver: parameters and moments, plus the
    capture's pool (the last eager step's gradients, freed into it, and every block the step adds)."""
    t = StepTrace(n_layer, d, batch, seq, vocab)
    t.persistent()
    persistent = sum(size for _, _, size in t.events)
    t.events = []
    grads = t.step([])  # the eager step whose gradients the capture frees
    t.events = [e for e in t.events if e[0] == "alloc" and e[1] in set(grads)]
    t.step(grads)
    best = min((simulate(t.events, Rounding(512, g)) for g in OLD_LARGE_GRANULARITIES), key=lambda s: s["reserved"])
    return {"persistent": persistent, "capture_reserved": persistent + best["reserved"],
            "peak_live": persistent + best["peak_requested"]}


def run_allocator(n_layer, d, batch, seq, capacity: int, capture: bool = True, vocab=50304,
                  log: list | None = None) -> dict:
    """The trace through kiln's allocator over a fake device: persistent state, two eager steps (end_warmup
    after the first), the cache returned, the third step captured (or eager). Driver bytes at the peak.
    `log` gets the run's events as graph_capture_size.py --save-trace writes them."""
    dev = FakeDevice(capacity)
    a = CachingAllocator(dev.malloc, dev.free)
    if log is not None:
        a.observers.append(lambda kind, ptr, requested, rounded: log.append((kind, ptr, requested, a.capturing)))
    t = StepTrace(n_layer, d, batch, seq, vocab)
    ptrs: dict = {}

    def play(start: int) -> None:
        for kind, ident, size in t.events[start:]:
            if kind == "alloc":
                ptrs[ident] = a.malloc(size)
            else:
                a.free(ptrs.pop(ident))

    t.persistent()
    play(0)
    grads, mark = [], len(t.events)
    for i in range(2):
        grads = t.step(grads)
        play(mark)
        mark = len(t.events)
        if i == 0:
            a.end_warmup()
            if log is not None:
                log.append(("end_warmup", 0, 0, False))
    eager_peak = dev.peak
    a.release_unused()
    dev.peak = dev.used
    pool = GraphPool()
    with a.capture_into(pool) if capture else contextlib.nullcontext():
        t.step(grads)
        play(mark)
    st = a.memory_stats()
    return {"eager_driver_peak": eager_peak, "driver_peak": dev.peak, "reserved": st["reserved_bytes"],
            "peak_allocated": st["peak_allocated_bytes"], "graph_pool": pool.reserved_bytes,
            "segments": st["num_segments"], "problems": a.integrity_problems()}


def replay_recorded(events: list, capacity: int) -> dict:
    """A run recorded on the GPU (graph_capture_size.py --save-trace) through kiln's allocator over a fake
    device: its end_warmup where the run called it, the cache returned and a GraphPool entered where its
    capture began. The driver's peak before and during the capture, or where it ran out."""
    dev = FakeDevice(capacity)
    a = CachingAllocator(dev.malloc, dev.free)
    ptrs: dict = {}
    capture, eager_peak, done = None, None, 0
    try:
        for kind, ptr, requested, capturing in events:
            if kind == "end_warmup":
                a.end_warmup()
            elif capturing and capture is None and eager_peak is None:
                eager_peak = dev.peak
                a.release_unused()
                dev.peak = dev.used
                capture = a.capture_into(GraphPool())
                capture.__enter__()
            elif not capturing and capture is not None:
                capture.__exit__(None, None, None)
                capture = None
            if kind == "alloc":
                ptrs[ptr] = a.malloc(requested)
            elif kind == "free" and ptr in ptrs:
                a.free(ptrs.pop(ptr))
            done += 1
        failure = None
    except OutOfMemoryError as e:
        failure = f"event {done} of {len(events)}: {e}"
    st = a.memory_stats()
    return {"events": len(events), "eager_driver_peak": dev.peak if eager_peak is None else eager_peak,
            "capture_driver_peak": None if eager_peak is None else dev.peak,
            "peak_allocated": st["peak_allocated_bytes"], "failure": failure, "problems": a.integrity_problems()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=76)
    ap.add_argument("--n-embd", type=int, default=3072)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--capacity", type=float, default=150.7e9, help="the fake device's bytes (H200: ~150.7e9)")
    ap.add_argument("--replay", metavar="PATH", help="a trace recorded on the GPU (graph_capture_size.py "
                    "--save-trace) instead of the synthetic one")
    args = ap.parse_args()
    gb = 1e9
    if args.replay:
        events = json.loads(Path(args.replay).read_text())
        for capacity in (int(args.capacity), 1 << 60):
            got = replay_recorded(events, capacity)
            cap = "unlimited" if capacity == 1 << 60 else f"{capacity / gb:.1f} GB"
            during = got["capture_driver_peak"]
            print(f"{got['events']} events, device {cap}: driver peak {got['eager_driver_peak'] / gb:.2f} GB eagerly, "
                  f"{'no capture' if during is None else f'{during / gb:.2f} GB captured'}; peak allocated "
                  f"{got['peak_allocated'] / gb:.2f} GB; {got['failure'] or 'fits'}; bookkeeping problems: "
                  f"{got['problems'] or 'none'}", flush=True)
        return
    shape = (args.n_layer, args.n_embd, args.batch_size, args.seq_len)
    before = exact_size_need(*shape)
    print(f"persistent (parameters + AdamW moments): {before['persistent'] / gb:.2f} GB; "
          f"peak of live bytes in the step: {before['peak_live'] / gb:.2f} GB", flush=True)
    print(f"before (exact-size blocks), captured step needs {before['capture_reserved'] / gb:.2f} GB "
          f"from the driver ({'does not fit' if before['capture_reserved'] > args.capacity else 'fits'} "
          f"in {args.capacity / gb:.1f} GB)", flush=True)
    try:
        after = run_allocator(*shape, capacity=int(args.capacity))
        print(f"after (best-fit split blocks): eager steps peak at {after['eager_driver_peak'] / gb:.2f} GB, "
              f"the captured step at {after['driver_peak'] / gb:.2f} GB from the driver (peak allocated "
              f"{after['peak_allocated'] / gb:.2f} GB, graph pool {after['graph_pool'] / gb:.2f} GB, "
              f"{after['segments']} segments); bookkeeping problems: {after['problems'] or 'none'}", flush=True)
    except MemoryError as e:
        print(f"after (best-fit split blocks): does not fit: {e}", flush=True)


if __name__ == "__main__":
    main()
