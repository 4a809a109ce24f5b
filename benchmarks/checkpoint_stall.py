"""The asynchronous checkpoint's stall inside the Trainer on the GPU (issue 14; paper Appendix B.14).

    python benchmarks/checkpoint_stall.py [--steps 250] [--interval 60] [--precision bf16]

A `Trainer` run of GPT-2 124M (vocabulary 50304: 1.49 GB of parameters and AdamW moments) on the
bundled corpus, B16 T1024, checkpointing every --interval steps with the background writer. Per
checkpoint: the stall (the seconds `AsyncSaver.save` held the training loop), the part of it spent
waiting for the previous checkpoint's write, that write's own time, and the time of the step
after the checkpoint against the median step (the GPU's pause while the state is copied to host
memory). Prints a table; writes benchmarks/results/checkpoint/checkpoint_stall-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from result_file import commit, gpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--interval", type=int, default=60)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--model", default="gpt2-124m", help="a preset (tiny on cpu: a smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint"))
    args = ap.parse_args()
    from kiln.train import TrainConfig, Trainer

    records: list = []
    real_checkpointing = Trainer._checkpointing

    def checkpointing(self, run):  # the Trainer's own saver, its save() timed as the Trainer does
        folder, saver, saved = real_checkpointing(self, run)
        real_save = saver.save

        def save(path, state, on_done=None):
            if records:
                records[-1]["write_s"] = saver.last_write_s  # the previous write, done by now if waited
            stall = real_save(path, state, on_done)
            records.append({"step": self.step, "stall_s": stall, "wait_s": saver.last_wait_s})
            return stall

        saver.save = save
        self.bench_saver = saver
        return folder, saver, saved

    Trainer._checkpointing = checkpointing
    with tempfile.TemporaryDirectory(prefix="kiln-stall-") as out_dir:
        vocab = {"vocab_size": 50304} if args.model.startswith("gpt2") else {}
        trainer = Trainer(TrainConfig(model=args.model, model_overrides=vocab, device=args.device,
                                      precision=args.precision, batch_size=16, max_steps=args.steps,
                                      checkpoint_interval=args.interval, eval_interval=10 ** 6, eval_iters=1,
                                      sample_tokens=0, progress=False, out_dir=out_dir))
        summary = trainer.fit()
        records[-1]["write_s"] = trainer.bench_saver.last_write_s
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    tokens = 16 * trainer.seq_len
    step_s = {r["step"]: tokens / r["tokens_per_s"] for r in rows}
    saved_steps = {r["step"] for r in records}
    steady = [t for s, t in step_s.items() if s > 5 and s not in saved_steps and s - 1 not in saved_steps]
    median_step = float(np.median(steady))
    for r in records:
        after = step_s.get(r["step"] + 1)
        r["step_after_s"] = after
        r["step_after_extra_s"] = None if after is None else after - median_step
    state_bytes = sum(int(np.prod(p.shape)) for p in trainer.model.parameters()) * 4 * 3
    interval_stalls = [r["stall_s"] for r in records if r["step"] < args.steps]
    record = {"benchmark": "checkpoint_stall", "date": time.strftime("%Y-%m-%d"),
              "commit": commit(),
              "device": gpu_name() if args.device == "cuda" else args.device,
              "precision": args.precision, "steps": args.steps, "interval": args.interval,
              "state_bytes": state_bytes, "median_step_s": median_step,
              "median_interval_stall_s": float(np.median(interval_stalls)) if interval_stalls else None,
              "trainer_checkpoint_stall_s": summary["checkpoint_stall_s"], "checkpoints": records}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"checkpoint_stall-{record['date']}.json").write_text(json.dumps(record, indent=2))
    print(f"state {state_bytes / 1e9:.2f} GB, median step {1000 * median_step:.1f} ms")
    print("| step | stall ms | of which waiting for the previous write | write s | step after: extra ms |")
    print("|---|---|---|---|---|")
    for r in records:
        extra = r["step_after_extra_s"]
        print(f"| {r['step']} | {1000 * r['stall_s']:.1f} | {1000 * (r['wait_s'] or 0):.1f} | "
              f"{r.get('write_s') or float('nan'):.2f} | {'-' if extra is None else f'{1000 * extra:.1f}'} |")
    print(f"median stall of the interval checkpoints: {1000 * record['median_interval_stall_s']:.1f} ms; "
          f"the Trainer's checkpoint_stall_s (all, the final one too): {1000 * summary['checkpoint_stall_s']:.1f} ms")


if __name__ == "__main__":
    main()
