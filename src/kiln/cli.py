"""`kiln`: the command line. `kiln train` trains (`--resume RUN` continues one), `kiln sample`
generates, `kiln prepare` makes shards, `kiln compare` finds where kiln and PyTorch part, `kiln export` / `kiln
import` convert to / from Hugging Face, `kiln launch` starts and supervises ranks of a command.

Bad input ends with the KilnError's message on stderr and exit status 2, with no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from kiln.errors import ConfigError, DataError, KilnError


def _parse_overrides(items) -> dict:
    """--set n_layer=6 --set dropout=0.1 -> {"n_layer": 6, "dropout": 0.1}"""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def _train(args) -> int:
    from kiln.launch.rank import launched_run_dir
    from kiln.train import TrainConfig, Trainer
    from kiln.train.config import RESUME_OVERRIDES
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    launched = launched_run_dir()
    if launched is not None and not args.resume and any((launched / "checkpoints").glob("ckpt-*.kiln")):
        # a restarted attempt of `kiln launch`: the same command continues from the newest good checkpoint
        trainer = Trainer.from_checkpoint(launched, **{k: v for k, v in given.items() if k in RESUME_OVERRIDES})
        cfg = trainer.config
        print(f"kiln: attempt {trainer.launch.attempt}: resuming {launched} at step {trainer.step} "
              f"from {trainer.resumed_from}", flush=True)
    elif args.resume:
        if args.set:
            raise ConfigError(f"--set {args.set[0]}: a resumed run keeps its checkpoint's model")
        trainer = Trainer.from_checkpoint(args.resume, **given)
        cfg = trainer.config
        print(f"kiln: resuming {args.resume} at step {trainer.step} from {trainer.resumed_from}", flush=True)
    else:
        cfg = TrainConfig(**given, model_overrides=_parse_overrides(args.set))
        trainer = Trainer(cfg)
    if trainer.rank != 0:  # rank 0 alone reports and writes
        s = trainer.fit()
        return {"SIGINT": 130, "SIGTERM": 143}.get(s.get("interrupted"), 0)
    ranks = f" x {trainer.world_size} ranks ({cfg.parallel})" if trainer.world_size > 1 else ""
    if trainer.mesh is not None:
        ranks = f" x {trainer.world_size} ranks (dp {trainer.replicas} x tp {cfg.tp} x cp {cfg.cp}, {cfg.parallel})"
    parameters = sum(math.prod(s) for s in trainer.model_config.parameter_shapes().values())
    print(f"kiln: training {cfg.model} ({parameters / 1e6:.2f}M parameters) on "
          f"{trainer.device}, data {trainer.data_dir}, {cfg.max_steps} steps of "
          f"{cfg.batch_size}x{trainer.seq_len} tokens x {trainer.grad_accum} micro-steps{ranks}", flush=True)
    print(f"kiln: {trainer.describe_vocabulary()}", flush=True)
    print(f"kiln: recipe of {cfg.model} (flags override it): {cfg.describe_recipe()}", flush=True)
    try:
        s = trainer.fit()
    except KeyboardInterrupt:  # a second Ctrl-C: the step in flight was not saved
        print(f"kiln: interrupted at step {trainer.step}; {_what_was_saved(trainer)}", file=sys.stderr)
        return 130
    if s.get("interrupted"):
        saved = f"saved {s['checkpoint']}; continue with `kiln train --resume {s['run_dir']}`" \
            if s["checkpoint"] else "no step had finished, nothing to save"
        print(f"kiln: stopped by {s['interrupted']} after step {s['steps']}; {saved}", file=sys.stderr)
        return 130 if s["interrupted"] == "SIGINT" else 143
    print(f"validation loss {s['final_val_loss']:.4f} nats/token over {s['val_tokens']:,} held-out tokens; "
          f"unigram entropy of the training "
          f"data {s['unigram_entropy']:.4f} nats/token")
    print(f"throughput {s['tokens_per_s']:.0f} tokens/s, {s['elapsed_s']:.1f} s; run folder {s['run_dir']}")
    print("sample:\n" + s["sample"] if trainer.tokenizer else
          "no sample: the data has no tokenizer (give one with --tokenizer)")
    return 0


def _what_was_saved(trainer) -> str:
    """Where an interrupted run can continue from: its newest checkpoint on disk, or nothing."""
    from kiln.checkpoint import CheckpointFolder
    pointer = CheckpointFolder(trainer.run_dir / "checkpoints").pointer() if trainer.run_dir else None
    if not pointer:
        return f"nothing was saved: {trainer.step} step{'s' * (trainer.step != 1)} lost"
    lost = trainer.step - pointer["step"]
    return (f"the newest checkpoint is step {pointer['step']} ({lost} step{'s' * (lost != 1)} lost); "
            f"continue with `kiln train --resume {trainer.run_dir}`")


def _launch(args) -> int:
    import os
    import time
    from pathlib import Path

    from kiln.launch import LaunchConfig, Supervisor
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command[:1] == ["kiln"]:  # this interpreter's kiln, installed as a console script or not
        command = [sys.executable, "-m", "kiln.cli", *command[1:]]
    run_dir = Path(args.run_dir or os.path.join("runs", f"launch-{time.strftime('%Y%m%d-%H%M%S')}"))
    config = LaunchConfig(command=command, run_dir=run_dir, nproc=args.nproc, nnodes=args.nnodes,
                          node_rank=args.node_rank, master=args.master, max_restarts=args.max_restarts,
                          bad_step=args.on_bad_step, spike_z=args.spike_z, spike_window=args.spike_window,
                          spike_min_history=args.spike_min_history, spike_ratio=args.spike_ratio,
                          hang_factor=args.hang_factor, hang_min_s=args.hang_timeout_min,
                          startup_timeout_s=args.startup_timeout, prometheus_port=args.prometheus_port,
                          mpi=args.mpi)
    return Supervisor(config).run()


def _sample(args) -> int:
    import numpy as np

    import kiln
    from kiln.checkpoint.run_folder import load_run
    model, tok, _ = load_run(args.run_dir)
    if tok is None:
        raise DataError(f"{args.run_dir}: holds no tokenizer (it was imported from a folder without one), so "
                        "prompts cannot become tokens; copy the model's tokenizer.json into it")
    ids = tok.encode(args.prompt) or [0]
    out = model.generate(kiln.tensor([ids]), args.tokens, temperature=args.temperature,
                         top_k=args.top_k, generator=np.random.default_rng(args.seed),
                         vocab_limit=tok.vocab_size)
    print(tok.decode(out.numpy()[0].tolist()))
    return 0


def _export(args) -> int:
    from kiln.checkpoint import export_hf
    from kiln.checkpoint.run_folder import load_run
    if args.format != "hf":
        raise ConfigError(f"--format {args.format!r}: allowed: hf")
    model, _, _ = load_run(args.run_dir)
    out = export_hf(model, args.out, vocab_size=args.vocab_size, tokenizer_dir=args.run_dir,
                    overwrite=args.overwrite)
    print(f"kiln: wrote a Hugging Face GPT2LMHeadModel to {out} (vocab_size "
          f"{args.vocab_size or model.config.vocab_size})")
    return 0


def _import(args) -> int:
    import json

    from kiln.checkpoint.hf import HF_CONFIG, carried_dropout, import_hf_run
    run = import_hf_run(args.hf_dir, args.out, pad_vocab_to=args.pad_vocab)
    print(f"kiln: imported {args.hf_dir} into {run}; fine-tune it with "
          f"`kiln train --init-from {run} --data ...`")
    print(f"kiln: {carried_dropout(json.loads((Path(args.hf_dir) / HF_CONFIG).read_text()))}")
    return 0


def _prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kiln prepare`."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files (one document each), folders of them, or JSONL files (one per record)")
    parser.add_argument("--out", required=True, help="folder for the shards, the tokenizer and meta.json")
    parser.add_argument("--tokenizer", default="bpe",
                        help="'bpe' (train one, needs --vocab-size), 'bytes', or a tokenizer.json, tiktoken "
                             "file or saved tokenizer folder (default: bpe)")
    parser.add_argument("--vocab-size", type=int, help="ids of the BPE to train, e.g. 8192")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="share of tokens for validation (default: 0.1)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000,
                        help="tokens per shard (default: 100000000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="encoding processes (default: one per core)")
    parser.add_argument("--text-field", default="text", help="the JSONL field that holds the text (default: text)")
    parser.add_argument("--overwrite", action="store_true", help="replace data an earlier run left in --out")
    parser.add_argument("--glob", metavar="PATTERN",
                        help="take only the files of input folders that match, e.g. '*.py' (hidden and cache "
                             "folders and binary files are always skipped)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _prepare(args: argparse.Namespace) -> int:
    """`kiln prepare`: run `prepare` with parsed arguments and print what was written."""
    from kiln.data.prepare import SPLITS, prepare
    done = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, workers=args.workers,
                   text_field=args.text_field, progress=not args.no_progress, overwrite=args.overwrite,
                   pattern=args.glob)
    print(f"{done.out_dir}: {done.documents} documents, tokenizer {done.tokenizer}, "
          f"vocab {done.vocab_size} (model: {done.padded_vocab_size})")
    if any(done.skipped.values()):
        print("  skipped " + ", ".join(f"{n} {what}" for what, n in done.skipped.items() if n))
    for split in SPLITS:
        print(f"  {split}: {done.tokens[split]:,} tokens in {len(done.shards[split])} shards")
    return 0


def _compare(args) -> int:
    import numpy as np

    import kiln
    from kiln.nn import GPT, preset
    from kiln.optim import AdamW, gpt_param_groups
    from kiln.precision import Comparison, headline
    from kiln.train import apply_precision, load_pretrained, resolve_device
    if args.steps < 1 or args.batch_size < 1:
        raise ConfigError(f"--steps and --batch-size must be positive, got {args.steps} and {args.batch_size}")
    device = resolve_device(args.device)
    pretrained = load_pretrained(args.init_from) if args.init_from else None
    overrides = _parse_overrides(args.set)
    if pretrained is not None:
        overrides = {**dataclasses.asdict(pretrained.config), **overrides}
    cfg = preset(args.config, **overrides)
    seq_len = args.seq_len or cfg.block_size
    kiln.manual_seed(args.seed)
    model = GPT(cfg, generator=kiln.Generator(args.seed))
    model.to(device, dtype="float64" if args.precision == "fp64" else "float32")
    if pretrained is not None:
        model.load_state_dict(pretrained.state_dict())
    apply_precision(model, args.precision, device)
    if args.data:
        from kiln.data.loader import ShardLoader
        loader = ShardLoader(args.data, "train", batch_size=args.batch_size, seq_len=seq_len, seed=args.seed)
        batches = [tuple(np.asarray(a) for a in loader.next_batch()) for _ in range(args.steps)]
    else:  # random tokens: the comparison is about arithmetic, not about what the text says
        rng = np.random.default_rng(args.seed)
        batches = [tuple(rng.integers(0, cfg.vocab_size, (args.batch_size, seq_len)) for _ in range(2))
                   for _ in range(args.steps)]
    opt = AdamW(gpt_param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8) if args.steps > 1 else None
    cmp = Comparison(model, args.precision, names=args.ops, optimizer=opt, grad_clip=1.0 if opt else 0.0,
                     dump_dir=f"{args.out}/dump" if args.dump else None, tolerance=args.tolerance)
    for x, y in batches:
        cmp.step(x, y, update=opt is not None)
    js, md = cmp.write(args.out)
    print(headline(cmp.summary()))
    print(f"kiln: wrote {js} and {md}")
    return 1 if cmp.summary()["first_divergence"] else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Train GPT models with kiln.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a GPT (default: the tiny preset on the bundled corpus)")
    t.add_argument("--config", dest="model", help="model preset: tiny, gpt2-124m, gpt2-2.4b")
    t.add_argument("--data", help="a folder made by `kiln prepare` (default: the bundled corpus)")
    t.add_argument("--vocab-size", type=int, help="the data's vocabulary (token ids 0..N-1), for shards "
                   "without kiln's meta.json, e.g. llm.c's: 50257 (default: meta.json's)")
    t.add_argument("--tokenizer", help="a tokenizer.json, tiktoken file or saved tokenizer folder for shards "
                   "without one (its size is the vocabulary unless --vocab-size says)")
    t.add_argument("--device", help="cpu, cuda, cuda:N or auto (default)")
    t.add_argument("--precision", help="fp32 (default), tf32 (GPU), bf16 or fp64")
    t.add_argument("--bf16-residual", choices=("fp32", "bf16"),
                   help="bf16: the residual stream and LayerNorms in fp32 as torch.autocast (default: its loss curve "
                        "is PyTorch's), or in bf16 (fewer bytes, a curve further from PyTorch's)")
    t.add_argument("--steps", dest="max_steps", type=int)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--seq-len", type=int)
    t.add_argument("--grad-accum", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--min-lr", type=float)
    t.add_argument("--warmup-steps", type=int)
    t.add_argument("--eval-interval", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--out", dest="out_dir", help="where run folders go (default: runs)")
    t.add_argument("--name", dest="run_name", help="the run folder's name")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model setting")
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    t.add_argument("--profile", action="store_true", default=None,
                   help="steps 3-6 op by op, the last two under the profiler: run/profile/ gets the Chrome "
                        "trace (trace.json, Perfetto), the kernel table with TFLOP/s, GB/s and fractions of the "
                        "device's measured ceilings, the allocation timeline and memory plot, a one-page "
                        "report.html/.png, and the profiler's overhead (overhead.json)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its newest good checkpoint")
    t.add_argument("--checkpoint-interval", type=int, help="checkpoint every N steps (default 0: at the end)")
    t.add_argument("--keep-checkpoints", type=int, help="keep the newest K checkpoints (default 3)")
    t.add_argument("--sync-checkpoint", dest="async_checkpoint", action="store_false", default=None,
                   help="write checkpoints in the training thread, not in the background")
    t.add_argument("--init-from", help="start from the weights of a kiln run or a Hugging Face GPT-2 folder")
    t.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false", default=None,
                   help="on CUDA, run every step op by op (default: from the third step on, each step is "
                        "replayed as one captured CUDA graph)")
    t.add_argument("--parallel", help="none (default), ddp, zero1, zero2 or fsdp: data parallel over the ranks "
                   "of `mpiexec -n N`, torchrun, SLURM or kiln launch (CPU: MPI, GPUs: NCCL); zero1/zero2 shard the "
                   "optimizer state (and gradients), fsdp the parameters too (with --tp/--cp: over the ranks holding the same "
                   "shards); a zero/fsdp run's checkpoints are one file per rank and resume on any number of ranks "
                   "(with --tp/--cp: the dense model, in one file)")
    t.add_argument("--global-batch", type=int,
                   help="tokens per optimizer step; sets grad_accum = global / (batch x seq_len x ranks)")
    t.add_argument("--bucket-mb", type=float, help="ddp: gradient bucket size in MB (default 25)")
    t.add_argument("--tp", type=int, help="tensor parallelism: each model replica's heads, MLP and vocabulary split "
                   "over N ranks (default 1); the ranks left over train data parallel with --parallel ddp, zero1, zero2 "
                   "or fsdp")
    t.add_argument("--cp", type=int, help="context parallelism: each sequence split over N ranks, zigzag-balanced "
                   "(default 1); seq_len must be a multiple of 2N")
    t.add_argument("--cp-transport", help="how keys and values reach the other cp ranks: p2p (ring attention, "
                   "default), all_gather or all_to_all (Ulysses: heads / tp must be a multiple of cp)")
    t.add_argument("--tp-chunks", type=int, help="async TP: each row-parallel all-reduce in N chunks that overlap "
                   "the next chunk's GEMM (default 1)")
    t.add_argument("--adamw-in-backward", action="store_true", default=None,
                   help="update each parameter inside backward as its gradient is final and keep no gradients "
                        "(12 bytes a parameter, not 16: the largest model; a clip costs a second backward); "
                        "one micro-batch a step, one device")
    t.add_argument("--adamw-clip-via",  # its values are checked where they are defined (TrainConfig.validate)
                   help="with --adamw-in-backward, how the exact clip gets each gradient again once the norm is "
                        "known: recompute (a second backward; default) or host (each gradient parked in pinned "
                        "host memory: one backward, the gradients' bytes over PCIe both ways)")
    t.add_argument("--recompute-blocks", type=int, help="the first N blocks keep only their inputs and run their "
                   "forward again in backward (activation memory for one more forward of those blocks)")
    t.add_argument("--recompute-norm-gelu", action="store_true", default=None,
                   help="backward makes each block's LayerNorm and GELU outputs again from what it keeps anyway "
                        "(10 of a block's 16 saved activations, a few row passes more)")
    t.set_defaults(run=_train)

    la = sub.add_parser("launch", help="start N ranks of a command and supervise them: restart the gang "
                                       "from the newest good checkpoint on a failure (-- kiln train ...)")
    la.add_argument("--nproc", type=int, default=1, help="ranks on this node (default 1)")
    la.add_argument("--nnodes", type=int, default=1,
                    help="nodes of the gang, each with its own kiln launch (default 1); they restart together, "
                         "so their --run-dir must be one shared folder")
    la.add_argument("--node-rank", type=int, default=0, help="this node's place, 0..nnodes-1 (node 0 serves the store)")
    la.add_argument("--master", help="HOST:PORT of node 0's store (default: a free local port)")
    la.add_argument("--max-restarts", type=int, default=3, help="restarts of the gang before giving up (default 3)")
    la.add_argument("--run-dir", help="the run folder, kept across restarts (default runs/launch-<time>): "
                                      "logs/rank-R.log, incidents.jsonl, health.jsonl, the trainer's files")
    la.add_argument("--on-bad-step", default="restart",
                    help="a NaN/Inf or spiking step: restart (the gang, default), skip (undo its update in "
                         "place) or rollback (to the newest checkpoint in place)")
    la.add_argument("--spike-z", type=float, default=6.0,
                    help="a loss or gradient norm this many standard deviations above its rolling mean is a "
                         "spike (default 6; 0 turns spike detection off)")
    la.add_argument("--spike-ratio", type=float, default=2.0,
                    help="... and at least this many times the rolling mean (default 2)")
    la.add_argument("--spike-window", type=int, default=100, help="steps in the rolling window (default 100)")
    la.add_argument("--spike-min-history", type=int, default=10,
                    help="steps in the window before spikes are looked for (default 10)")
    la.add_argument("--hang-factor", type=float, default=20.0,
                    help="a rank is hung after this many median step times without progress (default 20)")
    la.add_argument("--hang-timeout-min", type=float, default=60.0, help="... and at least this many seconds")
    la.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds allowed before the first step and around evals and checkpoints")
    la.add_argument("--mpi", action="store_true",
                    help="start the ranks with mpiexec (the MPI backend's CPU ranks; one node)")
    la.add_argument("--prometheus-port", type=int, help="serve Prometheus metrics on this port (off by default)")
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- the command of each rank")
    la.set_defaults(run=_launch)

    s = sub.add_parser("sample", help="generate text from a trained run")
    s.add_argument("run_dir")
    s.add_argument("--prompt", default="\n")
    s.add_argument("--tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=_sample)

    c = sub.add_parser("compare", help="run a GPT step (or N training steps) in kiln and in PyTorch and report, "
                                       "op by op, where they first part (the precision logger); exit status 1 "
                                       "when they part beyond the tolerance")
    c.add_argument("--config", default="tiny", help="model preset: tiny (default), gpt2-124m, gpt2-2.4b")
    c.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model setting")
    c.add_argument("--init-from", help="the weights of a kiln run or a Hugging Face GPT-2 folder")
    c.add_argument("--precision", default="fp32", help="fp64, fp32 (default), tf32 (GPU) or bf16")
    c.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    c.add_argument("--data", help="batches from this `kiln prepare` folder (default: random tokens)")
    c.add_argument("--batch-size", type=int, default=4)
    c.add_argument("--seq-len", type=int, default=None, help="default: the model's context")
    c.add_argument("--steps", type=int, default=1, help="N > 1: N AdamW steps on both sides, a trajectory")
    c.add_argument("--lr", type=float, default=6e-4)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--ops", nargs="+", metavar="PATTERN", help="record only these ops, e.g. 'h.3.*' ln_f loss")
    c.add_argument("--tolerance", type=float, default=None,
                   help="relative error that counts as a divergence (default per precision: fp64 1e-10, fp32 1e-4, "
                        "tf32 2e-2, bf16 5e-2)")
    c.add_argument("--dump", action="store_true", help="also save every recorded tensor (dump/stepN.npz)")
    c.add_argument("--out", default="compare", help="where compare.json and compare.md go (default: compare)")
    c.set_defaults(run=_compare)


    pr = sub.add_parser("prepare", help="turn text into token shards")
    _prepare_arguments(pr)
    pr.set_defaults(run=_prepare)

    e = sub.add_parser("export", help="write a run's model in another framework's format")
    e.add_argument("run_dir")
    e.add_argument("--format", default="hf", help="hf: a Hugging Face GPT2LMHeadModel folder (default)")
    e.add_argument("out", help="the folder to write")
    e.add_argument("--vocab-size", type=int, default=None,
                   help="slice the (padded) vocabulary to N rows, e.g. 50257 (default: keep it)")
    e.add_argument("--overwrite", action="store_true", help="write into a folder that holds files already")
    e.set_defaults(run=_export)

    i = sub.add_parser("import", help="make a kiln run folder from a Hugging Face GPT-2 folder")
    i.add_argument("hf_dir")
    i.add_argument("--out", required=True, help="the run folder to write")
    i.add_argument("--pad-vocab", type=int, default=None, metavar="M",
                   help="pad the vocabulary with zero rows to a multiple of M (e.g. 64: 50257 -> 50304)")
    i.set_defaults(run=_import)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        if "kiln.distributed" in sys.modules:  # the other ranks must not wait for this one
            sys.modules["kiln.distributed"].abort_job(f"{type(e).__name__} on rank {sys.modules['kiln.distributed'].get_rank()}")
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
