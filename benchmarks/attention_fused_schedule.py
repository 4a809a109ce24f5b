"""Would a deterministic fused attention backward beat the split one? Its schedule, simulated on the CPU.

    python benchmarks/attention_fused_schedule.py [--sms 132] [--latency 0.5,1,2] [--overhead 0.3] [--copy 0,1.16]
                                                  [--stages 3] [--fused-overhead 2] [--out FILE]

The split backward (KILN_ATTENTION_BWD=split-tma, the default below 2048 queries) is bitwise repeatable because each dQ element is
written by one thread: its dQ kernel walks the key tiles again and recomputes S and dP, 7 products a (128 keys x
64 queries) pair where a fused kernel needs 5. A fused kernel adds each key block's dQ contribution into an fp32
accumulator; to stay deterministic the adds into one query tile must come in a fixed order, each key block waiting
for its turn (a semaphore a tile). This model asks what the waits cost.

A unit is one pair's fused products (Sᵀ, dPᵀ, dV, dK, dQ for 128 keys x 64 queries); the split's dK/dV kernel
spends 0.8 of it a pair and its dQ kernel 0.6. A fused job is one head's key block (causal: query tiles 2 kb ..
T/64 - 1, walked in order); after a tile's products the block waits until the key blocks before it in the
tile's order have added theirs, then issues its add (asynchronous: the next in line may add `latency` units
later) and goes on. Orders of the adds into a tile: descending key blocks (the last block that sees the tile
first; with the jobs handed out in that order a block reaches each tile after the block before it in line did,
so in lockstep it never waits) or ascending (the first key block first: flash-attention 3's deterministic mode
and kiln's v5 fused kernel, 2026-12-05). Jobs go to the SMs persistent blocks from a ticket, in the order the
adds need (a block only ever waits on jobs handed out before it: no deadlock), heads in groups of `group`.
Per shape: the split's and the fused kernel's makespans (units, the most loaded block's finish), each against
its ideal (work / SMs), and fused / split: the fused kernel's predicted time as a fraction of the split's.
The adds' own cost (--copy, units a tile): each block's one writer issues its tiles' adds in order, one at a
time, each taking `copy` units (the 16 KiB fp32 reduce-add read from its stage and taken by L2), and the
consumers run at most `stages` tiles ahead of it (a tile's stage is free once its add has been read). Copy 0 is
the first model's free adds. Measured on an H100 (2026-12-07, benchmarks/results/attention/NOTES.md): the kernel
without its order took the same time as with it, twice the adds a tile 1.6-1.85x the time: a copy costs ~1.16
units (1.8 us against the split's 2.3 us a pair = 1.4 units). A job's overhead outside its tiles may differ
between the kernels (--fused-overhead; default --overhead): fused-tma's K tile is held to its job's end, so the
next job's rows and first tiles load only then; at copy 1.16 and a fused job overhead of 2 units the model gives
the five measured D64 shapes' fused/split within 0.06, four of them within 0.04 (2026-12-07). A model, not a measurement: clocks and jitter are left out.
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

KEYS = 128     # a job's key block: two consumer warpgroups of 64
QUERIES = 64   # a streamed query tile (BWD_TMA_ROWS)
SPLIT_DKDV, SPLIT_DQ = 0.8, 0.6  # the split kernels' products a pair, in fused units


def walk(kb: int, n_q: int, off: int) -> range:
    """The query tiles key block kb walks (TmaKeyJob in attention.cu: from the tile of the first query that sees
    its first key, n0 - off, to the last tile), for any n_q and mask offset off >= 0."""
    q_begin = (max(kb * KEYS - off, 0) // QUERIES) * QUERIES
    n_tiles = (n_q - q_begin + QUERIES - 1) // QUERIES if q_begin < n_q else 0
    return range(q_begin // QUERIES, q_begin // QUERIES + n_tiles)


def place(kb: int, qt: int, n_kb: int, off: int) -> int:
    """Key block kb's place in line at query tile qt (the fused kernel's dq_writer): the last key block that sees
    the tile adds first (place 0, a store), key block 0 last."""
    return min(n_kb - 1, (qt * QUERIES + QUERIES - 1 + off) // KEYS) - kb


def ticket_makespan(costs: list[float], sms: int) -> float:
    """Jobs of the given costs handed out in order to whichever of `sms` blocks frees first."""
    free = [0.0] * sms
    heapq.heapify(free)
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def split_makespan(n_bh: int, t: int, sms: int, overhead: float) -> float:
    """dQ (jobs of 128 queries, longest first) then dK/dV (jobs of 128 keys, longest first), each persistent."""
    n_blocks, n_tiles = t // KEYS, t // QUERIES
    dq = sorted((SPLIT_DQ * 2 * (qb + 1) + overhead for qb in range(n_blocks)), reverse=True) * n_bh
    dkdv = sorted((SPLIT_DKDV * (n_tiles - 2 * kb) + overhead for kb in range(n_blocks)), reverse=True) * n_bh
    return ticket_makespan(sorted(dq, reverse=True), sms) + ticket_makespan(sorted(dkdv, reverse=True), sms)


def fused_makespan(n_bh: int, t: int, sms: int, latency: float, overhead: float, descending: bool,
                   group: int, copy: float = 0.0, stages: int = 3) -> float:
    """The fused kernel's finish: an event simulation of persistent blocks, jobs (head, key block) from a ticket in
    groups of `group` heads, key blocks in the adds' order inside a group (heads inside a key block); each block's
    adds take `copy` units of its writer, in order, the consumers at most `stages` tiles ahead."""
    n_blocks, n_tiles = t // KEYS, t // QUERIES
    kbs = range(n_blocks - 1, -1, -1) if descending else range(n_blocks)
    order = [(h, kb) for g0 in range(0, n_bh, group) for kb in kbs for h in range(g0, min(g0 + group, n_bh))]
    # the add order of each tile: its contributors kb <= q // 2, descending or ascending; turn[h][q] counts the
    # adds done, ready[h][q] is when the last one is visible to the next in line
    turn = [[0] * n_tiles for _ in range(n_bh)]
    ready = [[0.0] * n_tiles for _ in range(n_bh)]

    def position(kb: int, q: int) -> int:
        return (q // 2 - kb) if descending else kb

    # events: (time, seq, block, job index, tile): the block's products on that tile finish at time
    events, waiting, seq = [], {}, 0
    next_job, finish = 0, 0.0
    writer = [0.0] * sms  # when each block's writer is free
    copied = [[0.0] * stages for _ in range(sms)]  # when its last `stages` adds were read (a ring: tile i at i % S)
    tiles = [0] * sms  # the adds each block has issued

    def start(block: int, now: float) -> None:
        nonlocal next_job, seq
        if next_job == len(order):
            return
        h, kb = order[next_job]
        next_job += 1
        heapq.heappush(events, (now + overhead + 1.0, seq, block, h, kb, 2 * kb))
        seq += 1

    for b in range(min(sms, len(order))):
        start(b, 0.0)
    while events:
        now, _, block, h, kb, q = heapq.heappop(events)
        if turn[h][q] != position(kb, q):  # not this key block's turn at the tile: wait for the one before it
            waiting[(h, q, position(kb, q))] = (block, kb)
            continue
        t_add = max(now, ready[h][q], writer[block])
        writer[block] = t_add + copy
        slot = tiles[block] % stages
        tiles[block] += 1
        copied[block][slot] = t_add + copy
        turn[h][q] += 1
        ready[h][q] = t_add + copy + latency
        nxt = waiting.pop((h, q, turn[h][q]), None)
        if nxt is not None:  # the next in line was waiting: its add may go once this one is visible
            heapq.heappush(events, (ready[h][q], seq, nxt[0], h, nxt[1], q))
            seq += 1
        # the next tile's stage: free once the add `stages` tiles back was read
        free = copied[block][tiles[block] % stages] if tiles[block] >= stages else 0.0
        if q + 1 < n_tiles:
            heapq.heappush(events, (max(t_add + 1.0, free + 1.0), seq, block, h, kb, q + 1))
            seq += 1
        else:
            finish = max(finish, t_add + copy)
            start(block, max(t_add, free))
    assert not waiting and next_job == len(order), "a block waited forever"
    return finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--latency", default="0.5,1,2", help="units from one key block's add to the next one's")
    ap.add_argument("--overhead", type=float, default=0.3, help="units a job spends outside its tiles")
    ap.add_argument("--fused-overhead", type=float, default=None, help="the fused kernel's (default: --overhead)")
    ap.add_argument("--groups", default="1,4", help="heads a group of the fused kernel's ticket order")
    ap.add_argument("--copy", default="0,1.16", help="units a block's writer takes an add (0: free adds)")
    ap.add_argument("--stages", type=int, default=3, help="tiles the consumers may run ahead of the writer")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    latencies = [float(x) for x in a.latency.split(",")]
    groups = [int(x) for x in a.groups.split(",")]
    copies = [float(x) for x in a.copy.split(",")]
    fused_overhead = a.overhead if a.fused_overhead is None else a.fused_overhead
    cols = [(desc, lat, g, c) for c in copies for desc in (True, False) for lat in latencies for g in groups]
    head = ["B x H x T x D", "split (ideal)"] + [
        f"{'desc' if d else 'asc'} L{lat:g} g{g}" + (f" C{c:g}" if c else "") for d, lat, g, c in cols]
    rows = []
    for b, h, t, d in SHAPES:
        n_bh, n_blocks, n_tiles = b * h, t // KEYS, t // QUERIES
        pairs = n_bh * sum(n_tiles - 2 * kb for kb in range(n_blocks))
        split = split_makespan(n_bh, t, a.sms, a.overhead)
        split_ideal = (SPLIT_DKDV + SPLIT_DQ) * pairs / a.sms
        cells = [f"{b}x{h}x{t}x{d}", f"{split:.0f} ({split / split_ideal:.2f})"]
        for desc, lat, g, c in cols:
            fused = fused_makespan(n_bh, t, a.sms, lat, fused_overhead, desc, g, c, a.stages)
            cells.append(f"{fused / split:.2f} ({fused / (pairs / a.sms):.2f})")
        rows.append(cells)
        print(" | ".join(cells), flush=True)
    date = datetime.date.today().isoformat()
    lines = [f"# A deterministic fused attention backward, simulated ({a.sms} SMs, a job's overhead {a.overhead} units,"
             f" the fused kernel's {fused_overhead})",
             "", "`python benchmarks/attention_fused_schedule.py`: the split backward's makespan in fused units (against",
             "its ideal), then per add order (desc: the last key block first; asc: the first first), latency L (units",
             "between consecutive adds into a tile), ticket head group g and a block's writer's units an add C (none:",
             f"free adds; {a.stages} stages): the fused makespan / the split's (against the fused ideal). Below 1: the",
             "fused kernel would be faster.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    out = a.out or ROOT / "benchmarks" / "results" / "attention" / f"fused-schedule-{date}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
