"""kiln vs PyTorch CPU training the `tiny` GPT: tokens/s and peak memory, one run, same machine.

    python benchmarks/cpu_train.py [--steps 30] [--warmup 5]

Each framework trains in its own subprocess (so peak RSS is its own), from the same initial
weights and on the same batches of the bundled corpus, fp32, AdamW, clipping at 1.0. Writes
benchmarks/results/cpu_train/cpu_train-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from result_file import commit

ROOT = Path(__file__).resolve().parents[1]


def _batches(n, b, t):
    from kiln.data.corpus import bundled_dataset
    from kiln.data.loader import ShardLoader
    loader = ShardLoader(bundled_dataset(), "train", batch_size=b, seq_len=t)
    return [loader.next_batch() for _ in range(n)]


def _worker(framework: str, steps: int, warmup: int, b: int, t: int | None = None) -> dict:
    import numpy as np

    import kiln
    from kiln.nn import GPT, preset
    cfg = preset("tiny", vocab_size=320)
    t = t or cfg.block_size
    model = GPT(cfg, generator=kiln.Generator(0))
    batches = _batches(steps + warmup, b, t)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    losses, times = [], []
    if framework == "kiln":
        from kiln.optim import AdamW, clip_grad_norm_, gpt_param_groups
        opt = AdamW(gpt_param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad()
            _, loss = model(kiln.tensor(x), kiln.tensor(y))
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
            if len(times) == 1:  # as the Trainer does after its first step (the host heap keeps freed blocks)
                model.wte.weight.backend.end_warmup()
    else:
        import torch
        sys.path.insert(0, str(ROOT))
        from tests.torch_gpt import torch_gpt_forward, torch_params
        params = torch_params(model, torch.float32)
        decay = [p for p in params.values() if p.ndim >= 2]
        no_decay = [p for p in params.values() if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad()
            _, loss = torch_gpt_forward(params, cfg, torch.from_numpy(x), torch.from_numpy(y))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            opt.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - t0)
    timed = np.array(times[warmup:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"framework": framework, "tokens_per_s": b * t / float(np.median(timed)),
            "median_step_ms": 1000 * float(np.median(timed)), "peak_rss_mib": peak / 1024,
            "peak_rss_over_baseline_mib": (peak - base_rss) / 1024, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, help="tokens a row (default: the tiny preset's context)")
    ap.add_argument("--worker", choices=["kiln", "torch"])
    a = ap.parse_args()
    from kiln.nn import preset
    cfg = preset("tiny", vocab_size=320)
    a.seq_len = a.seq_len or cfg.block_size
    if a.worker:
        print(json.dumps(_worker(a.worker, a.steps, a.warmup, a.batch_size, a.seq_len)))
        return
    results = {}
    for fw in ("kiln", "torch"):
        out = subprocess.run([sys.executable, __file__, "--worker", fw, "--steps", str(a.steps),
                              "--warmup", str(a.warmup), "--batch-size", str(a.batch_size),
                              "--seq-len", str(a.seq_len)], capture_output=True, text=True, check=True)
        results[fw] = json.loads(out.stdout.strip().splitlines()[-1])
    k, t = results["kiln"], results["torch"]
    diff = max(abs(x - y) / abs(y) for x, y in zip(k["losses"], t["losses"]))
    import torch
    record = {
        "benchmark": "cpu_train", "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "numpy": __import__("numpy").__version__},
        "model": f"tiny ({cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, vocab {cfg.vocab_size}, "
                 f"context {cfg.block_size}), fp32",
        "batch": [a.batch_size, a.seq_len], "timed_steps": a.steps, "warmup_steps": a.warmup,
        "kiln": k, "torch": t, "tokens_per_s_ratio": k["tokens_per_s"] / t["tokens_per_s"],
        "peak_rss_ratio": k["peak_rss_mib"] / t["peak_rss_mib"],
        "largest_relative_loss_difference": diff,
    }
    out = ROOT / "benchmarks" / "results" / "cpu_train" / f"cpu_train-{record['date']}.json"
    out.write_text(json.dumps(record, indent=2))
    print(f"{'':8}{'tokens/s':>12}{'step ms':>10}{'peak RSS MiB':>14}{'(over start)':>14}")
    for name, r in (("kiln", k), ("pytorch", t)):
        print(f"{name:8}{r['tokens_per_s']:12.0f}{r['median_step_ms']:10.1f}{r['peak_rss_mib']:14.0f}"
              f"{r['peak_rss_over_baseline_mib']:14.0f}")
    print(f"kiln / pytorch tokens/s: {record['tokens_per_s_ratio']:.2f}x; peak RSS ratio "
          f"{record['peak_rss_ratio']:.2f}; largest loss difference {diff:.2e}; wrote {out}")


if __name__ == "__main__":
    main()
