"""How attention_fwd_tma's persistent blocks share its jobs, simulated on the CPU at the paper's shapes.

    python benchmarks/attention_schedule.py [--sms 132] [--job-overhead 0.5] [--out FILE]

A job is 128 query rows of one head (causal: n_tiles = its row block + 1 key tiles of 128); its cost
is n_tiles + the overhead (Q's load and the output's store, in tiles). Three ways of handing out jobs:

- static: block i takes jobs i, i + SMs, ... numbered longest rows first, heads inside (the kernel
  until 38bfd1e);
- ticket, one group: a block takes the next job as it frees up, in that same numbering;
- ticket, head groups: the same, jobs numbered by groups of `tma_head_group` heads, longest rows
  first inside a group (TmaJob, the kernel's order since 38bfd1e).

Per shape and order: the most loaded block's cost against the mean (1.00 = level; the kernel takes
as long as its most loaded block), and the distinct heads among the first SMs jobs (whose K/V the
blocks read at once: 256 KiB a head at T 1024, D 64, bf16). Prints the table and writes
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

from kiln.backend.cuda.attention import TMA_KEYS, TMA_ROWS, tma_head_group  # noqa: E402


def job(w: int, n_bh: int, n_mb: int, group: int) -> tuple[int, int]:
    """(head, row block) of job w, numbered as TmaJob numbers them."""
    g0 = w // (group * n_mb) * group
    size = min(group, n_bh - g0)
    r = w - g0 * n_mb
    return g0 + r % size, n_mb - 1 - r // size


def n_tiles(mb: int) -> int:
    """Key tiles of causal row block mb (n_q = n_k, no offset)."""
    return ((mb + 1) * TMA_ROWS - 1) // TMA_KEYS + 1


def loads(order: list[tuple[int, int]], sms: int, overhead: float, ticket: bool) -> list[float]:
    """Each block's total cost: jobs taken in order, by the block that frees first (ticket) or by index."""
    if not ticket:
        tot = [0.0] * sms
        for i, (_, mb) in enumerate(order):
            tot[i % sms] += n_tiles(mb) + overhead
        return tot
    heap = [(0.0, i) for i in range(sms)]
    for _, mb in order:
        t, i = heapq.heappop(heap)
        heapq.heappush(heap, (t + n_tiles(mb) + overhead, i))
    return [t for t, _ in heap]


def simulate(shape, sms: int, overhead: float) -> dict:
    b, h, t, _ = shape
    n_bh, n_mb = b * h, -(-t // TMA_ROWS)
    group = tma_head_group(n_bh, t, sms)
    one = [job(w, n_bh, n_mb, n_bh) for w in range(n_bh * n_mb)]
    grouped = [job(w, n_bh, n_mb, group) for w in range(n_bh * n_mb)]
    mean = sum(n_tiles(mb) + overhead for _, mb in one) / min(sms, len(one))
    row = {"shape": "x".join(map(str, shape)), "jobs": len(one), "group": group}
    for name, order, ticket in (("static", one, False), ("ticket", one, True), ("grouped", grouped, True)):
        row[name] = max(loads(order, sms, overhead, ticket)) / mean
        row[name + "_heads"] = len({hd for hd, _ in order[:sms]})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132, help="persistent blocks (the H100's and H200's SMs)")
    ap.add_argument("--job-overhead", type=float, default=0.5, help="a job's cost beyond its key tiles, in tiles")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [simulate(s, args.sms, args.job_overhead) for s in SHAPES]
    lines = [f"# attention_fwd_tma's job schedule, simulated ({args.sms} blocks, a job's overhead "
             f"{args.job_overhead} tile)", "", "`python benchmarks/attention_schedule.py`: the most loaded block "
             "against the mean (1.000 = level), and the distinct heads among the first jobs taken at once.", "",
             "| B x H x T x D | jobs | heads a group | static | ticket, one group | ticket, head groups |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['jobs']} | {r['group']} | {r['static']:.3f} ({r['static_heads']} heads) | "
                     f"{r['ticket']:.3f} ({r['ticket_heads']}) | {r['grouped']:.3f} ({r['grouped_heads']}) |")
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
