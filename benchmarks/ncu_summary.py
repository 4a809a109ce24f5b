"""A Markdown digest of an Nsight Compute report: per launch the figures that say where a kernel's
time goes, per kernel its warps' stall reasons and the SASS instructions they stall on.

    ncu --import report.ncu-rep --page details > details.log
    ncu --import report.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_summary.py details.log [sass.csv] [--out summary.md] [--top 8]

The details page gives, per launch, duration, DRAM throughput (and the bytes it implies: its rate
times the duration), L2 hit rate, registers, achieved occupancy and issue-slot use. The per-instruction
page (optional; tens of MB for a few kernels) gives stall samples: their split by reason, and the
instructions that collect the most. A kernel that appears in several blocks of that page (ncu
prints some more than once) is read from its first block.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

# details page: a launch begins with "  <kernel signature> (grid)x(block), Context ..., Device ..., CC ..."
LAUNCH = re.compile(r"^  (\S.*) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
# metric rows: "    Name   [Unit]   Value" (columns two or more spaces apart)
ROW = re.compile(r"^    (\S.*?)\s{2,}(?:(\S+)\s{2,})?\s*([\d,]+(?:\.\d+)?)$")
BYTE_RATE = {"byte/s": 1.0, "Kbyte/s": 1e3, "Mbyte/s": 1e6, "Gbyte/s": 1e9, "Tbyte/s": 1e12}
TIME = {"ns": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0}
FIELDS = ("Duration", "DRAM Throughput", "L2 Hit Rate", "Registers Per Thread", "Achieved Occupancy",
          "Issue Slots Busy")


def short_name(signature: str) -> str:
    """'void attention_fwd_tma<__nv_bfloat16, 64, 1>(TmaMap, ...)' -> 'attention_fwd_tma<__nv_bfloat16, 64, 1>'."""
    s = signature.removeprefix("void ").strip()
    depth = 0
    for i, ch in enumerate(s):  # the argument list is the first '(' outside template brackets
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:
            return s[:i]
    return s


def parse_details(text: str) -> list[dict]:
    """One dict per launch: name, grid, block, and FIELDS (first occurrence each) plus the DRAM bytes."""
    launches = []
    for line in text.splitlines():
        m = LAUNCH.match(line)
        if m:
            launches.append({"name": short_name(m.group(1)), "grid": tuple(map(int, m.group(2, 3, 4))),
                             "block": tuple(map(int, m.group(5, 6, 7))), "_rate": None})
            continue
        m = ROW.match(line)
        if not m or not launches:
            continue
        name, unit, value = m.group(1).strip(), m.group(2) or "", float(m.group(3).replace(",", ""))
        cur = launches[-1]
        if name == "Duration":
            cur.setdefault("Duration", value * TIME.get(unit, float("nan")) * 1e6)  # microseconds
        elif name == "Memory Throughput" and unit in BYTE_RATE:
            cur["_rate"] = cur["_rate"] or value * BYTE_RATE[unit]
        elif name in FIELDS:
            cur.setdefault(name, value)
    for cur in launches:
        rate = cur.pop("_rate")
        cur["DRAM MB"] = rate * cur["Duration"] * 1e-6 / 1e6 if rate and "Duration" in cur else float("nan")
    return launches


def parse_sass(rows) -> dict[str, dict]:
    """Per kernel (first block only): stall samples by reason and the instructions with the most samples."""
    kernels: dict[str, dict] = {}
    name = header = None
    for r in rows:
        if not r:
            continue
        if r[0] == "Kernel Name":
            name, header = short_name(r[1]), None
            continue
        if r[0] == "Address":
            header = {h: i for i, h in enumerate(r)}
            if name in kernels:
                name = None  # a repeated block: skip it
            else:
                kernels[name] = {"reasons": Counter(), "instructions": []}
            continue
        if name is None or header is None:
            continue
        k = kernels[name]
        samples = _number(r[header["Warp Stall Sampling (All Samples)"]])
        k["instructions"].append((samples, r[header["Source"]].strip()))
        for h, i in header.items():
            if h.startswith("stall_") and "(Not Issued)" not in h:
                k["reasons"][h.removeprefix("stall_")] += _number(r[i])
    return kernels


def _number(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


COLUMNS = (("us", "Duration", ".1f"), ("DRAM %", "DRAM Throughput", ".1f"), ("DRAM MB", "DRAM MB", ".1f"),
           ("L2 hit %", "L2 Hit Rate", ".1f"), ("regs", "Registers Per Thread", ".0f"),
           ("occupancy %", "Achieved Occupancy", ".1f"), ("issue busy %", "Issue Slots Busy", ".1f"))


def render(launches: list[dict], kernels: dict[str, dict], top: int) -> str:
    out = ["| # | kernel | grid x block | " + " | ".join(c[0] for c in COLUMNS) + " |",
           "|---|---|---|" + "---|" * len(COLUMNS)]
    for i, k in enumerate(launches):
        cells = [format(k.get(key, float("nan")), fmt) for _, key, fmt in COLUMNS]
        grid = "x".join(map(str, k["grid"])) + " x " + "x".join(map(str, k["block"]))
        out.append(f"| {i} | `{k['name']}` | {grid} | " + " | ".join(cells) + " |")
    for name, k in kernels.items():
        total = sum(k["reasons"].values())
        if not total:
            continue
        out += ["", f"### `{name}`: {total:.0f} stall samples", "",
                ", ".join(f"{r} {100 * v / total:.1f}%" for r, v in k["reasons"].most_common(6)), "",
                "| samples | % | SASS |", "|---|---|---|"]
        for samples, src in sorted(k["instructions"], key=lambda t: -t[0])[:top]:
            out.append(f"| {samples:.0f} | {100 * samples / total:.1f} | `{src}` |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("details", help="ncu --page details output")
    ap.add_argument("sass", nargs="?", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--out", help="write the Markdown here (default: stdout)")
    ap.add_argument("--top", type=int, default=8, help="instructions listed per kernel")
    args = ap.parse_args(argv)
    launches = parse_details(Path(args.details).read_text(errors="replace"))
    if not launches:
        print(f"ncu_summary: no kernel launch found in {args.details}", file=sys.stderr)
        return 1
    kernels = {}
    if args.sass:
        with open(args.sass, newline="", errors="replace") as f:
            kernels = parse_sass(csv.reader(f))
    text = render(launches, kernels, args.top)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
