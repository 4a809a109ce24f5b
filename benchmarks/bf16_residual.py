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

Every --eval-every steps one fp32 PyTorch evaluator (Evaluator) measures every run's weights again: the
training batch the run is about to take (the run's own loss against the fp32 one at the same weights: how
the run measures its loss) and held-out windows (how good its weights are). --ablate changes one piece of
kiln's bf16 runs. --hold-out 0 trains on the windows of the runs before 2026-12-05.

    python benchmarks/bf16_residual.py [--steps 300] [--n-layer 4] [--n-embd 128] [--seq-len 128]
        [--eval-every 20] [--hold-out 40000] [--ablate grad-bf16|attn-p-bf16]
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
    return args.hold_out + np.random.default_rng(args.seed).integers(
        0, n_tokens - args.hold_out - args.seq_len - 1, size=(args.steps, args.batch_size))


class Evaluator:
    """One fp32 PyTorch forward for every run's weights (its fp32 master weights for kiln's bf16 runs): the
    loss of the training batch a step is about to take (what the run itself reported, measured again in fp32)
    and the loss on held-out windows (ones no run trains on: the first args.hold_out bytes are kept out of
    the training draws; with hold_out 0 they are drawn from the whole corpus, and training draws the
    windows of the runs before the evaluator). A run whose own losses are lower than this evaluator's at the same weights
    measures its loss differently; one whose held-out loss is lower has better weights."""

    def __init__(self, args, cfg, tokens):
        import torch
        self.cfg, self.every = cfg, args.eval_every
        span = np.arange(args.seq_len + 1)
        end = args.hold_out or len(tokens)
        starts = np.random.default_rng(10_000 + args.seed).integers(0, end - args.seq_len - 1, size=args.eval_windows)
        w = tokens[starts[:, None] + span].astype(np.int64)
        self.held_out = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (w[:, :-1], w[:, 1:]))

    def loss(self, arrays: dict, x, y) -> float:
        import torch

        from tests.torch_gpt import torch_gpt_forward
        params = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}
        with torch.no_grad():
            return float(torch_gpt_forward(params, self.cfg, x, y)[1])

    def __call__(self, record: dict, step: int, arrays, batch) -> None:
        """Record the fp32 losses at `step` of weights `arrays()` (a callable: made only when due)."""
        if step % self.every:
            return
        a = arrays()
        record.setdefault("step", []).append(step)
        record.setdefault("train_fp32", []).append(self.loss(a, *batch))
        record.setdefault("held_out", []).append(self.loss(a, *self.held_out))


def lr_at(args, step: int) -> float:
    from kiln.optim import warmup_cosine_lr
    return warmup_cosine_lr(step, args.lr, args.lr / 10, args.steps // 10, args.steps)


def ablate_grad_bf16(backend) -> None:
    """--ablate grad-bf16: kiln's Linear weight and bias gradients (and the LM head's) rounded to bf16 before
    AdamW reads them in fp32, as autocast's are (its bf16 GEMMs write them in bf16); kiln writes them in fp32
    from the fp32 accumulator. Patches the CPU backend of this process only."""
    import ml_dtypes
    linear_bwd, lm_head_fwd = backend.linear_bwd, backend.lm_head_xent_fwd

    def rounded(a):
        return None if a is None else a.astype(ml_dtypes.bfloat16).astype(a.dtype)

    def patched_linear_bwd(*a, **k):
        dx, dw, db = linear_bwd(*a, **k)
        return dx, rounded(dw), rounded(db)

    def patched_lm_head_fwd(*a, **k):
        loss, dx, dw = lm_head_fwd(*a, **k)
        return loss, dx, rounded(dw)

    backend.linear_bwd, backend.lm_head_xent_fwd = patched_linear_bwd, patched_lm_head_fwd


def ablate_attn_p_bf16(backend) -> None:
    """--ablate attn-p-bf16: the attention forward's unnormalised probabilities exp(s - max) rounded to bf16 before
    P @ V (their sum, the normaliser and the log-sum-exp stay fp32), as PyTorch's CPU SDPA does on bf16 inputs
    under autocast and kiln's wgmma attention kernels do (attention.cu pack2); kiln's CPU attention keeps P in
    fp32. The backward is kiln's. Patches the CPU backend of this process only."""
    import importlib

    import ml_dtypes
    attention = importlib.import_module("kiln.backend.cpu.attention")  # the package exports a function of that name

    def attention_fwd(q, k, v, scale, causal=True, offset=0):
        tq, tk = q.shape[-2], k.shape[-2]
        qt, ks = attention._transposed(attention._heads(q)), attention._heads(k) * scale
        st = attention._scores_t(ks, qt, slice(None), slice(0, tq), tk, causal, offset)  # [heads, Tk, Tq]
        m = st.max(axis=-2, keepdims=True)
        p = np.exp(st - m)
        denom = p.sum(axis=-2, keepdims=True)
        out = np.swapaxes(p.astype(ml_dtypes.bfloat16).astype(np.float32), -1, -2) @ attention._heads(v)
        out /= np.swapaxes(denom, -1, -2)
        return out.reshape(q.shape).astype(q.dtype, copy=False), (m + np.log(denom))[:, 0, :].reshape(q.shape[:-1])

    backend.attention_fwd = attention_fwd


# bias-once (commit acf1514) is kiln's CPU linear since (94cfb24): one rounding. Its ablation patched
# `from kiln.backend.cpu import matmul`, the package's matmul function, not the module: the MLP's c_fc
# (linear_gelu_fwd) kept rounding twice in the bias-once runs (bf16_cause-2026-12-05-part3.md)
ABLATIONS = {"grad-bf16": ablate_grad_bf16, "attn-p-bf16": ablate_attn_p_bf16}


def train_kiln(args, cfg, tokens, starts, run: str, evaluate: Evaluator) -> dict:
    import kiln
    from kiln.nn import GPT
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    dev = kiln.device("cpu")
    if args.ablate and run != "kiln-fp32":  # patches this process for good: run no kiln-fp32 after it
        ABLATIONS[args.ablate](dev.backend)
    model = GPT(cfg, generator=kiln.Generator(args.seed))
    if run == "kiln-fp32":
        apply_precision(model, "fp32", dev)
    else:
        apply_precision(model, "bf16", dev, bf16_residual=run.removeprefix("kiln-").removesuffix("res"))
    opt = AdamW(gpt_param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step = plain_step(model, opt, grad_clip=1.0)
    span = np.arange(args.seq_len + 1)
    record = {"loss": []}
    for i in range(args.steps + 1):
        w = tokens[starts[min(i, args.steps - 1)][:, None] + span].astype(np.int64)
        evaluate(record, i, lambda: {k: p.numpy() for k, p in model.named_parameters()},
                 [torch_tensor(a) for a in (w[:, :-1], w[:, 1:])])
        if i == args.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(args, i)
        record["loss"].append(step(kiln.tensor(w[:, :-1]), kiln.tensor(w[:, 1:])).item())
    dev.backend.set_matmul_precision("fp32")
    return record


def torch_tensor(a: np.ndarray):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a))


def train_torch(args, cfg, tokens, starts, run: str, evaluate: Evaluator) -> dict:
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
    record = {"loss": []}
    for i in range(args.steps + 1):
        w = tokens[starts[min(i, args.steps - 1)][:, None] + span].astype(np.int64)
        x, y = torch_tensor(w[:, :-1]), torch_tensor(w[:, 1:])
        evaluate(record, i, lambda: {k: p.detach().numpy() for k, p in params.items()}, (x, y))
        if i == args.steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(args, i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run != "fp32"):
            _, loss = torch_gpt_forward(params, cfg, x, y, residual_dtype=residual)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        record["loss"].append(loss.item())
    return record


def gap(a, b) -> dict:
    """mean |a - b| (over all, over the last quarter), the largest, and the signed mean a - b of the last quarter."""
    s = np.asarray(a) - np.asarray(b)
    d, q = np.abs(s), len(s) // 4 or 1
    return {"mean": float(d.mean()), "mean_last_quarter": float(d[-q:].mean()), "max": float(d.max()),
            "max_step": int(d.argmax()), "signed_last_quarter": float(s[-q:].mean())}


def measurement(rec: dict) -> dict:
    """How a run's own loss differs from the fp32 evaluator's on the same batch at the same weights:
    the signed mean and the mean |.| over the evaluated steps."""
    own = np.asarray(rec["loss"])[np.asarray(rec["step"][:-1])]
    d = own - np.asarray(rec["train_fp32"][:-1])
    return {"signed": float(d.mean()), "abs": float(np.abs(d).mean())}


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
    ap.add_argument("--eval-every", type=int, default=20, help="fp32-evaluate every run's weights every N steps")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows of the fp32 evaluator")
    ap.add_argument("--ablate", choices=tuple(ABLATIONS), default=None,
                    help="change one piece of kiln's bf16 runs (ABLATIONS)")
    ap.add_argument("--hold-out", type=int, default=40_000,
                    help="bytes at the corpus' start that training never reads (0: train on all, as before 2026-12-05)")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/fidelity/bf16_residual-<date>.json)")
    args = ap.parse_args()
    from kiln.data.corpus import bundled_text
    from kiln.nn import GPTConfig
    tokens = np.frombuffer(bundled_text().encode("utf-8"), dtype=np.uint8)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    starts = batches(args, len(tokens))
    evaluate = Evaluator(args, cfg, tokens)
    runs, wall = {}, {}
    for run in args.runs.split(","):
        t0 = time.time()
        train = train_kiln if run.startswith("kiln") else train_torch
        runs[run] = train(args, cfg, tokens, starts, run, evaluate)
        wall[run] = time.time() - t0
        r = runs[run]
        print(f"{run:14s} loss {r['loss'][0]:.4f} -> {np.mean(r['loss'][-10:]):.4f}, held-out (fp32) "
              f"{r['held_out'][-1]:.4f} ({wall[run]:.0f} s)", flush=True)
    losses = {run: r["loss"] for run, r in runs.items()}
    pairs = [(a, b) for a, b in PAIRS if a in runs and b in runs]
    gaps = {f"{a}-{b}": gap(losses[a], losses[b]) for a, b in pairs}
    # the same pairs by the fp32 evaluator: on the training batches (their trajectories, one measurement) and
    # held out (the weights' quality); "final" is the held-out gap of the last weights, signed
    evaluated = {f"{a}-{b}": {"train_fp32": gap(runs[a]["train_fp32"], runs[b]["train_fp32"]),
                              "held_out": gap(runs[a]["held_out"], runs[b]["held_out"]),
                              "held_out_final": runs[a]["held_out"][-1] - runs[b]["held_out"][-1]}
                 for a, b in pairs}
    measured = {run: measurement(r) for run, r in runs.items()}
    print(f"{'gap':28s} {'mean':>9s} {'last 1/4':>9s} {'signed':>9s} | fp32-evaluated: {'train':>9s} "
          f"{'held-out':>9s} {'final':>9s}")
    for name, g in gaps.items():
        e = evaluated[name]
        print(f"{name:28s} {g['mean']:9.2e} {g['mean_last_quarter']:9.2e} {g['signed_last_quarter']:+9.2e} | "
              f"{'':15s}{e['train_fp32']['mean']:9.2e} {e['held_out']['mean']:9.2e} {e['held_out_final']:+9.2e}")
    for run, m in measured.items():
        print(f"{run:14s} own loss - fp32 evaluator's, same weights and batch: {m['signed']:+.2e} (|.| {m['abs']:.2e})")
    record = {**run_fields("cpu"), "config": vars(args), "gaps": gaps, "evaluated": evaluated,
              "measurement": measured, "runs": runs, "wall_s": wall}
    out = args.out or ROOT / "benchmarks" / "results" / "fidelity" / f"bf16_residual-{record['date']}.json"
    write_json(record, Path(out))


if __name__ == "__main__":
    main()
