"""GPT-2 124M training steps: kiln vs PyTorch eager vs torch.compile, on one GPU, in one call.

    python benchmarks/gpt2_step.py [--modes fp32,tf32,bf16] [--steps 50] [--batch-size 16] [--max-autotune]

Every (framework, mode) trains in its own subprocess from the same initial weights on the same
batches (the bundled corpus as bytes, B x T tokens a step, uploaded before the first step), with
AdamW (fused in PyTorch), clipping at 1.0 and lr 6e-4. PyTorch runs at its best: the GPT an
nn.Module whose only output is the loss, compiled whole (`compile`: torch.compile's default
mode; `compile-max`: mode max-autotune-no-cudagraphs, whose autotuning takes minutes, hence
--max-autotune), SDPA, fused AdamW. No framework reads a value back inside the timed steps:
tokens/s is the tokens of the steps after --warmup over their wall time (one device sync at
each end), and the losses are read after. `kiln-whole-logits` is kiln with the LM head unfused
(the [B*T, V] logits made whole), the A/B of the fused head; `kiln-branch-cast` is kiln with the
bf16 branch's gradient made by a cast of the add+LayerNorm backward's fp32 dx (the path before that kernel
stored it, the A/B of the fold: the same losses bit for bit, 6 bytes an element more); `kiln-recompute` is kiln with
the LayerNorm outputs and the GELU made again in backward (`recompute_norm_gelu`: 10 of a block's 16 saved activations
not kept, the same losses bit for bit, the A/B of memory against time); `kiln-tuned` is kiln with
every GEMM's cuBLASLt algorithm tuned (KILN_GEMM_AUTOTUNE=1), the A/B of GEMM tuning against `kiln` (the heuristic's
pick, the default): it tunes each shape at its first use on a machine without the algorithm file, i.e. in step 0, and reads the file after;
each kiln row says what tuning did, `gemm_autotune`). Peak memory is the framework's own
peak of allocated device memory; fidelity is the largest difference of the per-step losses
against PyTorch eager in the same mode. Writes benchmarks/results/gpt2_step/gpt2_step-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from result_file import commit, gpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))


def _batches(n, b, t):
    from kiln.data.corpus import bundled_dataset
    from kiln.data.loader import ShardLoader
    loader = ShardLoader(bundled_dataset(), "train", batch_size=b, seq_len=t)
    return [loader.next_batch() for _ in range(n)]


def _model(args):
    import kiln
    from kiln.nn import GPT, preset
    cfg = preset("gpt2-124m", n_layer=args.n_layer, block_size=max(1024, args.seq_len))  # long context: T = the context
    return GPT(cfg, generator=kiln.Generator(1234)), cfg


def run_kiln(args, batches):
    if args.framework == "kiln-tuned":  # before the first GEMM plan is made
        os.environ["KILN_GEMM_AUTOTUNE"] = "1"
    import kiln
    from kiln.graph import CapturedStep
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    model, _ = _model(args)
    model.fused_lm_head = args.framework != "kiln-whole-logits"
    model.recompute_norm_gelu = args.framework == "kiln-recompute"
    dev = kiln.device("cuda")
    if args.framework == "kiln-branch-cast":
        _branch_gradient_by_a_cast(dev.backend)
    model.to(dev)
    apply_precision(model, args.mode, dev, args.bf16_residual)
    backend = dev.backend
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8)

    step = plain_step(model, opt)  # the Trainer's step: the clip fused into AdamW

    graph = CapturedStep(step) if args.cuda_graph else None
    on_device = [(kiln.tensor(x, device=dev), kiln.tensor(y, device=dev)) for x, y in batches]
    losses, t0 = [], None
    for i, (xs, ys) in enumerate(on_device):
        if i == 1:
            backend.end_warmup()  # the paper's allocator: learn the rounding, return step 0's cache
        if i == args.warmup:
            backend.synchronize()
            t0 = time.perf_counter()
        # as the Trainer: two eager steps warm kernels, GEMM plans and the allocator, then one graph
        loss = graph(xs, ys) if graph is not None and i >= 2 else step(xs, ys)
        backend.stream()
        losses.append(loss.data.copy())  # a graph's output is overwritten by the next replay
    backend.synchronize()
    elapsed = time.perf_counter() - t0
    stats = backend.memory_stats()
    if args.kernel_profile:
        xs, ys = on_device[-1]
        _profile_kernels(lambda: (graph(xs, ys) if graph is not None else step(xs, ys)).item(), args)
    return [float(v) for v in losses], elapsed, stats["peak_allocated_bytes"], stats


def _branch_gradient_by_a_cast(backend) -> None:
    """kiln-branch-cast: the add+LayerNorm backward kernel writes dx alone, and a cast kernel rounds it into
    the narrower branch's gradient (the path before the `_dy` kernels: the A/B of folding that cast in)."""
    fused = backend.add_layer_norm_bwd

    def add_layer_norm_bwd(grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype=None,
                           branch_dtype=None):
        dx, _, dw, db = fused(grad_s, grad_h, s, weight, mean, rstd, need_dw, need_db, param_grad_dtype)
        return dx, dx if branch_dtype is None or dx.dtype == branch_dtype else dx.astype(branch_dtype), dw, db
    backend.add_layer_norm_bwd = add_layer_norm_bwd


COMPILE_MODES = {"compile": "default", "compile-max": "max-autotune-no-cudagraphs"}


def run_torch(args, batches):
    import torch

    from tests.torch_gpt import torch_gpt_forward, torch_params

    class TorchGPT(torch.nn.Module):
        """The peer GPT as one nn.Module whose only output is the loss (nanoGPT's shape)."""

        def __init__(self, params, cfg):
            super().__init__()
            self.names = list(params)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(v) for v in params.values())
            self.cfg = cfg

        def forward(self, idx, targets):
            return torch_gpt_forward(dict(zip(self.names, self.weights)), self.cfg, idx, targets)[1]

    model, cfg = _model(args)
    net = TorchGPT({k: v.detach().cuda() for k, v in torch_params(model, torch.float32).items()}, cfg)
    torch.backends.cuda.matmul.allow_tf32 = args.mode == "tf32"
    torch.backends.cudnn.allow_tf32 = args.mode == "tf32"
    plist = list(net.parameters())
    decay = [p for p in plist if p.ndim >= 2]
    no_decay = [p for p in plist if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(net, mode=COMPILE_MODES[args.framework]) if args.framework in COMPILE_MODES else net

    def step(xs, ys):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.mode == "bf16"):
            loss = fwd(xs, ys)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        return loss.detach()

    on_device = [(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()) for x, y in batches]
    losses, t0 = [], None
    torch.cuda.reset_peak_memory_stats()
    for i, (xs, ys) in enumerate(on_device):
        if i == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        losses.append(step(xs, ys))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    if args.kernel_profile:
        xs, ys = on_device[-1]
        _profile_kernels(lambda: step(xs, ys).item(), args)
    return [float(v) for v in losses], elapsed, peak, {}


def _profile_kernels(one_step, args, steps: int = 3) -> None:
    """The GPU kernels of `steps` more steps, by total time (CUPTI through torch.profiler, so it
    also sees kiln's CuPy and cuBLASLt kernels, inside a CUDA graph too); a table per framework."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    one_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    out = Path(args.kernel_profile)
    out.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90)
    (out / f"kernels-{args.framework}-{args.mode}.txt").write_text(
        f"{args.framework} {args.mode}: GPU kernels of {steps} steps (divide the totals by {steps})\n{table}\n")


def worker(args) -> dict:
    batches = _batches(args.steps, args.batch_size, args.seq_len)
    run = run_kiln if args.framework.startswith("kiln") else run_torch
    losses, elapsed, peak, extra = run(args, batches)
    timed = args.steps - args.warmup
    tokens = args.batch_size * args.seq_len
    row = {"framework": args.framework, "mode": args.mode, "tokens_per_s": tokens * timed / elapsed,
           "mean_step_ms": 1000 * elapsed / timed, "peak_allocated_gib": peak / 2**30,
           "losses": losses, "memory": extra}
    if args.framework.startswith("kiln"):
        from kiln.backend.cuda import cublaslt
        row["gemm_autotune"] = cublaslt.autotune_stats()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="fp32,tf32,bf16")
    ap.add_argument("--frameworks", default="kiln,eager,compile",
                    help="of kiln, kiln-tuned, kiln-whole-logits, kiln-branch-cast, kiln-recompute, eager, "
                         "compile, compile-max")
    ap.add_argument("--max-autotune", action="store_true",
                    help="add compile-max (torch.compile mode max-autotune-no-cudagraphs: minutes of autotuning)")
    ap.add_argument("--worker-timeout", type=float, default=900, help="seconds one (framework, mode) may take")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--bf16-residual", choices=("fp32", "bf16"), default="fp32",
                    help="kiln's residual stream in bf16 mode: fp32 as autocast (default) or bf16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpt2_step"))
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                    help="kiln runs every step op by op (default: replayed as one CUDA graph from step 2)")
    ap.add_argument("--kernel-profile", metavar="DIR",
                    help="after the timed steps, profile 3 more steps per framework: a table of GPU kernels in DIR, and "
                         "kiln's against each PyTorch framework's by kernel family (kernel_compare.py)")
    ap.add_argument("--framework", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.framework:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    frameworks = args.frameworks.split(",") + (["compile-max"] if args.max_autotune else [])
    rows = []
    for mode in args.modes.split(","):
        for fw in frameworks:
            cmd = [sys.executable, __file__, "--framework", fw, "--mode", mode, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len), "--n-layer", str(args.n_layer),
                   "--bf16-residual", args.bf16_residual] + \
                  ([] if args.cuda_graph else ["--no-cuda-graph"]) + \
                  (["--kernel-profile", args.kernel_profile] if args.kernel_profile else [])
            t0 = time.time()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
            except subprocess.TimeoutExpired:
                print(f"{fw} {mode}: over --worker-timeout ({args.worker_timeout:.0f} s)", flush=True)
                rows.append({"framework": fw, "mode": mode, "error": f"timed out after {args.worker_timeout:.0f} s"})
                continue
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode or not line:
                print(f"{fw} {mode}: FAILED\n{done.stderr[-3000:]}", flush=True)
                rows.append({"framework": fw, "mode": mode, "error": done.stderr[-3000:]})
                continue
            r = json.loads(line[0][7:])
            r["wall_s"] = time.time() - t0
            rows.append(r)
            print(f"{fw:8} {mode:5} {r['tokens_per_s']:10.0f} tok/s {r['peak_allocated_gib']:7.2f} GiB "
                  f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} ({r['wall_s']:.0f} s)", flush=True)
            if "gemm_autotune" in r:
                print(f"{'':8} GEMM tuning: {r['gemm_autotune']}", flush=True)
    by = {(r["framework"], r["mode"]): r for r in rows if "error" not in r}
    for r in rows:
        ref = by.get(("eager", r["mode"]))
        if "error" not in r and ref:
            r["max_loss_diff_vs_eager"] = float(max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])))
            r["tokens_per_s_vs_eager"] = r["tokens_per_s"] / ref["tokens_per_s"]
            r["memory_vs_eager"] = r["peak_allocated_gib"] / ref["peak_allocated_gib"]
        # PyTorch at its best: the faster of its compile modes
        comps = [by[(f, r["mode"])] for f in COMPILE_MODES if (f, r["mode"]) in by]
        if "error" not in r and comps:
            best = max(comps, key=lambda c: c["tokens_per_s"])
            r["best_compile"] = best["framework"]
            r["tokens_per_s_vs_compile"] = r["tokens_per_s"] / best["tokens_per_s"]
            r["memory_vs_compile"] = r["peak_allocated_gib"] / best["peak_allocated_gib"]
    gpu = gpu_name()
    import torch
    date = time.strftime("%Y-%m-%d")
    record = {"benchmark": "gpt2_step", "date": date,
              "commit": commit(),
              "command": " ".join(["python", *sys.argv]), "device": gpu, "torch": torch.__version__,
              "python": platform.python_version(), "batch": [args.batch_size, args.seq_len], "bf16_residual": args.bf16_residual,
              "n_layer": args.n_layer, "steps": args.steps, "warmup": args.warmup,
              "kiln_cuda_graph": args.cuda_graph, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpt2_step-{date}.json").write_text(json.dumps(record, indent=2))
    nan = float("nan")
    lines = ["| framework | mode | tokens/s | vs eager | vs best compile | peak GiB | vs eager | vs best compile "
             "| max loss diff vs eager |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['mode']} | failed | | | | | | |")
            continue
        lines.append(f"| {r['framework']} | {r['mode']} | {r['tokens_per_s']:.0f} | "
                     f"{r.get('tokens_per_s_vs_eager', nan):.2f} | {r.get('tokens_per_s_vs_compile', nan):.2f} | "
                     f"{r['peak_allocated_gib']:.2f} | {r.get('memory_vs_eager', nan):.2f} | "
                     f"{r.get('memory_vs_compile', nan):.2f} | {r.get('max_loss_diff_vs_eager', nan):.2e} |")
    (out / f"gpt2_step-{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.kernel_profile:
        compare_kernels(Path(args.kernel_profile), frameworks, args.modes.split(","))


def compare_kernels(folder: Path, frameworks, modes) -> list[Path]:
    """Beside the kernel tables: each kiln framework's kernels against each PyTorch framework's of the same mode,
    family by family (benchmarks/kernel_compare.py), as kernel-compare-<kiln>-<peer>-<mode>.md and .png; the tables
    written."""
    import kernel_compare
    written = []
    for mode in modes:
        for ours in [f for f in frameworks if f.startswith("kiln")]:
            for peer in [f for f in frameworks if not f.startswith("kiln")]:
                a, b = (folder / f"kernels-{f}-{mode}.txt" for f in (ours, peer))
                if not (a.exists() and b.exists()):
                    continue
                fams = kernel_compare.by_family(a.read_text()), kernel_compare.by_family(b.read_text())
                md = kernel_compare.table(*fams, (ours, peer))
                path = folder / f"kernel-compare-{ours}-{peer}-{mode}.md"
                path.write_text(md + "\n")
                kernel_compare.plot(*fams, (ours, peer), path.with_suffix(".png"))
                written.append(path)
                print(f"\n{ours} against {peer}, {mode}, GPU time a step by kernel family:\n{md}")
    return written


if __name__ == "__main__":
    main()
