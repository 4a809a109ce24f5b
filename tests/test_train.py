"""The Trainer and the CLI, end to end on the bundled corpus (small settings, so CI stays quick)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kiln.cli import build_parser, main
from kiln.train import TrainConfig, Trainer, load_run

SMALL = dict(model_overrides={"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64},
             batch_size=8, device="cpu", progress=False, eval_iters=4, sample_tokens=40)


def test_trainer_fills_the_run_folder(tmp_path):
    cfg = TrainConfig(**SMALL, max_steps=12, eval_interval=6, out_dir=str(tmp_path), run_name="r")
    s = Trainer(cfg).fit()
    run = tmp_path / "r"
    for name in ("config.json", "metrics.jsonl", "loss.png", "model.safetensors", "sample.txt",
                 "summary.json", "bytes-tokenizer.json"):
        assert (run / name).is_file(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["step"] for r in rows if "val_loss" in r] == [6, 12]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert rows[0]["lr"] < rows[-1]["lr"] or cfg.warmup_steps >= 12
    assert s["final_val_loss"] == rows[-1]["val_loss"]
    assert 3.0 < s["unigram_entropy"] < 5.0  # English text, bytes, in nats
    model, tok, _ = load_run(run)
    assert model.config.n_layer == 2 and tok.decode(tok.encode("abc")) == "abc"


def test_training_gets_well_under_the_unigram_entropy(tmp_path):
    # 400 steps of 16 x 64 tokens (the tiny preset's context)
    s = Trainer(TrainConfig(model_overrides={"n_layer": 2}, batch_size=16, device="cpu", progress=False,
                            eval_iters=8, sample_tokens=0, max_steps=400, eval_interval=400, lr=2e-3,
                            min_lr=2e-4, warmup_steps=10, out_dir=str(tmp_path))).fit()
    assert s["final_val_loss"] < s["unigram_entropy"] - 0.5, s


def test_same_seed_same_losses(tmp_path):
    runs = [Trainer(TrainConfig(**SMALL, max_steps=4, eval_interval=4, out_dir=str(tmp_path))).fit()
            for _ in range(2)]
    a, b = ([json.loads(x)["loss"] for x in open(f"{r['run_dir']}/metrics.jsonl")] for r in runs)
    assert a == b


@pytest.mark.parametrize("argv,message", [
    (["train", "--config", "gpt5"], "unknown model preset 'gpt5'"),
    (["train", "--data", "/no/such/dir"], "/no/such/dir"),
    (["train", "--steps", "0"], "max_steps must be a positive integer"),
    (["train", "--set", "n_head=5"], "multiple of model.n_head"),
    (["train", "--device", "tpu"], "unknown device 'tpu'"),
    (["train", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["sample", "/no/such/run"], "not a finished kiln run"),
])
def test_bad_input_exits_2_with_a_message_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "runs"
    code = main(argv + (["--out", str(out)] if argv[0] == "train" else []))
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_cli_train_then_sample(tmp_path):
    args = ["train", "--device", "cpu", "--steps", "3", "--eval-interval", "3", "--batch-size", "4",
            "--set", "n_layer=1", "--set", "n_embd=32", "--no-progress", "--out", str(tmp_path),
            "--name", "cli"]
    done = subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "unigram entropy" in done.stdout and "validation loss" in done.stdout
    sample = subprocess.run([sys.executable, "-m", "kiln.cli", "sample", str(tmp_path / "cli"),
                             "--prompt", "The if", "--tokens", "20"], capture_output=True, text=True)
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("The if") and len(sample.stdout) > 10


def test_cuda_graph_flag_reaches_the_config_and_a_cpu_run_is_unchanged(tmp_path):
    args = build_parser().parse_args(["train", "--no-cuda-graph"])
    assert args.cuda_graph is False and build_parser().parse_args(["train"]).cuda_graph is None
    assert TrainConfig().cuda_graph is True
    common = dict(model="tiny", device="cpu", max_steps=4, batch_size=2, eval_interval=4, eval_iters=1,
                  sample_tokens=0, progress=False, out_dir=str(tmp_path), model_overrides={"n_layer": 1})
    plain = Trainer(TrainConfig(**common, run_name="plain", cuda_graph=False)).fit()
    graph = Trainer(TrainConfig(**common, run_name="graph")).fit()  # graphs are CUDA-only
    assert graph["final_train_loss"] == plain["final_train_loss"]


def test_a_step_that_cannot_be_captured_warns_once_and_runs_op_by_op(tmp_path, monkeypatch):
    """Where recording the step as a CUDA graph fails (here: a capture that raises, as the 76-layer fp32
    step did), the Trainer says why once and trains op by op from then on: the same losses as without
    the graph."""
    import warnings

    from kiln.backend import cpu
    from kiln.graph import GraphCaptureError
    from kiln.train import trainer as trainer_module
    recorded = []

    class Uncapturable:
        def __init__(self, fn):
            recorded.append(fn)

        def __call__(self, *inputs):
            raise GraphCaptureError("recording the step as a CUDA graph failed: CUDARuntimeError: "
                                    "cudaErrorStreamCaptureUnsupported")

    common = dict(model="tiny", device="cpu", max_steps=6, batch_size=2, eval_interval=6, eval_iters=1,
                  sample_tokens=0, progress=False, out_dir=str(tmp_path), model_overrides={"n_layer": 1})
    plain = Trainer(TrainConfig(**common, run_name="plain", cuda_graph=False))
    plain_losses = [plain.train_step()["loss"] for _ in range(6)]
    monkeypatch.setattr(trainer_module, "CapturedStep", Uncapturable)
    monkeypatch.setattr(cpu, "captures_graphs", True)  # as a CUDA device: the Trainer tries the graph
    graphed = Trainer(TrainConfig(**common, run_name="graph"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [graphed.train_step()["loss"] for _ in range(6)]
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(recorded) == 1 and len(said) == 1
    assert "continuing op by op" in said[0] and "cudaErrorStreamCaptureUnsupported" in said[0]
    assert losses == plain_losses


def test_undoing_a_step_recasts_the_kept_bf16_weight_copies(tmp_path):
    """The skip policy restores the parameters in place; a graph replay reads the bf16 copies without checking
    versions, so the Trainer recasts them there and then (not at the next forward)."""
    t = Trainer(TrainConfig(model="tiny", device="cpu", precision="bf16", max_steps=4, batch_size=2, eval_interval=4,
                            eval_iters=1, sample_tokens=0, progress=False, out_dir=str(tmp_path),
                            model_overrides={"n_layer": 1}))
    t.train_step()
    before = t._update_state_copy()
    t.train_step()
    t._restore_update_state(before)
    kept = [p for p in t.model.parameters() if p.kept is not None]
    assert kept
    for p in kept:
        assert p.kept.version == p.version
        assert np.array_equal(p.kept.data.view(np.uint16), p.numpy().astype(p.kept.dtype.np).view(np.uint16))


@pytest.mark.parametrize("clip_via", ["recompute", "host"])
def test_adamw_in_backward_trains_as_the_ordinary_step_bit_for_bit(tmp_path, clip_via):
    """The Trainer with AdamW in backward (and recomputed blocks) logs the same losses and grad norms and
    ends with the same weights as the ordinary step (backward, clip, step), on the CPU in fp32."""
    common = dict(model="tiny", device="cpu", max_steps=5, batch_size=2, eval_interval=5, eval_iters=1,
                  sample_tokens=0, progress=False, out_dir=str(tmp_path), model_overrides={"n_layer": 2})
    plain = Trainer(TrainConfig(**common, run_name="plain"))
    inside = Trainer(TrainConfig(**common, run_name="inside", adamw_in_backward=True, recompute_blocks=1,
                                 recompute_norm_gelu=True, adamw_clip_via=clip_via))
    assert inside.optimizer.clip_via == clip_via
    assert ("host memory" in inside.config.describe_recipe()) == (clip_via == "host")
    rows = [plain.train_step() for _ in range(5)]
    rows_in = [inside.train_step() for _ in range(5)]
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(r["loss"], r["grad_norm"]) for r in rows_in]
    for a, b in zip(plain.model.parameters(), inside.model.parameters()):
        assert a.numpy().tobytes() == b.numpy().tobytes()
    assert all(p.grad is None for p in inside.model.parameters())


@pytest.mark.parametrize("settings, message", [
    (dict(grad_accum=2), "gradient accumulation"),
    (dict(global_batch=4096), "gradient accumulation"),
    (dict(parallel="ddp"), "one device"),
    (dict(tp=2), "one device"),
])
def test_adamw_in_backward_says_what_it_cannot_combine_with(settings, message):
    from kiln.errors import NotBuiltError
    with pytest.raises(NotBuiltError, match=message):
        TrainConfig(device="cpu", adamw_in_backward=True, **settings).validate()
    from kiln.errors import ConfigError
    with pytest.raises(ConfigError, match="adamw_clip_via must be one of recompute, host, got 'disk'"):
        TrainConfig(device="cpu", adamw_in_backward=True, adamw_clip_via="disk").validate()


def test_the_largest_preset_updates_in_backward_in_one_micro_batch():
    cfg = TrainConfig(model="gpt2-largest")
    assert cfg.adamw_in_backward and cfg.recompute_norm_gelu and cfg.recompute_blocks == 16 and cfg.global_batch is None
    assert cfg.batch_size == 2 and cfg.grad_accum == 1 and cfg.grad_clip == 1.0 and cfg.adamw_clip_via == "host"
    cfg.validate()
    assert "AdamW inside backward" in cfg.describe_recipe() and "first 16 blocks recomputed" in cfg.describe_recipe()
    from kiln.nn import preset
    shapes = preset("gpt2-largest", vocab_size=50304).parameter_shapes()
    assert 10.5e9 < sum(int(np.prod(s)) for s in shapes.values()) < 10.6e9
