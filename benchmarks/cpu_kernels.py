"""kiln's CPU kernels against PyTorch's on the same CPU, in one process: GELU, LayerNorm, attention.

    python benchmarks/cpu_kernels.py [--iters 15] [--only gelu,layer_norm,attention] [--out FILE]

At two sizes: the `tiny` preset's step (B16 T64, 128 wide, 4 heads) and GPT-2 124M's at B4 T1024 (768
wide, 12 heads), fp32. Per kernel: the median milliseconds of kiln's CPU backend and of PyTorch (its
eager CPU ops: F.gelu(approximate="tanh"), F.layer_norm, SDPA; the backward through autograd). Writes
benchmarks/results/cpu_kernels/cpu_kernels-<date>.json. For kiln before and after a change, run it in
both trees with `benchmarks/ab.py run`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
from result_file import run_fields, write_json

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"tiny": dict(b=16, t=64, c=128, h=4), "124m": dict(b=4, t=1024, c=768, h=12)}


def median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def cases(name: str, size: dict, rng):
    """(op, kiln fn, torch fn) for one size."""
    import torch
    import torch.nn.functional as F

    from kiln.backend import cpu
    b, t, c, h = size["b"], size["t"], size["c"], size["h"]
    n = b * t
    x = rng.standard_normal((n, 4 * c)).astype(np.float32)
    g = rng.standard_normal((n, 4 * c)).astype(np.float32)
    tx, tg = torch.from_numpy(x).requires_grad_(), torch.from_numpy(g)

    def kiln_gelu():
        cpu.gelu_fwd(x)
        return cpu.gelu_bwd(g, x)

    def torch_gelu():
        tx.grad = None
        F.gelu(tx, approximate="tanh").backward(tg)

    yield "gelu fwd", lambda: cpu.gelu_fwd(x), lambda: F.gelu(tx.detach(), approximate="tanh")
    yield "gelu fwd+bwd", kiln_gelu, torch_gelu

    xs, gs = x[:, :c].copy(), g[:, :c].copy()
    w, bias = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    txs, tw, tb = (torch.from_numpy(a).requires_grad_() for a in (xs, w, bias))
    tgs = torch.from_numpy(gs)

    def kiln_ln():
        _, mean, rstd = cpu.layer_norm_fwd(xs, w, bias, 1e-5)
        return cpu.layer_norm_bwd(gs, xs, w, mean, rstd, True, True)

    def torch_ln():
        txs.grad = tw.grad = tb.grad = None
        F.layer_norm(txs, (c,), tw, tb, 1e-5).backward(tgs)

    yield "layer_norm fwd", lambda: cpu.layer_norm_fwd(xs, w, bias, 1e-5), \
        lambda: F.layer_norm(txs.detach(), (c,), tw.detach(), tb.detach(), 1e-5)
    yield "layer_norm fwd+bwd", kiln_ln, torch_ln

    d = c // h
    q, k, v, go = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(4))
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    tgo = torch.from_numpy(go)
    scale = 1.0 / math.sqrt(d)

    def kiln_attn():
        out, lse = cpu.attention_fwd(q, k, v, scale)
        return cpu.attention_bwd(go, q, k, v, out, lse, scale)

    def torch_attn():
        tq.grad = tk.grad = tv.grad = None
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale).backward(tgo)

    yield "attention fwd", lambda: cpu.attention_fwd(q, k, v, scale), \
        lambda: F.scaled_dot_product_attention(tq.detach(), tk.detach(), tv.detach(), is_causal=True, scale=scale)
    yield "attention fwd+bwd", kiln_attn, torch_attn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--only", default="gelu,layer_norm,attention", help="comma-separated kernel families")
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ",".join(SIZES))
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/cpu_kernels/cpu_kernels-<date>.json)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    families = args.only.split(",")
    rows = []
    print(f"{'size':6s} {'op':20s} {'kiln ms':>9s} {'torch ms':>9s} {'kiln/torch time':>16s}", flush=True)
    for name in args.sizes.split(","):
        if name not in SIZES:
            print(f"unknown size {name!r}; allowed: {', '.join(SIZES)}", file=sys.stderr)
            return 2
        for op, kfn, tfn in cases(name, SIZES[name], np.random.default_rng(0)):
            if op.split()[0] not in families:
                continue
            kms, tms = median_ms(kfn, args.iters), median_ms(tfn, args.iters)
            rows.append({"size": name, **SIZES[name], "op": op, "kiln_ms": kms, "torch_ms": tms, "time_ratio": kms / tms})
            print(f"{name:6s} {op:20s} {kms:9.3f} {tms:9.3f} {kms / tms:15.2f}x", flush=True)
    record = {"benchmark": "cpu_kernels", **run_fields("cpu"), "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(), "iters": args.iters, "rows": rows}
    date = record["date"]
    write_json(record, Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "cpu_kernels" / f"cpu_kernels-{date}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
