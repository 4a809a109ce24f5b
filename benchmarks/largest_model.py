"""The largest fp32 AdamW GPT on one GPU (paper §6.5 on an H200): PyTorch at its best vs kiln with
AdamW inside backward, d=3072, 24 heads, B2 T1024, fp32, in one call.

    python benchmarks/largest_model.py [--torch-layers 76] [--kiln-layers 76,92] [--clip off,on]
    python benchmarks/largest_model.py --saved-bytes   # CPU: what a block keeps for backward

PyTorch: an nn.Module whose only output is the loss (tests/torch_gpt.py's GPT), SDPA, fused AdamW
(grads set to None), clip_grad_norm_ 1.0, built on the device; `--torch-compile` adds
torch.compile(model) (minutes of compiling at 76 layers: not in the default set). PyTorch holds
16 bytes a parameter (weights, gradients, two moments) and stops at 76 layers on an H200.
kiln: AdamW(in_backward=True) updates each parameter as its gradient is final and keeps none
(12 bytes a parameter); the clip is exact, by a first backward that only sums the squares (so "on"
costs a second backward), or ("host") by one backward that sums them and parks each gradient in pinned
host memory for the updates after it (PCIe both ways: the predicted ratio counts the copies back at
PCIE_BYTES_PER_S); the first --recompute-blocks blocks keep only their inputs (default: the fewest
that the memory arithmetic below says fit). Each (framework, layers, clip) runs in its own
process on random tokens, steps op by op (the Trainer does not capture an in-backward step), nothing
read back inside the timed steps. The figure of merit is tokens/s x parameters against PyTorch's at
its layers (the target: >= 0.9 at >= 10.5B parameters). Writes
benchmarks/results/largest_model/largest_model-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from result_file import run_fields, write_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

D, HEADS, VOCAB, B, T = 3072, 24, 50304, 2, 1024
GIB = 2 ** 30
# What one block keeps for backward, in [B, T, d] arrays (--saved-bytes measures it on the CPU): the
# residual stream and LayerNorm output before each sublayer (4), q, k, v (3), the attention output (1),
# the MLP's pre-activation and GELU output (4 + 4), plus the LSE and LayerNorm statistics (rows only);
# with the LayerNorm and GELU outputs made again in backward (GPT.recompute_norm_gelu): 10.
PLAIN_BLOCK_UNITS = {False: 16, True: 10}  # by recompute_norm_gelu
RECOMPUTED_BLOCK_UNITS = 2  # its two inputs, x and ln_1(x)
RESERVE_BYTES = 3.5 * GIB  # the LM head's dweight and its copy (2 x 0.58 GiB), a block's backward temporaries, the CUDA context


def config(n_layer: int):
    from kiln.nn import preset
    return preset("gpt2-largest", n_layer=n_layer, vocab_size=VOCAB)


def n_params(n_layer: int) -> int:
    return sum(math.prod(s) for s in config(n_layer).parameter_shapes().values())


def unit_bytes() -> int:
    return B * T * D * 4


def recompute_plan(n_layer: int, device_bytes: int, gelu: bool = True) -> int:
    """The fewest blocks to recompute so that weights + moments (12 bytes a parameter), the blocks'
    saved activations and RESERVE_BYTES fit in device_bytes (0 when all blocks fit; n_layer at most)."""
    free = device_bytes - 12 * n_params(n_layer) - RESERVE_BYTES
    plain, redone = PLAIN_BLOCK_UNITS[gelu] * unit_bytes(), RECOMPUTED_BLOCK_UNITS * unit_bytes()
    need = n_layer * plain - free
    return min(n_layer, max(0, math.ceil(need / (plain - redone))))


def predicted_bytes(n_layer: int, recompute: int, gelu: bool = True) -> int:
    blocks = (n_layer - recompute) * PLAIN_BLOCK_UNITS[gelu] + recompute * RECOMPUTED_BLOCK_UNITS
    return 12 * n_params(n_layer) + blocks * unit_bytes() + RESERVE_BYTES


# Host-to-device bytes a second for the clip through host memory's copies back (an H100, 2026-12-06: its
# step took 0.51 s more than the no-clip step for 24.6 GB of gradients)
PCIE_BYTES_PER_S = 48e9


def predicted_product(row: dict, ref: dict) -> float:
    """kiln's tokens/s x parameters over PyTorch's (ref), were kiln at PyTorch's FLOP rate with its extra
    FLOPs (flops_factor) and, for the clip through host memory, its gradients' 4 bytes a parameter copied
    back over PCIe after backward, not overlapped."""
    step = ref["step_s"] * row["params"] / ref["params"] * flops_factor(row["n_layer"], row["recompute_blocks"],
                                                                         row["clip"] == "on")
    if row["clip"] == "host":
        step += 4 * row["params"] / PCIE_BYTES_PER_S
    return ref["step_s"] * row["params"] / (step * ref["params"])


def flops_factor(n_layer: int, recompute: int, clip: bool) -> float:
    """The step's FLOPs over the ordinary step's 6N a token: a recomputed block adds its forward (2 of
    6), the exact clip a second backward (4 of 6), and with it a second recompute of each such block."""
    redo = recompute / n_layer * 2 / 6
    return 1 + redo + (4 / 6 + redo if clip else 0)


# --- the saved bytes, counted on the CPU ---------------------------------------------------------------
def saved_units(n_layer: int, recompute: int = 0, gelu: bool = False, d: int = 64, b: int = 2, t: int = 32) -> dict:
    """{op: [B, T, d] arrays it keeps for backward} over a GPT's graph (the parameters themselves not
    counted; an array counted once, under the first op that holds it)."""
    import numpy as np

    import kiln
    from kiln.autograd import graph_nodes
    from kiln.nn import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=t, n_layer=n_layer, n_head=4, n_embd=d))
    model.recompute_blocks = recompute
    model.recompute_norm_gelu = gelu
    rng = np.random.default_rng(0)
    loss = model(kiln.tensor(rng.integers(0, 64, (b, t))), kiln.tensor(rng.integers(0, 64, (b, t))))[1]
    params = {id(p.data) for p in model.parameters()}
    nodes = graph_nodes(loss)

    def arrays(obj):
        if isinstance(obj, np.ndarray):
            yield obj
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                yield from arrays(o)
    owner: dict = {}
    for node in sorted(nodes, key=lambda n: n.seq):
        held = [item[0] for item in node._saved if item is not None] + list(vars(node).values())
        for a in arrays(held):
            while isinstance(a.base, np.ndarray):
                a = a.base
            if id(a) not in params:
                owner.setdefault(id(a), (type(node).__name__, a.nbytes))
    units: dict = {}
    for name, nbytes in owner.values():
        units[name] = units.get(name, 0.0) + nbytes / (b * t * d * 4)
    return units


def saved_per_block() -> dict:
    """Units a plain block, one whose GELU is made again and a recomputed block keep: the difference
    between 3 and 2 blocks."""
    out = {}
    for name, recompute, gelu in (("plain", False, False), ("norm_gelu_recomputed", False, True), ("recomputed", True, False)):
        two, three = (sum(saved_units(n, n if recompute else 0, gelu).values()) for n in (2, 3))
        out[name] = three - two
    for name, gelu in (("plain_by_op", False), ("norm_gelu_recomputed_by_op", True)):
        out[name] = {k: v - saved_units(2, 0, gelu).get(k, 0.0) for k, v in saved_units(3, 0, gelu).items()}
    return out


# --- one case in its own process --------------------------------------------------------------------
def _tokens(steps: int):
    import numpy as np
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, (B, T)), rng.integers(0, VOCAB, (B, T))) for _ in range(steps)]


def run_kiln(args) -> dict:
    import kiln
    from kiln.nn import GPT
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision
    dev = kiln.device(args.device)
    backend = dev.backend
    print(f"kiln {args.n_layer} layers: building on the device", flush=True)
    model = GPT(config(args.n_layer), generator=kiln.Generator(1234, device=args.device))
    model.to(dev)
    apply_precision(model, "fp32", dev)
    model.recompute_blocks = args.recompute_blocks
    model.recompute_norm_gelu = args.recompute_norm_gelu == "on"
    opt = AdamW(gpt_param_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, in_backward=True,
                clip_via="host" if args.clip == "host" else "recompute")
    max_norm = None if args.clip == "off" else 1.0

    def step(x, y):  # the Trainer's step with AdamW in backward; the graph goes when it returns
        loss = model(x, y)[1]
        opt.backward_step(loss, max_norm)
        return loss.detach()

    batches = [(kiln.tensor(x, device=dev), kiln.tensor(y, device=dev)) for x, y in _tokens(args.steps)]
    losses, t0 = [], None
    for i, (x, y) in enumerate(batches):
        if i == 1:
            backend.end_warmup()  # as the Trainer: learn the allocator's rounding after the first step
        if i == args.warmup:
            backend.synchronize()
            t0 = time.perf_counter()
        losses.append(step(x, y))
        print(f"  step {i + 1}/{args.steps}", flush=True)
    backend.synchronize()
    elapsed = time.perf_counter() - t0
    stats = backend.memory_stats()
    return {"losses": [float(v.item()) for v in losses], "elapsed": elapsed,
            "peak_bytes": stats.get("peak_allocated_bytes", 0), "peak_reserved_bytes": stats.get("peak_reserved_bytes")}


def run_torch(args) -> dict:
    import torch

    from tests.torch_gpt import torch_gpt_forward
    cfg = config(args.n_layer)

    class TorchGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.names = list(cfg.parameter_shapes())
            resid = 0.02 / math.sqrt(2 * cfg.n_layer)
            weights = []
            for name, shape in cfg.parameter_shapes().items():
                if name.endswith("bias"):
                    w = torch.zeros(shape)
                elif len(shape) == 1:
                    w = torch.ones(shape)
                else:
                    w = torch.randn(shape) * (resid if name.endswith("c_proj.weight") else 0.02)
                weights.append(torch.nn.Parameter(w))
            self.weights = torch.nn.ParameterList(weights)

        def forward(self, idx, targets):
            return torch_gpt_forward(dict(zip(self.names, self.weights)), cfg, idx, targets)[1]

    print(f"{args.framework} {args.n_layer} layers: building on the device", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.device(args.device):
        net = TorchGPT()
    plist = list(net.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in plist if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in plist if p.ndim < 2], "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(net) if args.framework == "torch-compile" else net
    batches = [(torch.from_numpy(x).to(args.device), torch.from_numpy(y).to(args.device)) for x, y in _tokens(args.steps)]
    losses, t0 = [], None
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i, (x, y) in enumerate(batches):
        if i == args.warmup:
            sync()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = fwd(x, y)
        loss.backward()
        if args.clip == "on":
            torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        losses.append(loss.detach())
        print(f"  step {i + 1}/{args.steps}", flush=True)
    sync()
    elapsed = time.perf_counter() - t0
    return {"losses": [float(v) for v in losses], "elapsed": elapsed,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}


def worker(args) -> dict:
    r = (run_kiln if args.framework == "kiln" else run_torch)(args)
    timed = args.steps - args.warmup
    params = n_params(args.n_layer)
    tokens_per_s = B * T * timed / r["elapsed"]
    return {"framework": args.framework, "n_layer": args.n_layer, "clip": args.clip, "params": params,
            "recompute_blocks": args.recompute_blocks if args.framework == "kiln" else None,
            "recompute_norm_gelu": args.recompute_norm_gelu if args.framework == "kiln" else None,
            "tokens_per_s": tokens_per_s, "step_s": r["elapsed"] / timed, "tokens_x_params": tokens_per_s * params,
            "peak_allocated_gib": r["peak_bytes"] / GIB,
            "peak_reserved_gib": None if r["peak_reserved_bytes"] is None else r["peak_reserved_bytes"] / GIB,
            "losses": r["losses"]}


# --- the call ---------------------------------------------------------------------------------------
def device_bytes() -> int:
    """The first GPU's memory as nvidia-smi reports it (MiB)."""
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout.splitlines()[0]) * 2 ** 20


def cases(args, total: int) -> list[dict]:
    out = []
    for fw in ["torch-eager"] + (["torch-compile"] if args.torch_compile else []):
        for n in args.torch_layers:
            out.append({"framework": fw, "n_layer": n, "clip": "on", "recompute_blocks": 0, "recompute_norm_gelu": "off"})
    gelu = args.recompute_norm_gelu == "on"
    for n in args.kiln_layers:
        k = args.recompute_blocks if args.recompute_blocks is not None else recompute_plan(n, total, gelu)
        for clip in args.clip:
            out.append({"framework": "kiln", "n_layer": n, "clip": clip, "recompute_blocks": k,
                        "recompute_norm_gelu": args.recompute_norm_gelu})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| framework | layers | params | clip | recomputed blocks, norm/GELU | tokens/s | step s | peak GiB (allocated) "
             "| predicted GiB | tokens/s x params vs PyTorch | predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['framework']} | {r['n_layer']} | | {r['clip']} | {r.get('recompute_blocks', '')} "
                         f"| {r['error'].splitlines()[-1][:120] if r['error'] else 'failed'} | | | | | |")
            continue
        redo = "" if r["recompute_blocks"] is None else f"{r['recompute_blocks']}, {r['recompute_norm_gelu']}"
        lines.append(f"| {r['framework']} | {r['n_layer']} | {r['params'] / 1e9:.2f}B | {r['clip']} | {redo} "
                     f"| {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['peak_allocated_gib']:.1f} "
                     f"| {r.get('predicted_gib', float('nan')):.1f} | {r.get('product_vs_torch', float('nan')):.3f} "
                     f"| {r.get('predicted_product_vs_torch', float('nan')):.3f} |")
    return "\n".join(lines)


def run_case(args, case: dict, rows: list, todo: list, retries: int) -> int:
    """One case in its own process: its row (or its error) appended to rows; a kiln case out of memory
    queued again with more recomputed blocks (at most --oom-retries in all). Returns the retries used."""
    cmd = [sys.executable, __file__, "--framework", case["framework"], "--n-layer-one", str(case["n_layer"]),
           "--clip", case["clip"], "--recompute-blocks", str(case["recompute_blocks"]),
           "--recompute-norm-gelu", case["recompute_norm_gelu"],
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    label = (f"{case['framework']} {case['n_layer']} layers clip {case['clip']} recompute {case['recompute_blocks']} "
             f"blocks, norm/gelu {case['recompute_norm_gelu']}")
    print(f"{label}: running", flush=True)
    t0 = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        rows.append({**case, "error": f"timed out after {args.worker_timeout:.0f} s"})
        print(f"{label}: over --worker-timeout", flush=True)
        return retries
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not line:
        rows.append({**case, "error": done.stderr[-3000:]})
        print(f"{label}: FAILED\n{done.stderr[-1500:]}", flush=True)
        out_of_memory = "MemoryError" in done.stderr or "out of memory" in done.stderr.lower()
        if case["framework"] == "kiln" and out_of_memory and retries < args.oom_retries \
                and case["recompute_blocks"] < case["n_layer"]:  # the arithmetic was short: recompute more
            todo.insert(0, {**case, "recompute_blocks": min(case["n_layer"], case["recompute_blocks"] + args.oom_step)})
            return retries + 1
        return retries
    r = json.loads(line[0][7:])
    r["wall_s"] = time.time() - t0
    if r["framework"] == "kiln":
        r["predicted_gib"] = predicted_bytes(r["n_layer"], r["recompute_blocks"], r["recompute_norm_gelu"] == "on") / GIB
    rows.append(r)
    print(f"{label}: {r['tokens_per_s']:.0f} tok/s, {r['peak_allocated_gib']:.1f} GiB, {r['params'] / 1e9:.2f}B "
          f"params, loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} ({r['wall_s']:.0f} s)", flush=True)
    return retries


def write_record(args, rows: list, total: int) -> list:
    """The result file (json and md) of the cases run so far, written after each case: a call cut short
    (a device call's time limit) keeps the cases it finished. Returns the rows as written (each beside
    PyTorch's, where it ran)."""
    rows = [dict(r) for r in rows]
    ref = next((r for r in rows if r["framework"] == "torch-eager" and "error" not in r), None)
    for r in rows:
        if ref is not None and "error" not in r:
            r["product_vs_torch"] = r["tokens_x_params"] / ref["tokens_x_params"]
            if r["framework"] == "kiln":
                r["predicted_product_vs_torch"] = predicted_product(r, ref)
    record = {"benchmark": "largest_model", **run_fields("cuda"), "shape": {"d": D, "heads": HEADS, "B": B, "T": T},
              "device_gib": total / GIB, "steps": args.steps, "warmup": args.warmup,
              "target": ">= 10.5B parameters with tokens/s x params >= 0.9x PyTorch's at its largest", "rows": rows}
    name = args.name or f"largest_model-{record['date']}"
    out = Path(args.out)
    write_json(record, out / f"{name}.json")
    md = (f"# Largest fp32 AdamW model, d={D} {HEADS} heads B{B} T{T}, {record['gpu']}, {record['date']} at "
          f"{record['commit'][:7]}\n\n`{record['command']}`\n\n{table(rows)}\n")
    (out / f"{name}.md").write_text(md)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-layers", default="76", help="PyTorch's layer counts (comma-separated)")
    ap.add_argument("--kiln-layers", "--n-layer", default="76,92", help="kiln's layer counts (comma-separated)")
    ap.add_argument("--clip", default="off,on,host", help="kiln with the clip off, on (a second backward), host (the "
                    "gradients parked in host memory: one backward), comma-separated (PyTorch always clips)")
    ap.add_argument("--recompute-blocks", type=int,
                    help="kiln's recomputed blocks at every layer count (default: the fewest that fit, per layer count)")
    ap.add_argument("--recompute-norm-gelu", default="on", choices=("on", "off"),
                    help="kiln's blocks make their LayerNorm and GELU outputs again in backward (default on: 10 saved "
                         "activations a block, not 16)")
    ap.add_argument("--torch-compile", action="store_true", help="add torch.compile(model) (minutes to compile)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--worker-timeout", type=float, default=300, help="seconds one case may take")
    ap.add_argument("--oom-step", type=int, default=8, help="a kiln case out of memory runs again with N more "
                    "recomputed blocks (at most --oom-retries times in all)")
    ap.add_argument("--oom-retries", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "largest_model"))
    ap.add_argument("--name", help="result file name without suffix (default: largest_model-<date>)")
    ap.add_argument("--saved-bytes", action="store_true", help="CPU only: what a block keeps for backward, and exit")
    ap.add_argument("--framework", help=argparse.SUPPRESS)
    ap.add_argument("--n-layer-one", type=int, dest="n_layer", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # a case on the CPU: the tests' small one
    args = ap.parse_args()
    if args.saved_bytes:
        print(json.dumps(saved_per_block(), indent=1))
        return
    if args.framework:  # one case, in this process
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    args.torch_layers = [int(n) for n in args.torch_layers.split(",") if n]
    args.kiln_layers = [int(n) for n in args.kiln_layers.split(",") if n]
    args.clip = args.clip.split(",")
    total = device_bytes()
    print(f"device memory {total / GIB:.1f} GiB; a plain block keeps {PLAIN_BLOCK_UNITS[args.recompute_norm_gelu == 'on']} x "
          f"{unit_bytes() / 2**20:.0f} MiB, a recomputed one {RECOMPUTED_BLOCK_UNITS}", flush=True)
    rows, todo, retries = [], cases(args, total), 0
    written: list = []
    while todo:
        retries = run_case(args, todo.pop(0), rows, todo, retries)
        written = write_record(args, rows, total)
    print(table(written))


if __name__ == "__main__":
    main()
