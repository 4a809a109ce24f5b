"""A run folder, written one way (by the Trainer and by `kiln import`) and read one way:

    runs/r/config.json            {"train": TrainConfig or null, "model": GPTConfig, ..., "kiln": version}
    runs/r/model.safetensors      the final weights (an interrupted run has only checkpoints)
    runs/r/metrics.jsonl          one JSON row per step; loss.png plots it
    runs/r/tokenizer.json ...     the tokenizer (kiln.data.tokenizer), sample.txt, summary.json
    runs/r/checkpoints/ckpt-00000200.kiln
    runs/r/checkpoints/ckpt-00000300.kiln
    runs/r/checkpoints/latest.json        {"file": "ckpt-00000300.kiln", "step": 300, ...}

`CheckpointFolder` keeps the last K checkpoints with `latest.json` naming the newest good one;
resume falls back to the previous good file when the newest is corrupt. The pointer moves only
after a file is completely written, fsync'd and renamed, and older files are pruned only after
that, so the previous good checkpoint is never lost (even with K = 1, the old file goes only
once the new one is in place). `load_run` and `load_pretrained` read a run folder back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kiln.checkpoint.format import SUFFIX, CheckpointError, atomic_file, load
from kiln.checkpoint.sharded import read_full, verify_shards
from kiln.errors import DataError
from kiln.nn import GPT, GPTConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
CHECKPOINTS = "checkpoints"
POINTER = "latest.json"
DIGEST_KEY = "kiln.sha256"  # model.safetensors' metadata: sha256 of its tensors
_NAME = re.compile(r"^ckpt-(\d{8,})" + re.escape(SUFFIX) + "$")


class CheckpointFolder:
    """The checkpoints of one run, in `folder` (created on first save)."""

    def __init__(self, folder, keep: int = 3):
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise CheckpointError(f"keep_checkpoints must be an integer >= 1, got {keep!r}")
        self.folder = Path(folder)
        self.keep = keep
        self._lock = threading.Lock()

    def path_for(self, step: int) -> Path:
        return self.folder / f"ckpt-{step:08d}{SUFFIX}"

    def prepare(self) -> None:
        """Create the folder and remove temporary files that a crashed save left behind."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob(".*.tmp-*"):  # atomic_file's: checkpoints and latest.json
            tmp.unlink(missing_ok=True)

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file here, oldest first."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]
        return sorted(found)

    def pointer(self) -> dict | None:
        """latest.json's content, or None when there is none (or it is unreadable)."""
        try:
            return json.loads((self.folder / POINTER).read_text())
        except (OSError, ValueError):
            return None

    def commit(self, result: dict) -> None:
        """After `save` wrote result["path"] completely: point latest.json at it, then prune."""
        path = Path(result["path"])
        m = _NAME.match(path.name)
        if path.parent != self.folder or not m:
            raise CheckpointError(f"{path} is not a checkpoint of {self.folder}")
        with self._lock:
            with atomic_file(self.folder / POINTER) as f:
                f.write(json.dumps({"file": path.name, "step": int(m.group(1)),
                                    "checksum": result.get("checksum"), "bytes": result.get("bytes")},
                                   indent=1).encode())
            self.prune(protect=path)

    def prune(self, protect: Path | None = None) -> None:
        """Delete all but the newest `keep` checkpoints (never `protect`, never the pointer's)."""
        pointed = (self.pointer() or {}).get("file")
        files = self.checkpoints()
        for _, p in files[:max(0, len(files) - self.keep)]:
            if p != protect and p.name != pointed:
                p.unlink(missing_ok=True)
                for shard in self.folder.glob(p.name[:-len(SUFFIX)] + ".shard-*" + SUFFIX):
                    shard.unlink(missing_ok=True)  # a sharded checkpoint's files (kiln.distributed)

    def candidates(self) -> list[Path]:
        """Checkpoints to resume from, best first: the pointer's, then the others newest first."""
        files = [p for _, p in reversed(self.checkpoints())]
        pointed = (self.pointer() or {}).get("file")
        first = [p for p in files if p.name == pointed]
        return first + [p for p in files if p.name != pointed]

    def load_latest(self, report=None) -> tuple[dict, Path]:
        """(state, path) of the newest checkpoint that loads and verifies. Each corrupt one is
        reported (report(message), default: stderr) and skipped; none good is a CheckpointError."""
        report = report or (lambda msg: print(f"kiln: warning: {msg}", file=sys.stderr, flush=True))
        failures = []
        for path in self.candidates():
            try:
                state = load(path)
                if "sharded" in state:  # a manifest: good only with every shard it names
                    verify_shards(path, state)
            except Exception as e:  # any failure to load one file means that file is bad: fall back
                why = str(e) if isinstance(e, CheckpointError) else f"{path} cannot be loaded: {e!r}"
                failures.append(f"{path.name}: {why}")
                report(f"{why}; trying the previous checkpoint")
                continue
            if failures:
                report(f"resuming from {path}, the newest good checkpoint")
            return state, path
        if not failures:
            raise CheckpointError(f"{self.folder} holds no checkpoints (ckpt-NNNNNNNN{SUFFIX}); "
                                  "nothing to resume from")
        raise CheckpointError(f"no good checkpoint in {self.folder}: " + "; ".join(failures))


def new_run_dir(out_dir, name: str | None, model: str) -> Path:
    """A new, empty run folder out_dir/name (default: the model and the time); -2, -3, ... when taken."""
    name = name or f"{model}-{time.strftime('%Y%m%d-%H%M%S')}"
    run = Path(out_dir) / name
    n = 1
    while run.exists():
        n += 1
        run = Path(out_dir) / f"{name}-{n}"
    run.mkdir(parents=True)
    return run


def write_config(run: Path, model_config, train: dict | None, **extra) -> None:
    """config.json: the model's GPTConfig, the TrainConfig as a dict (None for an imported model),
    any further facts (data, device, imported_from) and kiln's version."""
    import kiln
    with atomic_file(Path(run) / CONFIG) as f:
        f.write(json.dumps({"train": train, "model": dataclasses.asdict(model_config), **extra,
                            "kiln": kiln.__version__}, indent=2).encode())


def save_weights(path: Path, model) -> None:
    """The model's parameters as one safetensors file (what load_run and `kiln export` read), with a
    sha256 of them in its metadata that load_weights verifies, as checkpoints verify theirs."""
    from safetensors.numpy import save as st_save
    tensors = {name: np.ascontiguousarray(p.numpy()) for name, p in model.named_parameters()}
    with atomic_file(Path(path)) as f:
        f.write(st_save(tensors, metadata={"format": "pt", DIGEST_KEY: weights_digest(tensors)}))


def weights_digest(tensors: dict) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape};".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def weight_shapes(path) -> tuple[dict, dict]:
    """({name: shape}, metadata) from a safetensors file's header; nothing else is read."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "numpy") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from None


def check_shapes(found: dict, expected: dict, what: str) -> None:
    """A CheckpointError naming the first missing, extra or misshapen tensor of `found`."""
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{what}: the weights do not fit the model's config: "
                              f"missing {missing[:4]}, unexpected {extra[:4]}")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise CheckpointError(f"{what}: {name} has shape {tuple(found[name])} in the file; the config "
                                  f"needs {tuple(shape)}")


def load_weights(path, expected: dict | None = None) -> dict:
    """{name: array} of a file written by `save_weights`, its shapes checked against `expected`
    ({name: shape}) before it is read and its digest verified after (a file without a digest,
    from an older kiln or another tool, is read as it is)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    shapes, meta = weight_shapes(path)
    if expected is not None:
        check_shapes(shapes, expected, str(path))
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from None
    stored = meta.get(DIGEST_KEY)
    if stored is not None and weights_digest(tensors) != stored:
        raise CheckpointError(f"{path}: checksum mismatch: the weights changed after they were written "
                              "(a damaged file)")
    return tensors


def logged_rows(metrics: Path, step: int) -> list[dict]:
    """The metrics rows up to `step` (a resumed run's); later ones, of steps to be redone, are dropped."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    rows = [r for r in rows if r["step"] <= step]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_run_config(folder) -> dict:
    """The JSON object in a kiln run's (or an HF folder's) config.json; DataError naming what is wrong."""
    file = Path(folder) / CONFIG
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise DataError(f"{folder}: not a kiln run or Hugging Face folder (cannot read {file}: "
                        f"{e.strerror or e})") from None
    except ValueError as e:
        raise DataError(f"{file}: not UTF-8 JSON: {e}") from None
    if not isinstance(config, dict):
        raise DataError(f"{file} holds a {type(config).__name__}, not a JSON object")
    return config


def load_pretrained(path) -> GPT:
    """A GPT (on the CPU) from a kiln run folder or a Hugging Face GPT-2 folder, for init_from."""
    folder = Path(path)
    if read_run_config(folder).get("model_type") == "gpt2":
        from kiln.checkpoint.hf import import_hf
        return import_hf(folder)
    return load_run(folder)[0]


def load_run(run_dir) -> tuple[GPT, object, dict]:
    """(model, tokenizer or None, config) of a finished run folder, on the CPU. The weights' shapes are checked
    against config.json from the file's header before the model is built, and their digest after."""
    from kiln.data.tokenizer import BPE_FILE, BYTES_FILE, load_tokenizer
    run = Path(run_dir)
    checkpoints = run / CHECKPOINTS
    for name in (CONFIG, WEIGHTS):
        if not (run / name).is_file() and not (name == WEIGHTS and checkpoints.is_dir()):
            raise DataError(f"{run} is not a finished kiln run: it has no {name}")
    config = read_run_config(run)
    if not isinstance(config.get("model"), dict):
        raise DataError(f"{run / CONFIG} has no 'model' settings: not a kiln run's config")
    model_config = GPTConfig.from_dict(config["model"])
    shapes = model_config.parameter_shapes()
    if (run / WEIGHTS).is_file():
        weights = load_weights(run / WEIGHTS, shapes)
    else:  # an interrupted run: the weights of its newest good checkpoint
        state, path = CheckpointFolder(checkpoints).load_latest()
        # a data-parallel run's manifest (kiln.distributed.checkpoint) names shards that hold the weights
        weights = read_full(path) if "sharded" in state else state["model"]
        check_shapes({n: a.shape for n, a in weights.items()}, shapes, str(checkpoints))
    model = GPT(model_config)
    model.to(dtype=next(iter(weights.values())).dtype)
    model.load_state_dict(weights)
    has_tokenizer = any((run / name).is_file() for name in (BPE_FILE, BYTES_FILE))
    return model, load_tokenizer(run) if has_tokenizer else None, config  # None: imported without one


def plot_losses(history, path: Path, entropy: float | None = None) -> None:
    """Train loss per step and validation loss per evaluation, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], lw=1, label="train loss")
    ev = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if ev:
        ax.plot(*zip(*ev), "o-", label="validation loss")
    if entropy is not None:
        ax.axhline(entropy, color="gray", ls="--", lw=1, label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def jsonable(d: dict) -> dict:
    """A dataclass's asdict() as config.json holds it (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
