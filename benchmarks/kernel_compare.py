"""Two frameworks' GPU kernels of the same step, side by side by kernel family: where one spends more time.

    python benchmarks/kernel_compare.py KILN.txt PEER.txt [--names kiln,compile] [--out FILE.md] [--plot FILE.png]

Reads the kernel tables `benchmarks/gpt2_step.py --kernel-profile DIR` writes (torch.profiler's, over N steps:
its first line says N), sorts every kernel into a family by its name (FAMILIES, first match; "other" for
none), and prints a markdown table of each family's milliseconds and launches a step in both, and the
difference. The tables list their 60 costliest kernels only, so a step's many small kernels may be missing
from both totals (the table says how many kernels it read).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# family -> a regular expression over the kernel's name (searched, case-sensitive), in the order tried
FAMILIES = (
    ("attention", r"attention_|flash|sdpa|fmha|compute_dot_do_o|convert_dq"),  # before GEMM: fmha_cutlassF_...
    # before GEMM: cuBLASLt's GELU epilogues (nvjet's geluauxbias, xmma's _aux_: the GELU's input kept or read back)
    # do the GELU's work inside the GEMM, so they are told from plain GEMMs and set beside the peer's GELU kernels
    ("GEMM + GELU epilogue", r"^(nvjet_|sm90_xmma_gemm).*(gelu|_aux)"),
    ("GEMM", r"^nvjet_|^sm90_xmma_gemm|cutlass|cublasLt::|gemm"),
    ("layer norm (+ residual add)", r"layer_norm"),
    ("GELU", r"gelu"),
    ("cross-entropy", r"cross_entropy|log_softmax|nll_loss"),
    ("AdamW and the clip", r"adamw|multi_tensor_apply|sumsq|scale_multi|_foreach_|adam"),
    ("bias gradients (column sums)", r"column_sum|reduce_kernel|red_fused_sum|fused_sum"),
    ("embedding", r"embedding"),
    ("memset / copy / cast", r"^Memset|^Memcpy|^memset|cupy_copy|_to_copy|cupy_fill"),
)
_UNITS = {"s": 1e3, "ms": 1.0, "us": 1e-3, "ns": 1e-6}


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def parse(text: str) -> tuple[int, list[tuple[str, float, int]]]:
    """(steps, [(kernel name, total ms, launches)]) of a kernel table: its rows with GPU time, host-side
    rows (cudaLaunchKernel and the like, no GPU time) left out."""
    lines = text.splitlines()
    m = re.search(r"of (\d+) steps", lines[0]) if lines else None
    if m is None:
        raise ValueError("not a gpt2_step.py kernel table: its first line names no 'of N steps'")
    rows = []
    for line in lines[1:]:
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) < 10 or not parts[-1].isdigit():
            continue
        t = re.fullmatch(r"([\d.]+)(s|ms|us|ns)", parts[-5])  # Self CUDA
        if t is None:
            continue
        ms = float(t.group(1)) * _UNITS[t.group(2)]
        if ms > 0:
            rows.append((parts[0], ms, int(parts[-1])))
    return int(m.group(1)), rows


def by_family(text: str) -> dict[str, tuple[float, float]]:
    """family -> (ms a step, launches a step)."""
    steps, rows = parse(text)
    out: dict[str, list[float]] = {}
    for name, ms, calls in rows:
        acc = out.setdefault(family(name), [0.0, 0.0])
        acc[0] += ms / steps
        acc[1] += calls / steps
    return {k: (v[0], v[1]) for k, v in out.items()}


def table(a: dict, b: dict, names: tuple[str, str]) -> str:
    order = [f for f, _ in FAMILIES] + ["other"]
    fams = sorted(set(a) | set(b), key=order.index)
    na, nb = names
    lines = [f"| family | {na} ms | {na} launches | {nb} ms | {nb} launches | {na} - {nb} ms |",
             "|---|---|---|---|---|---|"]
    rows = [(f, a.get(f, (0.0, 0.0)), b.get(f, (0.0, 0.0))) for f in fams]
    total = [tuple(sum(r[k][i] for r in rows) for i in (0, 1)) for k in (1, 2)]
    for f, (ma, ca), (mb, cb) in rows + [("**total**", *total)]:
        lines.append(f"| {f} | {ma:.2f} | {ca:.0f} | {mb:.2f} | {cb:.0f} | {ma - mb:+.2f} |")
    return "\n".join(lines)


def plot(a: dict, b: dict, names: tuple[str, str], path: Path) -> None:
    """A bar a framework for each family's milliseconds a step, the difference written beside each pair."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    order = [f for f, _ in FAMILIES] + ["other"]
    fams = sorted(set(a) | set(b), key=order.index)[::-1]  # the first family on top
    ys = range(len(fams))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(fams) + 1.2))
    va = [a.get(f, (0.0, 0.0))[0] for f in fams]
    vb = [b.get(f, (0.0, 0.0))[0] for f in fams]
    ax.barh([y + 0.2 for y in ys], va, height=0.4, label=names[0], color="#c0504d")
    ax.barh([y - 0.2 for y in ys], vb, height=0.4, label=names[1], color="#4f81bd")
    for y, x1, x2 in zip(ys, va, vb):
        ax.text(max(x1, x2) + 0.1, y, f"{x1 - x2:+.2f} ms", va="center", fontsize=8)
    ax.set_yticks(list(ys), fams)
    ax.set_xlabel("GPU time a step (ms)")
    ax.set_title(f"{names[0]} {sum(va):.1f} ms against {names[1]} {sum(vb):.1f} ms of kernels a step")
    ax.set_xlim(0, max(va + vb) * 1.25)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", help="a kernel table (kernels-<framework>-<mode>.txt)")
    p.add_argument("second", help="the peer's, of the same step")
    p.add_argument("--names", default=None, help="the two columns' names (default: from the tables' first lines)")
    p.add_argument("--out", help="also write the table to this markdown file")
    p.add_argument("--plot", help="also draw it: a PNG at this path")
    args = p.parse_args(argv)
    texts = [Path(f).read_text() for f in (args.first, args.second)]
    names = tuple(args.names.split(",")) if args.names else tuple(t.split(":", 1)[0] for t in texts)
    if len(names) != 2:
        p.error("--names takes two names, comma-separated")
    try:
        fams = by_family(texts[0]), by_family(texts[1])
    except ValueError as e:
        p.error(str(e))
    md = table(*fams, names)
    print(md)
    if args.out:
        Path(args.out).write_text(md + "\n")
    if args.plot:
        plot(*fams, names, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
