"""Host-side ShardLoader throughput from memory-mapped shards, GPT-2 124M's batch (B=16, T=1024), one core.

Writes benchmarks/results/loader/loader-<date>.json (commit, machine, command, every figure) and prints a table.
The shards are written just before they are read, so they sit in the page cache: this measures the
loader, not the disk.
"""

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from result_file import commit, src_dirty

from kiln.data.loader import ShardLoader
from kiln.data.shards import write_shard

RESULTS = Path(__file__).with_name("results") / "loader"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "platform": platform.platform()}


def measure(folder: Path, vocab: int, args) -> dict:
    """Write the shards with ids below `vocab`, then time next_batch for `args.seconds`."""
    rng = np.random.default_rng(0)
    names = []
    for i in range(args.shards):
        name = f"train_{i:06d}.bin"
        write_shard(folder / name, rng.integers(0, vocab, size=args.shard_tokens), vocab)
        names.append(name)
    (folder / "meta.json").write_text(json.dumps(
        {"vocab_size": vocab, "splits": {"train": {"tokens": args.shards * args.shard_tokens, "shards": names}}}))
    start = time.perf_counter()
    loader = ShardLoader(folder, batch_size=args.batch_size, seq_len=args.seq_len)
    open_s = time.perf_counter() - start
    steps_per_epoch = args.shards * ((args.shard_tokens - 1) // loader.tokens_per_batch)
    start = time.perf_counter()
    for _ in range(steps_per_epoch):  # first pass: each page of the map is touched (faulted in) once
        loader.next_batch()
    first_pass_s = time.perf_counter() - start
    batches, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < args.seconds:
        for _ in range(100):
            loader.next_batch()
        batches += 100
    tokens_per_s = batches * loader.tokens_per_batch / elapsed
    itemsize = 2 if vocab <= 2**16 else 4
    return {"vocab_size": vocab, "token_bytes": itemsize, "batches": batches, "seconds": elapsed,
            "batches_per_s": batches / elapsed, "tokens_per_s": tokens_per_s,
            "us_per_batch": 1e6 * elapsed / batches, "shard_read_GB_per_s": 2 * tokens_per_s * itemsize / 1e9,
            "epochs_read": batches * loader.tokens_per_batch / (args.shards * args.shard_tokens),
            "first_open_and_vocab_scan_s": open_s,
            "first_pass_tokens_per_s": steps_per_epoch * loader.tokens_per_batch / first_pass_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--shard-tokens", type=int, default=20_000_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--core", type=int, default=0, help="the one core to run on")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})

    rows = {}
    for label, vocab in (("uint16 (GPT-2, 50257)", 50257), ("uint32 (Llama 3, 128256)", 128256)):
        with tempfile.TemporaryDirectory() as folder:
            rows[label] = measure(Path(folder), vocab, args)

    target = 50e6
    result = {"name": "loader", "date": datetime.date.today().isoformat(), "commit": commit() + ("+dirty" if src_dirty() else ""),
              "machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "config": {"batch_size": args.batch_size, "seq_len": args.seq_len, "shards": args.shards,
                         "shard_tokens": args.shard_tokens, "cores": 1, "page_cache": "warm"},
              "target_tokens_per_s": target, "results": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"loader-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"ShardLoader.next_batch, B={args.batch_size} T={args.seq_len}, one core ({result['machine']['cpu']})")
    print(f"{'shards':<26}{'batches/s':>12}{'tokens/s':>14}{'us/batch':>10}{'GB/s read':>11}"
          f"{'1st pass tok/s':>16}{'target':>9}")
    for label, r in rows.items():
        verdict = "met" if r["tokens_per_s"] >= target else "MISSED"
        print(f"{label:<26}{r['batches_per_s']:>12,.0f}{r['tokens_per_s'] / 1e6:>12,.1f} M"
              f"{r['us_per_batch']:>10.1f}{r['shard_read_GB_per_s']:>11.2f}"
              f"{r['first_pass_tokens_per_s'] / 1e6:>14,.1f} M{verdict:>9}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
