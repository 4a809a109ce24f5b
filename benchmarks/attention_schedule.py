"""How attention_fwd_tma's persistent blocks share its jobs, simulated on the CPU at the paper's shapes.

    python benchmarks/attention_schedule.py [--sms 132] [--job-overhead 0.5] [--split-jobs 4,2,1] [--out FILE]

A job is 128 query rows of one head (causal: n_tiles = its row block + 1 key tiles of 128); its cost
is n_tiles + the overhead (Q's load and the output's store, in tiles). Three ways of handing out jobs:

- static: block i takes jobs i, i + SMs, ... numbered longest rows first, heads inside (the kernel
  until 38bfd1e);
- ticket, one group: a block takes the next job as it frees up, in that same numbering;
- ticket, head groups: the same, jobs numbered by groups of `head_group` heads, longest rows
  first inside a group (GroupedJob, the kernel's order since 38bfd1e; groups of even size since).

Per shape and order: the most loaded block's cost against the mean (1.00 = level; the kernel takes
as long as its most loaded block), and the distinct heads among the first SMs jobs (whose K/V the
blocks read at once: 256 KiB a head at T 1024, D 64, bf16). For the split kernels, head groups sized for
each of --split-jobs jobs a slot (the rule's GROUP_JOBS_PER_SLOT first), with the MiB of the heads in
flight's Q, K, V and dO (what dK/dV's blocks read; L2 is 50 MiB on an H100). Prints the table and writes
benchmarks/results/attention/schedule-<date>.md (or --out). A model, not a measurement: the device
A/B (benchmarks/ab.py) says what it is worth.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attention import SHAPES  # noqa: E402

from kiln.backend.cuda.attention import (  # noqa: E402
    GROUP_JOBS_PER_SLOT,
    RESIDENT_BLOCKS,
    TC_ROWS,
    TMA_ROWS,
    head_group,
)


def job(w: int, n_bh: int, n_blocks: int, group: int) -> tuple[int, int]:
    """(head, rank) of job w, numbered as GroupedJob numbers them (rank 0: the row block with the most tiles)."""
    g0 = w // (group * n_blocks) * group
    size = min(group, n_bh - g0)
    r = w - g0 * n_blocks
    return g0 + r % size, r // size


def loads(order: list[tuple[int, int]], n_blocks: int, slots: int, overhead: float, ticket: bool) -> list[float]:
    """Each slot's total cost (a causal row block of rank r walks n_blocks - r tiles, square tiles): jobs
    taken in order by the slot that frees first (a ticket, or the GPU's block dispatch) or by index."""
    cost = [n_blocks - rank + overhead for _, rank in order]
    if not ticket:
        tot = [0.0] * slots
        for i, c in enumerate(cost):
            tot[i % slots] += c
        return tot
    heap = [(0.0, i) for i in range(slots)]
    for c in cost:
        t, i = heapq.heappop(heap)
        heapq.heappush(heap, (t + c, i))
    return [t for t, _ in heap]


def simulate(shape, sms: int, overhead: float, split_jobs: tuple[int, ...] = (GROUP_JOBS_PER_SLOT,)) -> dict:
    """The TMA forward (128-row jobs, one block an SM) and the split kernels (64-row blocks, RESIDENT_BLOCKS an SM,
    started in launch order) under each order; the split kernels' groups sized for each of split_jobs jobs a slot."""
    b, h, t, d = shape
    n_bh = b * h
    row = {"shape": "x".join(map(str, shape))}
    # (name, heads a group: "all" in one, "one" a group (head-major), or a head_group's of k jobs a slot; a
    # ticket or a static stride)
    for kernel, rows, slots, orders in (
            ("fwd", TMA_ROWS, sms, (("static", "all", False), ("ticket", "all", True),
                                    ("grouped", GROUP_JOBS_PER_SLOT, True))),
            ("split", TC_ROWS, RESIDENT_BLOCKS * sms,
             (("head-major", "one", True), *((f"grouped{k}", k, True) for k in split_jobs)))):
        n_blocks = -(-t // rows)
        n = n_bh * n_blocks
        mean = sum(n_blocks - r + overhead for r in range(n_blocks)) * n_bh / min(slots, n)
        for name, heads, ticket in orders:
            g = {"all": n_bh, "one": 1}.get(heads) or head_group(n_bh, n_blocks, slots * heads // GROUP_JOBS_PER_SLOT)
            order = [job(w, n_bh, n_blocks, g) for w in range(n)]
            in_flight = len({hd for hd, _ in order[:slots]})
            row[f"{kernel}_{name}"] = max(loads(order, n_blocks, slots, overhead, ticket)) / mean
            row[f"{kernel}_{name}_heads"] = in_flight
            row[f"{kernel}_{name}_group"] = g
            row[f"{kernel}_{name}_mib"] = in_flight * 4 * t * d * 2 / 2 ** 20
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132, help="persistent blocks (the H100's and H200's SMs)")
    ap.add_argument("--job-overhead", type=float, default=0.5, help="a job's cost beyond its key tiles, in tiles")
    ap.add_argument("--split-jobs", default=str(GROUP_JOBS_PER_SLOT),
                    help="jobs a slot to size the split kernels' head groups for, comma-separated (the rule's first)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        split_jobs = tuple(int(k) for k in args.split_jobs.split(","))
    except ValueError:
        ap.error(f"--split-jobs takes positive integers, e.g. 4,2,1; got {args.split_jobs!r}")
    if not all(k > 0 for k in split_jobs):
        ap.error(f"--split-jobs takes positive integers, e.g. 4,2,1; got {args.split_jobs!r}")
    rows = [simulate(s, args.sms, args.job_overhead, split_jobs) for s in SHAPES]
    lines = [f"# The attention kernels' job orders, simulated ({args.sms} SMs, a job's overhead {args.job_overhead} tile)",
             "", "`python benchmarks/attention_schedule.py`: the most loaded block against the mean (1.000 = level), "
             "and the distinct heads among the first jobs running at once.", "",
             "attention_fwd_tma (128-row jobs, one block an SM):", "",
             "| B x H x T x D | heads a group | static stride | ticket, one group | ticket, head groups |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['fwd_grouped_group']} | {r['fwd_static']:.3f} ({r['fwd_static_heads']} heads) "
                     f"| {r['fwd_ticket']:.3f} ({r['fwd_ticket_heads']}) | {r['fwd_grouped']:.3f} "
                     f"({r['fwd_grouped_heads']}) |")
    lines += ["", f"The split tensor-core kernels (forward fallback, dK/dV, dQ: 64-row blocks, {RESIDENT_BLOCKS} an SM, "
              "started in launch order): the most loaded block against the mean (the heads in flight, their Q, K, "
              "V and dO in MiB; the heads a group):", "",
              "| B x H x T x D | head-major (before) | " + " | ".join(
                  f"head groups of {k} jobs a slot" + (" (the rule)" if k == GROUP_JOBS_PER_SLOT else "")
                  for k in split_jobs) + " |",
              "|---|---|" + "---|" * len(split_jobs)]
    for r in rows:
        cells = [f"{r[f'split_{o}']:.3f} ({r[f'split_{o}_heads']} heads, {r[f'split_{o}_mib']:.0f} MiB; "
                 f"{r[f'split_{o}_group']})" for o in ("head-major", *(f"grouped{k}" for k in split_jobs))]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = Path(args.out) if args.out else (ROOT / "benchmarks" / "results" / "attention" /
                                           f"schedule-{datetime.date.today()}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
