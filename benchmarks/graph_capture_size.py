"""Does the largest fp32 AdamW step capture as a CUDA graph? (issue 14: the 76-layer d=3072 model failed
with cudaErrorStreamCaptureUnsupported.) Builds GPT(d=3072, 24 heads, --n-layer) in fp32 on the GPU, runs
two eager steps (as the Trainer does), captures the step and replays it (or, as the Trainer, runs op by
op when the capture fails); prints whether the capture held, the step times and the peak memory. Writes
nothing: one line per phase.

    python benchmarks/graph_capture_size.py --n-layer 76 --batch-size 2 --seq-len 1024 [--save-trace run.json]
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-layer", type=int, default=76)
    ap.add_argument("--n-embd", type=int, default=3072)
    ap.add_argument("--n-head", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--save-trace", metavar="PATH", help="write every allocation and free of the run (JSON: kind, "
                    "address, bytes, whether a graph was captured) for `benchmarks/allocator_trace.py --replay PATH`")
    args = ap.parse_args()
    import numpy as np

    import kiln
    from kiln.graph import CapturedStep, GraphCaptureError
    from kiln.nn import GPT, preset
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import plain_step

    dev = kiln.device("cuda")
    events: list = []
    if args.save_trace:  # every request from the model's build on, replayable on the CPU
        from kiln.backend.cuda import allocator
        alloc = allocator.install()
        alloc.observers.append(lambda kind, ptr, requested, rounded: events.append((kind, ptr, requested,
                                                                                    alloc.capturing)))
        atexit.register(lambda: Path(args.save_trace).write_text(json.dumps(events)))
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        print(f"device memory: {free} bytes free of {total} (replay the trace with --capacity {free})", flush=True)
    t0 = time.perf_counter()
    cfg = preset("gpt2-124m", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, block_size=args.seq_len)
    model = GPT(cfg, generator=kiln.Generator(1)).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95))
    backend = dev.backend
    print(f"model: {n_params / 1e9:.2f}B parameters, built in {time.perf_counter() - t0:.0f} s", flush=True)
    rng = np.random.default_rng(0)

    def batch():
        tokens = rng.integers(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1))
        return kiln.tensor(tokens[:, :-1], device=dev), kiln.tensor(tokens[:, 1:], device=dev)

    step = plain_step(model, opt)  # the Trainer's step: the clip fused into AdamW

    for i in range(2):
        t0 = time.perf_counter()
        loss = step(*batch()).item()
        if i == 0:
            backend.end_warmup()
            events.append(("end_warmup", 0, 0, False))
        print(f"eager step {i}: loss {loss:.4f}, {time.perf_counter() - t0:.2f} s", flush=True)
    graph = CapturedStep(step)
    try:
        t0 = time.perf_counter()
        loss = graph(*batch()).item()
        print(f"captured and replayed: loss {loss:.4f}, {time.perf_counter() - t0:.2f} s", flush=True)
        run = graph
    except GraphCaptureError as e:
        print(f"capture FAILED, continuing op by op: {e}", flush=True)
        run = step
    for i in range(args.replays):
        backend.synchronize()
        t0 = time.perf_counter()
        loss = run(*batch()).item()
        dt = time.perf_counter() - t0
        print(f"{'replay' if run is graph else 'eager'} {i}: loss {loss:.4f}, {dt * 1e3:.0f} ms, "
              f"{args.batch_size * args.seq_len / dt:.0f} tok/s", flush=True)
    stats = backend.memory_stats()
    print(f"peak allocated {stats['peak_allocated_bytes'] / 2**30:.2f} GiB, reserved now "
          f"{stats['reserved_bytes'] / 2**30:.2f} GiB, graph pool {stats['graph_pool_bytes'] / 2**30:.2f} GiB, "
          f"ooms {stats['num_ooms']}", flush=True)


if __name__ == "__main__":
    main()
