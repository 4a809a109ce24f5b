"""Which precision policy makes kiln's bf16 loss curve stray from PyTorch autocast's (issues 14, 17)?

Runs of one small GPT from the same weights on the same batches of the bundled corpus, on the CPU:
  kiln-bf16res    kiln's bf16 mode with the residual stream in bf16 (kiln's policy before this study)
  kiln-fp32res    kiln's bf16 mode with autocast's policy: an fp32 residual stream
  autocast        PyTorch eager under torch.autocast(bfloat16): fp32 residual, bf16 GEMM inputs
  torch-bf16res   the same with the residual stream cast to bf16 after the embeddings, as kiln-bf16res
  fp32            PyTorch in fp32
  kiln-fp32       kiln in fp32: the floor two implementations' curves part by without bf16
and the gaps between their per-step training losses: mean |gap| over all steps, over the last
quarter, and the largest. Per-step training losses of bf16 runs part by rounding noise that grows
with training: the mean |gap| over many steps, not any one step's, tells the policies apart.

    python benchmarks/bf16_residual.py [--steps 300] [--n-layer 4] [--n-embd 128] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from result_file import run_fields, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

RUNS = ("kiln-bf16res", "kiln-fp32res", "autocast", "torch-bf16res", "fp32", "kiln-fp32")
PAIRS = (("kiln-bf16res", "autocast"), ("kiln-fp32res", "autocast"), ("kiln-bf16res", "torch-bf16res"),
         ("kiln-fp32res", "torch-bf16res"), ("autocast", "fp32"), ("torch-bf16res", "fp32"),
         ("kiln-bf16res", "fp32"), ("kiln-fp32res", "fp32"), ("kiln-fp32", "fp32"))


def batches(args, n_tokens: int) -> np.ndarray:
    """(steps, batch, seq_len + 1) window starts, drawn once so every run reads the same windows."""
    return np.random.default_rng(args.seed).integers(0, n_tokens - args.seq_len - 1,
                                                     size=(args.steps, args.batch_size))


def lr_at(args, step: int) -> float:
    from kiln.optim import warmup_cosine_lr
    return warmup_cosine_lr(step, args.lr, args.lr / 10, args.steps // 10, args.steps)


def train_kiln(args, cfg, tokens, starts, run: str) -> list[float]:
    import kiln
    from kiln.nn import GPT
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    dev = kiln.device("cpu")
    model = GPT(cfg, generator=kiln.Generator(args.seed))
    if run == "kiln-fp32":
        apply_precision(model, "fp32", dev)
    else:
        apply_precision(model, "bf16", dev, bf16_residual=run.removeprefix("kiln-").removesuffix("res"))
    opt = AdamW(gpt_param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step = plain_step(model, opt, grad_clip=1.0)
    span = np.arange(args.seq_len + 1)
    losses = []
    for i in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(args, i)
        w = tokens[starts[i][:, None] + span].astype(np.int64)
        losses.append(step(kiln.tensor(w[:, :-1]), kiln.tensor(w[:, 1:])).item())
    dev.backend.set_matmul_precision("fp32")
    return losses


def train_torch(args, cfg, tokens, starts, run: str) -> list[float]:
    import torch

    import kiln
    from kiln.nn import GPT
    from tests.torch_gpt import torch_gpt_forward, torch_params
    torch.set_num_threads(1)
    params = torch_params(GPT(cfg, generator=kiln.Generator(args.seed)), torch.float32)
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    residual = torch.bfloat16 if run == "torch-bf16res" else None
    span = np.arange(args.seq_len + 1)
    losses = []
    for i in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(args, i)
        w = tokens[starts[i][:, None] + span].astype(np.int64)
        x, y = (torch.from_numpy(np.ascontiguousarray(a)) for a in (w[:, :-1], w[:, 1:]))
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run != "fp32"):
            _, loss = torch_gpt_forward(params, cfg, x, y, residual_dtype=residual)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def gap(a, b) -> dict:
    d = np.abs(np.asarray(a) - np.asarray(b))
    return {"mean": float(d.mean()), "mean_last_quarter": float(d[-len(d) // 4:].mean()), "max": float(d.max()),
            "max_step": int(d.argmax())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/fidelity/bf16_residual-<date>.json)")
    args = ap.parse_args()
    from kiln.data.corpus import bundled_text
    from kiln.nn import GPTConfig
    tokens = np.frombuffer(bundled_text().encode("utf-8"), dtype=np.uint8)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    starts = batches(args, len(tokens))
    losses, wall = {}, {}
    for run in args.runs.split(","):
        t0 = time.time()
        if run.startswith("kiln"):
            losses[run] = train_kiln(args, cfg, tokens, starts, run)
        else:
            losses[run] = train_torch(args, cfg, tokens, starts, run)
        wall[run] = time.time() - t0
        print(f"{run:14s} loss {losses[run][0]:.4f} -> {np.mean(losses[run][-10:]):.4f} ({wall[run]:.0f} s)", flush=True)
    gaps = {f"{a}-{b}": gap(losses[a], losses[b]) for a, b in PAIRS if a in losses and b in losses}
    print(f"{'gap':28s} {'mean':>9s} {'last 1/4':>9s} {'max':>9s} at")
    for name, g in gaps.items():
        print(f"{name:28s} {g['mean']:9.2e} {g['mean_last_quarter']:9.2e} {g['max']:9.2e} {g['max_step']}")
    record = {**run_fields("cpu"), "config": vars(args), "gaps": gaps, "losses": losses, "wall_s": wall}
    out = args.out or ROOT / "benchmarks" / "results" / "fidelity" / f"bf16_residual-{record['date']}.json"
    write_json(record, Path(out))


if __name__ == "__main__":
    main()
