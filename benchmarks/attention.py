"""kiln's attention kernels against PyTorch SDPA on the same GPU, in one process, at the paper's shapes.

    python benchmarks/attention.py [--iters 20] [--dtypes bf16] [--fwd wgmma,tma] [--bwd split,fused-bulk]
                                   [--shapes 16x12x1024x64,...] [--ops fwd,bwd,fwd+bwd] [--out FILE]

Causal attention, forward and forward+backward, per B x H x T x D (Appendix B.1-B.2: B x H x D
from 1x12x64 to 16x12x64, 8x16x64, 4x32x128; T from 512 to 16384, 16384 tokens a batch on the
12x64 sweep): median milliseconds of one call on the GPU (ten calls recorded as one CUDA graph on
each side, the graph replayed between CUDA events: no host launch cost, as in a graph-replayed step;
until 2026-12-05 each call was timed alone, which for kiln counted ~0.25 ms of Python) and TFLOP/s of kiln and of
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)` (PyTorch's own backend
choice), and their ratio; with --fwd, kiln once per bf16/fp16 forward kernel named
(KILN_ATTENTION_FWD: tma-pingpong, the default, and tma, flash-attention 3's structure, or wgmma) against the same
SDPA timing, and with --bwd once per backward (KILN_ATTENTION_BWD: auto, the default: fused-tma at head dim 64 from
2048 queries, else split-tma at head dims 64 and 128, else split; or split, fused-bulk, split-tma, fused-tma;
KILN_ATTENTION_DKDV_TILES, read at import, sets the dK/dV kernel's tiles and is recorded in each row);
rows "bwd" time kiln's backward alone against SDPA's fwd+bwd minus its fwd. FLOPs count the causal
half: forward 4 B H T^2 D / 2, backward 2.5x that. --shapes and --ops narrow the run (an A/B of one kernel
need not pay for the others' timings). Prints a table and writes
benchmarks/results/attention/attention-<date>.json (or --out) and beside it a .png: per op, kiln's and SDPA's
TFLOP/s at each shape, the ratio above kiln's bar. `--plot FILE.json` draws a result file's plot again (no GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_speed import BF16, graph_ms, kiln_and_torch, sdpa_fwd_bwd, write_rows  # noqa: E402

SHAPES = [  # (B, H, T, D)
    (16, 12, 1024, 64),  # GPT-2 124M's step
    (1, 12, 1024, 64),
    (8, 16, 1024, 64),
    (32, 12, 512, 64),
    (8, 12, 2048, 64),
    (4, 12, 4096, 64),
    (2, 12, 8192, 64),
    (2, 12, 16384, 64),
    (4, 32, 2048, 128),
    (2, 16, 8192, 128),
]
# tf32: float32 operands with the products in tf32 on both sides (kiln's matmul precision "tf32": its *_tf32
# kernels; torch.backends.cuda.matmul.allow_tf32 for PyTorch, whose fp32 SDPA kernel is the same either way)
DTYPES = {"bf16": BF16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32), "tf32": np.dtype(np.float32)}
OPS = ("fwd", "bwd", "fwd+bwd")


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """The shapes of "BxHxTxD,..." (empty: the paper's, SHAPES); ValueError names what is not one."""
    if not text:
        return list(SHAPES)
    shapes = []
    for part in text.split(","):
        dims = part.strip().lower().split("x")
        if len(dims) != 4 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"a shape is B x H x T x D as four positive integers, e.g. 16x12x1024x64; got {part!r}")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def parse_ops(text: str) -> tuple[str, ...]:
    """The ops of "fwd,bwd,fwd+bwd" (any of them, in OPS' order); ValueError names what is not one."""
    ops = {o.strip() for o in text.split(",") if o.strip()}
    if not ops or ops - set(OPS):
        raise ValueError(f"--ops takes some of {', '.join(OPS)}; got {text!r}")
    return tuple(o for o in OPS if o in ops)


def bench_shape(k, shape, dtype, iters, fwd_kernels, bwd_kernels, ops=OPS):
    import torch
    import torch.nn.functional as F
    b, h, t, d = shape
    flops_fwd = 4 * b * h * t * t * d / 2
    gen = k.new_generator(0)
    q, kk, v, g = (k.rng_normal(gen, shape, dtype) for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    td = {BF16: torch.bfloat16, np.dtype(np.float16): torch.float16}.get(np.dtype(dtype), torch.float32)
    tq, tk, tv = (torch.randn(shape, device="cuda", dtype=td, requires_grad=True) for _ in range(3))
    tg = torch.randn(shape, device="cuda", dtype=td)
    out, lse = k.attention_fwd(q, kk, v, scale)

    def kiln_fwd_bwd():
        o, s = k.attention_fwd(q, kk, v, scale)
        return k.attention_bwd(g, q, kk, v, o, s, scale)

    def torch_fwd_bwd():
        sdpa_fwd_bwd(tq, tk, tv, tg)

    def torch_fwd():
        F.scaled_dot_product_attention(tq.detach(), tk.detach(), tv.detach(), is_causal=True)

    rows = []
    t_fwd = graph_ms(torch_fwd, iters, "torch")
    t_fwd_bwd = graph_ms(torch_fwd_bwd, iters, "torch") if set(ops) - {"fwd"} else float("nan")
    # bwd: kiln's backward alone (from one forward's out and lse) against SDPA's fwd+bwd minus its fwd
    for op, kfn, tms, flops, kernels in (
            ("fwd", lambda: k.attention_fwd(q, kk, v, scale), t_fwd, flops_fwd,
             [(f, None) for f in fwd_kernels]),
            ("bwd", lambda: k.attention_bwd(g, q, kk, v, out, lse, scale), t_fwd_bwd - t_fwd, 2.5 * flops_fwd,
             [(None, b_) for b_ in bwd_kernels]),
            ("fwd+bwd", kiln_fwd_bwd, t_fwd_bwd, 3.5 * flops_fwd,
             [(f, b_) for f in fwd_kernels for b_ in bwd_kernels])):
        if op not in ops:
            continue
        for fwd_kernel, bwd_kernel in kernels:
            if fwd_kernel:
                os.environ["KILN_ATTENTION_FWD"] = fwd_kernel
            if bwd_kernel:
                os.environ["KILN_ATTENTION_BWD"] = bwd_kernel
            kms = graph_ms(kfn, iters, "kiln")
            row = {"op": op, "dtype": np.dtype(dtype).name, "shape": list(shape), "fwd_kernel": fwd_kernel,
                   "bwd_kernel": bwd_kernel, "dkdv_tiles": os.environ.get("KILN_ATTENTION_DKDV_TILES", ""),
                   "kiln_ms": kms, "torch_ms": tms, "kiln_tflops": flops / kms / 1e9,
                   "torch_tflops": flops / tms / 1e9, "ratio": tms / kms}
            print(f"{'x'.join(map(str, shape)):18s} {op:8s} {row['dtype']:9s} {fwd_kernel or '-':12s} "
                  f"{bwd_kernel or '-':6s} {kms:9.3f} {tms:9.3f} {row['kiln_tflops']:8.1f} {row['torch_tflops']:8.1f} "
                  f"{row['ratio']:6.2f}x", flush=True)
            rows.append(row)
    os.environ.pop("KILN_ATTENTION_BWD", None)
    return rows


def plot(record: dict, path: Path) -> None:
    """One panel per op (fwd, bwd, fwd+bwd): kiln's and SDPA's TFLOP/s at each shape (bf16 rows, each kernel
    variant of kiln its own bar), sdpa ms / kiln ms written above kiln's bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = record["rows"]
    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    if not ops:
        raise ValueError("the record holds no attention rows to plot")
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.4 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        mine = [r for r in rows if r["op"] == op]
        shapes = list(dict.fromkeys("x".join(map(str, r["shape"])) + f" {r['dtype']}" for r in mine))
        kernels = list(dict.fromkeys(f"{r['fwd_kernel'] or ''}/{r['bwd_kernel'] or ''}".strip("/") for r in mine))
        width = 0.8 / (len(kernels) + 1)
        sdpa = {}
        for i, kern in enumerate(kernels):
            xs, ys, ratios = [], [], []
            for r in mine:
                if f"{r['fwd_kernel'] or ''}/{r['bwd_kernel'] or ''}".strip("/") != kern:
                    continue
                x = shapes.index("x".join(map(str, r["shape"])) + f" {r['dtype']}")
                xs.append(x + i * width)
                ys.append(r["kiln_tflops"])
                ratios.append(r["ratio"])
                sdpa.setdefault(x, r["torch_tflops"])
            bars = ax.bar(xs, ys, width, label=f"kiln {kern}")
            for bar, ratio in zip(bars, ratios):
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{ratio:.2f}x", ha="center",
                        va="bottom", fontsize=7)
        xs = sorted(sdpa)
        ax.bar([x + len(kernels) * width for x in xs], [sdpa[x] for x in xs], width, color="tab:gray",
               label="PyTorch SDPA")
        ax.set_xticks([x + len(kernels) * width / 2 for x in range(len(shapes))])
        ax.set_xticklabels(shapes, fontsize=7, rotation=15)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"causal attention {op} (ratio: SDPA ms / kiln ms)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{record.get('gpu', '')}, {record.get('date', '')} at {record.get('commit', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--dtypes", default="bf16", help="comma-separated: " + ",".join(DTYPES))
    p.add_argument("--fwd", default="tma-pingpong",
                   help="comma-separated bf16/fp16 forward kernels: tma-pingpong,tma,wgmma")
    p.add_argument("--bwd", default="auto", help="comma-separated bf16/fp16 backwards: auto,split,fused-bulk,split-tma,fused-tma")
    p.add_argument("--shapes", default="", help="comma-separated BxHxTxD (default: the paper's shapes)")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ",".join(OPS))
    p.add_argument("--out", default=None, help="result file (default benchmarks/results/attention/attention-<date>.json)")
    p.add_argument("--plot", default=None, metavar="FILE.json", help="draw a result file's plot (FILE.png) and stop")
    args = p.parse_args(argv)
    if args.plot:
        src = Path(args.plot)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        print(f"wrote {src.with_suffix('.png')}")
        return 0
    try:
        shapes, ops = parse_shapes(args.shapes), parse_ops(args.ops)
    except ValueError as e:
        p.error(str(e))
    k, torch = kiln_and_torch()
    if k is None:
        return 2
    print(f"{'B x H x T x D':18s} {'op':8s} {'dtype':9s} {'fwd':12s} {'bwd':6s} {'kiln ms':>9s} {'sdpa ms':>9s} {'kiln':>8s} {'sdpa':>8s} "
          f"{'ratio':>7s}  (TFLOP/s; ratio = sdpa ms / kiln ms)")
    rows = []
    for name in (n.strip() for n in args.dtypes.split(",")):
        k.set_matmul_precision("tf32" if name == "tf32" else "fp32")
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        for shape in shapes:
            rows += [dict(r, dtype=name) if name == "tf32" else r for r in
                     bench_shape(k, shape, DTYPES[name], args.iters, args.fwd.split(","), args.bwd.split(","), ops)]
    path = write_rows("attention", torch, args, rows)
    plot(json.loads(path.read_text()), path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
