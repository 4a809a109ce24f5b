"""kiln's checkpoint save/load against torch.save/torch.load, same training state, same run
(the paper's Appendix B.14, Figure 41).

    python benchmarks/checkpoint.py [--repeats 9] [--models gpt2-44m,gpt2-124m] [--dir DIR]

The state is a real Trainer's after one step on the CPU in fp32 (parameters, both AdamW moments,
step, loader positions, RNG states, loss, configs). Models: "gpt2-44m" is GPT-2 with n_layer=6,
n_head=8, n_embd=512, vocab 50304, context 1024 (45.2M parameters); "gpt2-124m" is the paper's.

Figures, each the median of --repeats, kiln and PyTorch interleaved (who goes first alternates)
so machine noise hits both. Every save goes to a new file (the old one deleted, its blocks
released, before the clock starts), as a run's step-numbered checkpoints do.
Phase 1, save and load:
  kiln save        kiln.checkpoint.save: CRC-32 per 4 MiB block + sha256 of the header, temp file,
                   fsync, rename, fsync folder (O_DIRECT where allowed; plain pwrite with KILN_CHECKPOINT_DIRECT=0)
  kiln load        kiln.checkpoint.load from the disk: read + every checksum verified
  torch save       torch.save to a file + fsync (the durability a crash-safe checkpoint needs);
                   "nofsync" without it
  torch load       torch.load (weights_only) from the disk, the file evicted from the page cache
                   (posix_fadvise) as kiln's is: a resume. "page cache": the same load again, warm.
                   (kiln's file is evicted the same way.) torch.load does not check its zip CRC32s (a flipped byte loads
                   silently), so "torch+sha256" adds what integrity costs PyTorch: a sha256 of the
                   file after saving and before loading.
Phase 2, inside training:
  kiln async stall AsyncSaver.save between two steps: the time the training loop waits, i.e. the
                   host snapshot; the background write's time (hidden behind the next step) is
                   reported too, and torch.save + fsync in the same place. On a machine with few
                   cores the write competes with that next step: its time, after each, is reported.
Every loaded state is compared with the saved one, bit for bit, outside the timings.
Ratios are kiln / torch within each round (the same machine state for both; this VM's memory
and disk make single figures swing by 2x), their median over the rounds; targets: kiln save and
load no slower than torch's; the async stall under 10% of torch's save (in training, same round).
Writes benchmarks/results/checkpoint/checkpoint-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from result_file import commit, src_dirty

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gpt2-44m": dict(model="gpt2-124m", model_overrides={"n_layer": 6, "n_head": 8, "n_embd": 512,
                                                                "vocab_size": 50304}),
          "gpt2-124m": dict(model="gpt2-124m", model_overrides={"vocab_size": 50304})}


def trainer_state(name: str):
    """A Trainer's full state after one step: (Trainer, state with live arrays)."""
    from kiln.train import TrainConfig, Trainer
    t = Trainer(TrainConfig(**MODELS[name], batch_size=1, seq_len=64, device="cpu", progress=False,
                            sample_tokens=0, eval_iters=1))
    t.train_step()
    return t, t.state_dict()


def to_torch(node):
    import torch
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node)
    if isinstance(node, dict):
        return {k: to_torch(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [to_torch(v) for v in node]
    return node


def same(a, b) -> bool:
    """Bit-equal trees (NumPy or torch leaves; tuples and lists alike)."""
    if hasattr(a, "numpy") and not isinstance(a, np.ndarray):
        a = a.numpy()
    if hasattr(b, "numpy") and not isinstance(b, np.ndarray):
        b = b.numpy()
    if isinstance(a, np.ndarray):
        if not (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        bits = f"u{a.dtype.itemsize}" if a.dtype.itemsize in (1, 2, 4, 8) else None
        return bool(np.array_equal(a.view(bits), b.view(bits))) if bits else a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def file_sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def drop_cache(path) -> None:
    """Evict one (fsync'd) file from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_model(name: str, repeats: int, folder: Path) -> dict:
    import torch

    from kiln.checkpoint import AsyncSaver, load, save
    from kiln.checkpoint.async_save import to_host
    trainer, state = trainer_state(name)
    params = trainer.model.num_parameters()
    tstate = to_torch(state)  # the same arrays, shared (torch.from_numpy)
    kpath, tpath = folder / f"{name}.kiln", folder / f"{name}.pt"
    fig: dict = {}

    def torch_save():
        with open(tpath, "wb") as f:
            torch.save(tstate, f)
            f.flush()
            os.fsync(f.fileno())

    def record(r, row):
        if r:  # round 0 warms the page cache, the staging buffers and the allocator
            for k, v in row.items():
                fig.setdefault(k, []).append(v)
        print(f"  {name} round {r}: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in row.items()) + " ms",
              flush=True)

    def fresh(path):
        """Saves go to a new file, as a run's step-numbered checkpoints do: the old one is deleted
        and its blocks released (this disk discards them) before the clock starts, for both."""
        path.unlink(missing_ok=True)
        os.sync()
        time.sleep(0.3)

    # phase 1: save, then load from the disk (the file evicted from the page cache: a resume),
    # kiln and PyTorch interleaved (alternating who goes first)
    for r in range(repeats + 1):
        row = {}
        for who in (["kiln", "torch"] if r % 2 else ["torch", "kiln"]):
            if who == "kiln":
                fresh(kpath)
                row["kiln_save"], _ = timed(lambda: save(kpath, to_host(state)))
                drop_cache(kpath)
                row["kiln_load"], back = timed(lambda: load(kpath))
                assert same(back, state), "kiln load differs from the saved state"
                del back
            else:
                fresh(tpath)
                row["torch_save"], _ = timed(torch_save)
                drop_cache(tpath)
                row["torch_load"], back = timed(lambda: torch.load(tpath, weights_only=True))
                assert same(back, tstate), "torch load differs from the saved state"
                del back
                row["torch_load_page_cache"], back = timed(lambda: torch.load(tpath, weights_only=True))
                assert same(back, tstate)
                del back
                fresh(tpath)
                t0 = time.perf_counter()
                with open(tpath, "wb") as f:
                    torch.save(tstate, f)
                row["torch_save_nofsync"] = time.perf_counter() - t0
                fresh(tpath)
                dt, _ = timed(torch_save)
                hs, digest = timed(lambda: file_sha256(tpath))
                row["torch_sha_save"] = dt + hs
                drop_cache(tpath)
                row["torch_sha_load"], ok = timed(lambda: file_sha256(tpath) == digest and
                                                  torch.load(tpath, weights_only=True))
                assert ok is not False and same(ok, tstate)
                del ok
        record(r, row)

    # phase 2: inside training. A step, the save, the next step (while kiln's file is written in
    # the background), then a check that the file holds the state at the save. What the loop
    # waits for: kiln's snapshot; all of torch.save.
    saver = AsyncSaver()
    first_stall = None
    for r in range(repeats + 1):
        row = {}
        for who in (["kiln", "torch"] if r % 2 else ["torch", "kiln"]):
            fresh(kpath if who == "kiln" else tpath)
            trainer.train_step()
            live = trainer.state_dict()
            snapshot = {k: v.copy() for k, v in live["model"].items()}
            if who == "kiln":
                row["kiln_async_stall"] = saver.save(kpath, live)
                first_stall = row["kiln_async_stall"] if first_stall is None else first_stall
            else:
                live_torch = to_torch(live)
                t0 = time.perf_counter()
                with open(tpath, "wb") as f:
                    torch.save(live_torch, f)
                    f.flush()
                    os.fsync(f.fileno())
                row["torch_save_in_training"] = time.perf_counter() - t0
            row[f"train_step_after_{who}"], _ = timed(trainer.train_step)
            if who == "kiln":
                saver.wait()
                row["kiln_async_write"] = saver.last_write_s
                assert same(load(kpath)["model"], snapshot), "async save differs from the snapshot"
            else:
                assert same(torch.load(tpath, weights_only=True)["model"], to_torch(snapshot))
            del snapshot, live
        record(r, row)

    med = {k: statistics.median(v) for k, v in fig.items()}
    # kiln / torch within each round (the same machine state for both), then the median of those
    paired = {f"{k} / {t}": statistics.median(a / b for a, b in zip(fig[k], fig[t]))
              for k, t in (("kiln_save", "torch_save"), ("kiln_load", "torch_load"),
                           ("kiln_async_stall", "torch_save"), ("kiln_async_stall", "torch_save_in_training"),
                           ("kiln_save", "torch_sha_save"), ("kiln_load", "torch_sha_load"))}
    return {"parameters": params, "kiln_bytes": kpath.stat().st_size, "torch_bytes": tpath.stat().st_size,
            "median_s": med, "all_s": fig, "first_async_stall_s": first_stall,
            "median_of_paired_ratios": paired, "loadavg_after": os.getloadavg(),
            "ratios": {"kiln_save / torch_save": med["kiln_save"] / med["torch_save"],
                       "kiln_load / torch_load": med["kiln_load"] / med["torch_load"],
                       "kiln_async_stall / torch_save": med["kiln_async_stall"] / med["torch_save"],
                       "kiln_async_stall / torch_save_in_training":
                           med["kiln_async_stall"] / med["torch_save_in_training"],
                       "kiln_save / torch_sha_save": med["kiln_save"] / med["torch_sha_save"],
                       "kiln_load / torch_sha_load": med["kiln_load"] / med["torch_sha_load"]},
            "targets_met": {"save no slower than torch": paired["kiln_save / torch_save"] <= 1,
                            "load no slower than torch": paired["kiln_load / torch_load"] <= 1,
                            "async stall < 10% of torch save":
                                paired["kiln_async_stall / torch_save_in_training"] < 0.1}}


def main() -> None:
    import torch
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    a = ap.parse_args()
    folder = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="kiln-ckpt-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for name in a.models.split(","):
            results[name] = bench_model(name, a.repeats, folder)
    finally:
        if not a.dir:
            shutil.rmtree(folder, ignore_errors=True)
    record = {"benchmark": "checkpoint", "date": time.strftime("%Y-%m-%d"),
              "commit": commit(), "dirty": src_dirty(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "numpy": np.__version__, "disk": str(folder)},
              "models": {k: {"n_layer": 6, "n_head": 8, "n_embd": 512, "vocab_size": 50304, "block_size": 1024}
                         if k == "gpt2-44m" else {"n_layer": 12, "n_head": 12, "n_embd": 768,
                                                  "vocab_size": 50304, "block_size": 1024} for k in results},
              "repeats": a.repeats, "results": results}
    out = ROOT / "benchmarks" / "results" / "checkpoint" / f"checkpoint-{record['date']}.json"
    out.write_text(json.dumps(record, indent=2))
    cols = [("kiln save", "kiln_save"), ("torch save", "torch_save"), ("torch save+sha", "torch_sha_save"),
            ("kiln load", "kiln_load"), ("torch load", "torch_load"), ("torch sha+load", "torch_sha_load"),
            ("torch load, page cache", "torch_load_page_cache"),
            ("kiln async stall", "kiln_async_stall"), ("kiln async write (hidden)", "kiln_async_write"),
            ("torch save in training", "torch_save_in_training"),
            ("next step, kiln writing", "train_step_after_kiln"), ("next step after torch", "train_step_after_torch")]
    print("\n| model | params | file | " + " | ".join(c for c, _ in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for name, r in results.items():
        print(f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['kiln_bytes'] / 1e6:.0f} MB | "
              + " | ".join(f"{r['median_s'][k] * 1e3:.0f} ms" for _, k in cols) + " |")
    for name, r in results.items():
        print(f"{name}: median of per-round ratios: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["median_of_paired_ratios"].items())
              + "; targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in r["targets_met"].items()))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
