"""The paper's Figure 3 on our GPU: kiln and PyTorch train GPT-2 from the same weights on the same
text in the same order; validation loss every --eval-interval steps; the curves and their gaps plotted.

    python benchmarks/fidelity.py [--modes fp32,bf16] [--frameworks kiln,eager,compile] [--steps 2000]
    python benchmarks/fidelity.py --merge A.json B.json [--name STEM]   (one run split over calls)

The text is on the machine already: the Python standard library's sources (and, with
--site-packages, the installed packages' too), prepared once with `kiln prepare` into a
byte-level BPE of --vocab-size ids (default 50257, padded to 50304 as GPT-2's) with a held-out
split; nothing is downloaded. Batches are drawn as nanoGPT's get_batch draws them: each row at an
offset drawn uniformly over the whole training split by one generator seeded with --seed, so
every framework trains on the same windows in the same order and no curve follows the files'
order through the corpus. The validation loss is the mean over --eval-iters batches of fixed
windows spread evenly over the held-out split, the same at every evaluation for every framework.
Each run records a SHA-256 of every token it was served, and the report refuses runs that differ.

Each (framework, mode) trains in its own subprocess: kiln (its step replayed as a CUDA graph, as
the Trainer does), PyTorch eager (the reference of every gap) and torch.compile. In bf16,
compile's largest gap from eager is kiln's target; in fp32 the target is the paper's 3e-3 and
compile's gap is the band beside it: what two correct fp32 implementations differ by on this run.
The schedule has the paper's shape: linear warm-up over --warmup-fraction of the steps (default
10%), cosine decay to a tenth of --lr; AdamW (0.9, 0.95), weight decay 0.1, clip 1.0. Per mode the
report gives each framework's largest gap from eager, its step, the median over the evaluations
and the final gap. Writes benchmarks/results/fidelity/<stem>.json, .md and .png, rewritten as each
run finishes; where kiln misses its target, the precision logger (`kiln.precision`) runs one step
at kiln's final weights and says where. A run too long for one call is split with --modes and
--frameworks, and its result files joined with --merge (on any machine: it trains nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
from result_file import commit, gpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

FP32_TARGET = 3e-3  # the paper's: validation curves within 3e-3 at every evaluation in fp32
FRAMEWORKS = ("kiln", "eager", "compile")
MODES = ("fp32", "tf32", "bf16")
# what two result files must share to be one run, joined by --merge
SAME_RUN = ("commit", "device", "torch", "data_meta", "batch", "model", "overrides", "steps", "eval_interval",
            "eval_iters", "schedule", "seed", "bf16_residual")


def python_sources(site_packages: bool) -> list[Path]:
    """The .py files of this interpreter's standard library (and site-packages): real text on every machine."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    if site_packages:
        roots.append(Path(sysconfig.get_paths()["purelib"]))
    files = []
    for root in roots:
        files += sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts[:1]
                        or root.name == "site-packages")
    return [p for p in files if p.is_file() and p.stat().st_size > 0]


def corpus(args) -> Path:
    """The prepared corpus: --data as given, else the Python sources prepared into --corpus-dir (once; the
    default folder is named after the options that choose the text, so a different choice prepares anew)."""
    if args.data:
        return Path(args.data)
    sources = "stdlib+site-packages" if args.site_packages else "stdlib"
    out = Path(args.corpus_dir or Path(tempfile.gettempdir()) /
               f"kiln-fidelity-{sources}-{args.max_files or 'all'}-bpe{args.vocab_size}")
    if (out / "meta.json").is_file():
        return out
    from kiln.data.prepare import prepare
    files = python_sources(args.site_packages)
    if args.max_files:
        files = files[: args.max_files]
    t0 = time.time()
    done = prepare(files, out, tokenizer="bpe", vocab_size=args.vocab_size, val_fraction=0.05,
                   workers=os.cpu_count() or 1, progress=False)
    print(f"prepared {len(files)} files in {time.time() - t0:.0f} s: {done.tokens['train']:,} train and "
          f"{done.tokens['val']:,} val tokens, vocab {done.vocab_size} (model {done.padded_vocab_size})", flush=True)
    return out


def model_config(args, data: Path):
    from kiln.nn import preset
    vocab = json.loads((data / "meta.json").read_text())["padded_vocab_size"]
    over = {k: v for k, v in (("n_layer", args.n_layer), ("n_head", args.n_head), ("n_embd", args.n_embd))
            if v is not None}
    return preset(args.model, vocab_size=vocab, block_size=max(args.seq_len, 1), **over)


def split_tokens(data: Path, split: str) -> np.ndarray:
    """All tokens of one split of a `kiln prepare` folder, its shards in order (memory-mapped when one)."""
    from kiln.data.loader import read_meta
    from kiln.data.shards import open_shard
    from kiln.errors import DataError
    from kiln.paths import file_inside
    meta = read_meta(data)
    names = (meta or {}).get("splits", {}).get(split, {}).get("shards", [])
    if not names:
        raise DataError(f"{data}: no {split!r} shards in its meta.json (a `kiln prepare` folder is needed)")
    shards = [open_shard(file_inside(data, name, f"{data / 'meta.json'}")) for name in names]
    return shards[0] if len(shards) == 1 else np.concatenate(shards)


def _check_fits(split: str, n_tokens: int, seq_len: int) -> None:
    from kiln.errors import DataError
    if n_tokens < seq_len + 1:
        raise DataError(f"the {split} split holds {n_tokens} tokens, fewer than one window of seq_len + 1 = "
                        f"{seq_len + 1}: give more text or a shorter --seq-len")


def train_offsets(seed: int, steps: int, batch_size: int, seq_len: int, n_tokens: int) -> np.ndarray:
    """(steps, batch_size) window starts drawn uniformly over the whole training split, as nanoGPT's get_batch
    draws them, by one generator seeded with `seed`: the same seed gives the same windows in the same order."""
    _check_fits("train", n_tokens, seq_len)
    return np.random.default_rng(seed).integers(0, n_tokens - seq_len, size=(steps, batch_size))


def val_offsets(eval_iters: int, batch_size: int, seq_len: int, n_tokens: int) -> np.ndarray:
    """(eval_iters, batch_size) window starts spread evenly over the held-out split, from its first token to
    its last window: the whole split is sampled, and every evaluation reads the same windows."""
    _check_fits("val", n_tokens, seq_len)
    return np.linspace(0, n_tokens - seq_len - 1, eval_iters * batch_size).astype(np.int64).reshape(
        eval_iters, batch_size)


class Batches:
    """A run's text: (x, y) int64 batches of windows at `train_offsets` and `val_offsets`; y is x shifted
    by one. Every framework builds it from the same arguments, so all are served the same tokens; `digests`
    (a SHA-256 of every token served, train and val apart) lets the report check that they were."""

    def __init__(self, data: Path, *, steps: int, batch_size: int, seq_len: int, eval_iters: int, seed: int):
        self._tokens = {"train": split_tokens(data, "train"), "val": split_tokens(data, "val")}
        self.train_at = train_offsets(seed, steps, batch_size, seq_len, len(self._tokens["train"]))
        self.val_at = val_offsets(eval_iters, batch_size, seq_len, len(self._tokens["val"]))
        self._span = np.arange(seq_len + 1)
        self._sha = {"train": hashlib.sha256(), "val": hashlib.sha256()}

    def train(self, step: int):
        """The batch of training step `step`."""
        return self._cut("train", self.train_at[step])

    def val(self) -> list:
        """The validation batches: the same windows at every call."""
        return [self._cut("val", at) for at in self.val_at]

    def digests(self) -> dict:
        """{"train": ..., "val": ...}: SHA-256 hex digests of the tokens served so far."""
        return {split: sha.hexdigest() for split, sha in self._sha.items()}

    def _cut(self, split: str, offsets: np.ndarray):
        window = self._tokens[split][offsets[:, None] + self._span]
        self._sha[split].update(window.tobytes())
        window = window.astype(np.int64)
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


def batches(args, data: Path) -> Batches:
    return Batches(data, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                   eval_iters=args.eval_iters, seed=args.seed)


def warmup_steps(args) -> int:
    return round(args.steps * args.warmup_fraction)


def lr_at(args, step: int) -> float:
    from kiln.optim import warmup_cosine_lr
    return warmup_cosine_lr(step, args.lr, args.lr / 10, warmup_steps(args), args.steps)


def run_kiln(args, data: Path) -> dict:
    import kiln
    from kiln.graph import CapturedStep
    from kiln.nn import GPT
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.train import apply_precision, plain_step
    cfg = model_config(args, data)
    dev = kiln.device(args.device)
    model = GPT(cfg, generator=kiln.Generator(args.seed))
    model.to(dev)
    apply_precision(model, args.mode, dev, args.bf16_residual)
    opt = AdamW(gpt_param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    step = plain_step(model, opt, grad_clip=1.0)  # the Trainer's step: the clip fused into AdamW
    def evaluate():
        model.eval()
        with kiln.no_grad():
            out = [model(*(kiln.tensor(a, device=dev) for a in xy))[1].item() for xy in text.val()]
        model.train()
        return float(np.mean(out))

    text = batches(args, data)
    graph = CapturedStep(step) if dev.type == "cuda" and args.cuda_graph else None
    losses, evals = [], []
    for i in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(args, i)
        if i == 1 and dev.type == "cuda":
            dev.backend.end_warmup()
        x, y = (kiln.tensor(a, device=dev) for a in text.train(i))
        losses.append((graph(x, y) if graph is not None and i >= 2 else step(x, y)).item())
        if (i + 1) % args.eval_interval == 0 or i + 1 == args.steps:
            evals.append((i + 1, evaluate()))
    if args.final_weights:
        np.savez(args.final_weights, **{n: p.numpy().astype(np.float32) for n, p in model.named_parameters()})
    return {"losses": losses, "evals": evals, "text": text.digests()}


def run_torch(args, data: Path, compiled: bool) -> dict:
    import torch

    import kiln
    from kiln.nn import GPT
    from tests.torch_gpt import torch_gpt_forward, torch_params
    cfg = model_config(args, data)
    model = GPT(cfg, generator=kiln.Generator(args.seed))
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    if dev == "cpu":
        torch.set_num_threads(1)  # as kiln's NumPy on a shared CPU: threads fighting over cores cost 3x here
    params = {k: v.detach().to(dev).requires_grad_(True) for k, v in torch_params(model, torch.float32).items()}
    torch.backends.cuda.matmul.allow_tf32 = args.mode == "tf32"
    torch.backends.cudnn.allow_tf32 = args.mode == "tf32"
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    fwd = torch.compile(torch_gpt_forward) if compiled else torch_gpt_forward
    plist = list(params.values())
    autocast = {"device_type": dev, "dtype": torch.bfloat16, "enabled": args.mode == "bf16"}

    def on_device(xy):
        return (torch.from_numpy(a).to(dev) for a in xy)

    def evaluate():
        with torch.no_grad(), torch.autocast(**autocast):
            out = [fwd(params, cfg, *on_device(xy))[1].item() for xy in text.val()]
        return float(np.mean(out))

    text = batches(args, data)
    losses, evals = [], []
    for i in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(args, i)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(**autocast):
            _, loss = fwd(params, cfg, *on_device(text.train(i)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, 1.0)
        opt.step()
        losses.append(loss.item())
        if (i + 1) % args.eval_interval == 0 or i + 1 == args.steps:
            evals.append((i + 1, evaluate()))
    return {"losses": losses, "evals": evals, "text": text.digests()}


def run_compare(args, data: Path) -> dict:
    """The precision logger at kiln's final weights: the first validation batch, op by op against PyTorch."""
    import kiln
    from kiln.nn import GPT
    from kiln.precision import Comparison, headline
    from kiln.train import apply_precision
    cfg = model_config(args, data)
    dev = kiln.device(args.device)
    model = GPT(cfg)
    model.to(dev)
    weights = np.load(args.final_weights)
    model.load_state_dict({k: weights[k] for k in weights.files})
    apply_precision(model, args.mode, dev, args.bf16_residual)
    x, y = batches(args, data).val()[0]
    cmp = Comparison(model, args.mode)
    cmp.step(x[:2], y[:2])
    js, md = cmp.write(args.compare_out)
    return {"headline": headline(cmp.summary()), "json": str(js), "markdown": str(md)}


def worker(args) -> dict:
    data = Path(args.data)
    t0 = time.time()
    if args.framework == "kiln":
        out = run_kiln(args, data)
    elif args.framework == "compare":
        return run_compare(args, data)
    else:
        out = run_torch(args, data, args.framework == "compile")
    out.update(framework=args.framework, mode=args.mode, wall_s=time.time() - t0)
    return out


def _spawn(args, data: Path, framework: str, mode: str, extra=()) -> dict:
    cmd = [sys.executable, __file__, "--framework", framework, "--mode", mode, "--data", str(data)]
    for flag in ("steps", "eval_interval", "eval_iters", "batch_size", "seq_len", "model", "n_layer", "n_head",
                 "n_embd", "lr", "warmup_fraction", "seed", "device", "bf16_residual"):
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if not args.cuda_graph:
        cmd.append("--no-cuda-graph")
    done = subprocess.run(cmd + list(extra), capture_output=True, text=True, check=False)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not line:
        print(f"{framework} {mode}: FAILED\n{done.stderr[-3000:]}", flush=True)
        return {"framework": framework, "mode": mode, "error": done.stderr[-3000:]}
    return json.loads(line[0][7:])


def check_same_text(rows) -> None:
    """A DataError unless every run was served the same training and validation tokens."""
    from kiln.errors import DataError
    for split in ("train", "val"):
        seen = {}
        for r in rows:
            if "error" not in r:
                seen.setdefault(r["text"][split], []).append(f"{r['framework']} {r['mode']}")
        if len(seen) > 1:
            raise DataError(f"the runs were served different {split} text (SHA-256 of their tokens: "
                            + "; ".join(f"{d[:12]} for {', '.join(who)}" for d, who in seen.items())
                            + "): their curves are not comparable")


def gaps(rows) -> dict:
    """Per mode, for each framework but eager: the largest |framework - eager| over the evaluations, its step,
    the median over the evaluations and the final gap; the mode's target and whether kiln met it."""
    by = {(r["framework"], r["mode"]): r for r in rows if "error" not in r}
    out = {}
    for (fw, mode), r in sorted(by.items(), key=lambda kv: FRAMEWORKS.index(kv[0][0])):
        ref = by.get(("eager", mode))
        if fw == "eager" or ref is None:
            continue
        d = [abs(a[1] - b[1]) for a, b in zip(r["evals"], ref["evals"])]
        g = out.setdefault(mode, {})
        g[f"{fw}_vs_eager"] = max(d)
        g[f"{fw}_vs_eager_at_step"] = r["evals"][int(np.argmax(d))][0]
        g[f"{fw}_vs_eager_median"] = float(np.median(d))
        g[f"{fw}_vs_eager_final"] = d[-1]
    for mode, g in out.items():
        if mode == "fp32":
            g["target"] = FP32_TARGET
        elif "compile_vs_eager" in g:
            g["target"] = g["compile_vs_eager"]
        if "target" in g and "kiln_vs_eager" in g:
            g["met"] = g["kiln_vs_eager"] <= g["target"]
    return out


def finish(base: dict, rows: list, compares: dict) -> dict:
    """The result record: the run's description, its rows, their gaps and the precision logger's findings."""
    check_same_text(rows)
    return {**base, "gaps": gaps(rows), "compare": compares, "rows": rows}


def merge(files) -> dict:
    """One record from the result files of one run split over calls (same commit, text, model, schedule)."""
    from kiln.errors import ConfigError
    records = [json.loads(Path(f).read_text()) for f in files]
    first = records[0]
    for f, r in zip(files[1:], records[1:]):
        for key in SAME_RUN:
            if r.get(key) != first.get(key):
                raise ConfigError(f"{f}: {key} = {json.dumps(r.get(key))[:200]}, but {files[0]} has "
                                  f"{json.dumps(first.get(key))[:200]}: --merge joins only calls of one run")
    rows, compares = [], {}
    for f, r in zip(files, records):
        for row in r["rows"]:
            if any((o["framework"], o["mode"]) == (row["framework"], row["mode"]) for o in rows):
                raise ConfigError(f"{f}: {row['framework']} {row['mode']} is in two of the merged files")
            rows.append(row)
        compares.update(r["compare"])
    rows.sort(key=lambda r: (MODES.index(r["mode"]), FRAMEWORKS.index(r["framework"])))
    base = {k: v for k, v in first.items() if k not in ("gaps", "compare", "rows")}
    base.update(date=max(r["date"] for r in records), command=" ".join(["python", *sys.argv]),
                merged=[{"file": str(f), "command": r["command"], "date": r["date"]} for f, r in zip(files, records)])
    return finish(base, rows, compares)


def plot(record: dict, path: Path) -> None:
    """Per mode: every framework's validation curve overlaid, and below it each one's gap from eager."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in record["rows"] if "error" not in r]
    modes = sorted({r["mode"] for r in rows}, key=MODES.index)
    if not modes:
        return
    fig, axes = plt.subplots(2, len(modes), figsize=(6.5 * len(modes), 6.4), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [2, 1]})
    styles = {"kiln": ("tab:red", "-"), "eager": ("tab:blue", "--"), "compile": ("tab:green", ":")}
    labels = {"kiln": "kiln", "eager": "PyTorch eager", "compile": "torch.compile"}
    for (top, bottom), mode in zip(axes.T, modes):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: FRAMEWORKS.index(r["framework"]))
        eager = next((r for r in mine if r["framework"] == "eager"), None)
        for r in mine:
            color, ls = styles[r["framework"]]
            s, v = zip(*r["evals"])
            top.plot(s, v, ls, color=color, marker="o", ms=3, label=labels[r["framework"]])
            if eager is not None and r is not eager:
                gap = [abs(a - b) for (_, a), (_, b) in zip(r["evals"], eager["evals"])]
                bottom.plot(s, gap, ls, color=color, marker="o", ms=3, label=f"|{labels[r['framework']]} - eager|")
        target = record["gaps"].get(mode, {}).get("target")
        if target is not None:
            bottom.axhline(target, color="black", lw=0.8, label=f"target {target:.1e}")
        top.set_title(f"GPT validation loss, {mode}")
        top.set_ylabel("validation loss (nats/token)")
        top.legend()
        bottom.set_yscale("symlog", linthresh=1e-5)  # a gap of exactly 0 (the first evaluations in fp32) shows
        bottom.set_ylim(bottom=0)
        bottom.set_xlabel("step")
        bottom.set_ylabel("gap from eager")
        if bottom.lines:
            bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sci(value) -> str:
    return "" if value is None else f"{value:.2e}"


def table(record: dict) -> str:
    """The Markdown report: what was run, then per mode and framework the final loss and the gaps."""
    meta, sched, (b, t) = record["data_meta"], record["schedule"], record["batch"]
    texts = {r["text"]["train"][:12] + " / " + r["text"]["val"][:12] for r in record["rows"] if "error" not in r}
    over = ", ".join(f"{k}={v}" for k, v in record["overrides"].items() if v is not None)
    lines = [f"GPT {record['model']}{f' ({over})' if over else ''}, B{b} T{t}, {record['steps']} steps, "
             f"seed {record['seed']}; "
             f"AdamW lr {sched['max_lr']:g}, linear warm-up {sched['warmup_steps']} steps, cosine to "
             f"{sched['min_lr']:g}. Training windows at seeded random offsets over "
             f"{meta['splits']['train']['tokens']:,} tokens; validation every {record['eval_interval']} steps on "
             f"{record['eval_iters'] * b} fixed windows spread over {meta['splits']['val']['tokens']:,} held-out "
             f"tokens; text served (SHA-256 train / val) {', '.join(sorted(texts))}.", "",
             "| mode | framework | final val loss | largest gap vs eager | at step | median gap | final gap "
             "| target | met |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['framework']} | failed | | | | | | |")
            continue
        m, fw = record["gaps"].get(r["mode"], {}), r["framework"]
        largest, at, median, final = (m.get(f"{fw}_vs_eager{k}") for k in ("", "_at_step", "_median", "_final"))
        cells = [f"{r['evals'][-1][1]:.4f}", _sci(largest), "" if at is None else str(at), _sci(median), _sci(final)]
        if fw == "kiln" and "target" in m:
            cells += [f"{m['target']:.2e}", str(m.get("met", ""))]
        else:
            cells += ["", ""]
        lines.append(f"| {r['mode']} | {fw} | " + " | ".join(cells) + " |")
    lines += ["", "Targets: fp32, the paper's 3e-3 at every evaluation (compile's row is the band: what two correct "
              "fp32 implementations differ by on this run); bf16, compile's own largest gap from eager."]
    return "\n".join(lines) + "\n"


def write(record: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    (out / f"{stem}.md").write_text(table(record))
    plot(record, out / f"{stem}.png")


def default_stem(args, date: str) -> str:
    """fidelity-<date>-<steps>steps[-<modes>][-<frameworks>], the last two only when not all of them."""
    parts = [f"fidelity-{date}-{args.steps}steps"]
    if args.modes != "fp32,bf16":
        parts.append(args.modes.replace(",", "-"))
    if args.frameworks != ",".join(FRAMEWORKS):
        parts.append(args.frameworks.replace(",", "-"))
    return "-".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="fp32,bf16")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help="which to run in each mode (default all: eager is every gap's reference)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-interval", type=int, default=100)
    ap.add_argument("--eval-iters", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--model", default="gpt2-124m", help="kiln model preset (default gpt2-124m)")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    ap.add_argument("--warmup-fraction", type=float, default=0.1,
                    help="the share of --steps spent in linear warm-up (default 0.1)")
    ap.add_argument("--seed", type=int, default=1234, help="the initial weights' and the training windows' seed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bf16-residual", choices=("fp32", "bf16"), default="fp32",
                    help="kiln's residual stream in bf16 mode: fp32 as autocast (default) or bf16")
    ap.add_argument("--data", help="a `kiln prepare` folder (default: the Python sources, prepared into --corpus-dir)")
    ap.add_argument("--corpus-dir", help="where the Python sources are prepared (default: a temporary folder "
                                         "named after --site-packages, --max-files and --vocab-size)")
    ap.add_argument("--vocab-size", type=int, default=50257, help="ids of the BPE trained on the sources")
    ap.add_argument("--site-packages", action="store_true", help="add site-packages' sources to the corpus")
    ap.add_argument("--max-files", type=int, help="prepare only the first N source files (a quick corpus)")
    ap.add_argument("--compare", choices=("gap", "always", "never"), default="gap",
                    help="run the precision logger at kiln's final weights when the target is missed (default), "
                         "always, or never")
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join the result files of one run split over calls "
                                                               "into one record, table and plot (trains nothing)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fidelity"))
    ap.add_argument("--name", default=None, help="result file stem (default fidelity-<date>-<steps>steps, "
                                                 "then the modes and frameworks when not all)")
    ap.add_argument("--framework", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--final-weights", help=argparse.SUPPRESS)
    ap.add_argument("--compare-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    check_args(args)
    if args.framework:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out)
    if args.merge:
        record = merge(args.merge)
        write(record, out, args.name or f"fidelity-{record['date']}-{record['steps']}steps")
        print(table(record))
        return
    data = corpus(args)
    stem = args.name or default_stem(args, date)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-fidelity-"))
    import torch
    gpu = gpu_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    base = {"benchmark": "fidelity", "date": date, "commit": commit(), "command": " ".join(["python", *sys.argv]),
            "device": gpu, "torch": torch.__version__, "python": platform.python_version(), "data": str(data),
            "data_meta": json.loads((data / "meta.json").read_text()), "batch": [args.batch_size, args.seq_len],
            "model": args.model, "overrides": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd},
            "steps": args.steps, "eval_interval": args.eval_interval, "eval_iters": args.eval_iters,
            "seed": args.seed, "lr": args.lr, "bf16_residual": args.bf16_residual,
            "schedule": {"shape": "linear warm-up, then cosine decay to a tenth", "max_lr": args.lr,
                         "min_lr": args.lr / 10, "warmup_steps": warmup_steps(args), "total_steps": args.steps}}
    rows, compares = [], {}
    for mode in args.modes.split(","):
        for fw in args.frameworks.split(","):
            extra = ["--final-weights", str(tmp / f"kiln-{mode}.npz")] if fw == "kiln" else []
            r = _spawn(args, data, fw, mode, extra)
            rows.append(r)
            if "error" not in r:
                print(f"{fw:8} {mode:5} train loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, val "
                      f"{r['evals'][-1][1]:.4f} ({r['wall_s']:.0f} s)", flush=True)
            write(finish(base, rows, compares), out, stem)  # a call cut short keeps the runs that finished
    for mode, v in gaps(rows).items():
        if args.compare == "always" or (args.compare == "gap" and v.get("met") is False):
            c = _spawn(args, data, "compare", mode, ["--final-weights", str(tmp / f"kiln-{mode}.npz"),
                                                     "--compare-out", str(out / f"{stem}-{mode}-compare")])
            compares[mode] = c
            print(f"precision logger, {mode}, at kiln's final weights:\n{c.get('headline', c.get('error'))}")
    record = finish(base, rows, compares)
    write(record, out, stem)
    print(table(record))


def check_args(args) -> None:
    """A ConfigError naming the first option outside what the benchmark allows."""
    from kiln.errors import ConfigError
    for flag, allowed in (("modes", MODES), ("frameworks", FRAMEWORKS)):
        for name in getattr(args, flag).split(","):
            if name not in allowed:
                raise ConfigError(f"--{flag} names {name!r}: allowed are {', '.join(allowed)}")
    if not 0 <= args.warmup_fraction < 1:
        raise ConfigError(f"--warmup-fraction {args.warmup_fraction}: allowed is 0 <= fraction < 1")


if __name__ == "__main__":
    main()
