"""`kiln`: the command line. `kiln train` trains, `kiln sample` generates, `kiln prepare` makes shards.

Bad input ends with the KilnError's message on stderr and exit status 2, with no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kiln.errors import ConfigError, KilnError


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
    from kiln.train import TrainConfig, Trainer
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    cfg = TrainConfig(**given, model_overrides=_parse_overrides(args.set))
    trainer = Trainer(cfg)
    print(f"kiln: training {cfg.model} ({trainer.model.num_parameters() / 1e6:.2f}M parameters) on "
          f"{trainer.device}, data {trainer.data_dir}, {cfg.max_steps} steps of "
          f"{cfg.batch_size}x{trainer.seq_len} tokens", flush=True)
    s = trainer.fit()
    print(f"validation loss {s['final_val_loss']:.4f} nats/token; unigram entropy of the training "
          f"data {s['unigram_entropy']:.4f} nats/token")
    print(f"throughput {s['tokens_per_s']:.0f} tokens/s, {s['elapsed_s']:.1f} s; run folder {s['run_dir']}")
    print("sample:\n" + s["sample"])
    return 0


def _sample(args) -> int:
    import numpy as np

    import kiln
    from kiln.train import load_run
    model, tok, _ = load_run(args.run_dir)
    ids = tok.encode(args.prompt) or [0]
    out = model.generate(kiln.tensor([ids]), args.tokens, temperature=args.temperature,
                         top_k=args.top_k, generator=np.random.default_rng(args.seed),
                         vocab_limit=tok.vocab_size)
    print(tok.decode(out.numpy()[0].tolist()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="Train GPT models with kiln.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a GPT (default: the tiny preset on the bundled corpus)")
    t.add_argument("--config", dest="model", help="model preset: tiny, gpt2-124m, gpt2-2.4b")
    t.add_argument("--data", help="a folder made by `kiln prepare` (default: the bundled corpus)")
    t.add_argument("--device", help="cpu, cuda, cuda:N or auto (default)")
    t.add_argument("--precision", help="fp32 (default), tf32 (GPU), bf16 or fp64")
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
                   help="profile steps 3-5: a Chrome trace (trace.json) and a table of kernels")
    t.set_defaults(run=_train)

    s = sub.add_parser("sample", help="generate text from a trained run")
    s.add_argument("run_dir")
    s.add_argument("--prompt", default="\n")
    s.add_argument("--tokens", type=int, default=200)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=_sample)

    from kiln.data.prepare import add_prepare_arguments, run_prepare
    pr = sub.add_parser("prepare", help="turn text into token shards")
    add_prepare_arguments(pr)
    pr.set_defaults(run=run_prepare)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
