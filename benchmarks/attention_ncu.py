"""One call of each attention kernel, kiln's and PyTorch SDPA's, for Nsight Compute to profile.

    ncu --clock-control none --profile-from-start off --set full python benchmarks/attention_ncu.py [--shape 16x12x1024x64]
        [--calls forward,split-tma,split,fused-bulk,fused-tma,sdpa]

Causal bf16 at one BxHxTxD (default GPT-2 124M's 16x12x1024x64): every kernel is first run twice
unprofiled (compiled, autotuned, caches warm), then the profiler range (cudaProfilerStart/Stop)
holds exactly one call each of kiln's forward (KILN_ATTENTION_FWD as set, default tma-pingpong), its
split-tma backward (dQ forming delta, dK/dV), its split backward (delta, dK/dV, dQ), its fused-bulk backward,
its fused-tma backward (delta, dK/dV/dQ, dq_store) and SDPA's forward+backward (or those --calls names), in that
order, each after a device synchronisation, so `--profile-from-start off` profiles those kernels
and nothing else. Prints which call each range holds; ncu prints the kernels' sections.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import parse_shapes  # noqa: E402
from kernel_speed import BF16, kiln_and_torch, sdpa_fwd_bwd  # noqa: E402

CALLS = ("forward", "split-tma", "split", "fused-bulk", "fused-tma", "sdpa")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="16x12x1024x64", help="BxHxTxD, as attention.py's --shapes")
    p.add_argument("--calls", default=",".join(CALLS), help="comma-separated, of " + ",".join(CALLS))
    args = p.parse_args(argv)
    names = args.calls.split(",")
    if set(names) - set(CALLS):
        p.error(f"--calls takes some of {','.join(CALLS)}; got {args.calls!r}")
    try:
        shapes = parse_shapes(args.shape)
    except ValueError as e:
        p.error(str(e))
    if len(shapes) != 1:
        p.error(f"--shape takes one shape; got {len(shapes)}")
    [shape] = shapes
    k, torch = kiln_and_torch()
    if k is None:
        return 2
    import cupy
    scale = 1.0 / math.sqrt(shape[3])
    gen = k.new_generator(0)
    q, kk, v, g = (k.rng_normal(gen, shape, BF16) for _ in range(4))
    tq, tk, tv = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    tg = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out, lse = k.attention_fwd(q, kk, v, scale)

    def backward(variant):
        def run():
            os.environ["KILN_ATTENTION_BWD"] = variant
            k.attention_bwd(g, q, kk, v, out, lse, scale)
        return run

    runs = {"forward": ("kiln forward", lambda: k.attention_fwd(q, kk, v, scale)),
            **{b: (f"kiln backward {b}", backward(b)) for b in CALLS[1:-1]},
            "sdpa": ("sdpa forward+backward", lambda: sdpa_fwd_bwd(tq, tk, tv, tg))}
    calls = [runs[n] for n in CALLS if n in names]
    for _, run in calls * 2:
        run()
    cupy.cuda.runtime.deviceSynchronize()
    for name, run in calls:
        print(f"profiled: {name} at {'x'.join(map(str, shape))}", flush=True)
        torch.cuda.profiler.start()
        run()
        cupy.cuda.runtime.deviceSynchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
