"""DP x TP x CP composed on one DeviceMesh (§2.2, §4.2-4.3): 5 AdamW steps on 4 and 8 real MPI
ranks (8 on 2 cores: ~14 s) equal one process on the whole batch (float64), and the run's
checkpoint loads into another layout (checked on the ranks) and into one process (checked here)."""

import numpy as np
import pytest

import kiln
from kiln.checkpoint import load
from kiln.errors import ConfigError
from kiln.nn import GPT, GPTConfig
from tests.mpi_runner import run_ranks


@pytest.mark.dist
@pytest.mark.parametrize("dp, tp, cp, transport, chunks", [(1, 2, 2, "p2p", 2), (2, 2, 1, "p2p", 1),
                                                          (2, 1, 2, "all_gather", 1), (2, 2, 2, "p2p", 2)])
def test_mesh_training_equals_one_process_and_its_checkpoint_loads_anywhere(dp, tp, cp, transport, chunks, tmp_path):
    results, _, _ = run_ranks("mesh_training_equal.py", dp * tp * cp, tmp_path, dp, tp, cp, transport, chunks,
                              tmp_path, timeout=120)
    coords = sorted((res["coordinate"]["dp"], res["coordinate"]["cp"], res["coordinate"]["tp"]) for res in results)
    assert coords == sorted((a, b, c) for a in range(dp) for b in range(cp) for c in range(tp))
    for r, res in enumerate(results):
        assert res["grad_group"] == dp * cp, (r, res)
        assert res["moved"] > 1e-3  # the 5 steps changed the weights: the comparison is not of the start
        assert res["param_diff"] <= 1e-10 and res["loss_diff"] <= 1e-10 and res["norm_diff"] <= 1e-10, (r, res)
        assert res["ref_norms"][0] > 0.5  # the clip acted
        assert res["other_layout_loss_diff"] <= 1e-10, (r, res)
    saved = load(tmp_path / "mesh.kiln")
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).to(dtype="float64")
    model.load_state_dict({k: kiln.tensor(v) for k, v in saved["model"].items()})
    rng = np.random.default_rng(7)
    batches = [(rng.integers(0, 64, (4, 16)), rng.integers(0, 64, (4, 16))) for _ in range(6)]
    x, y = batches[-1]  # the rank script's evaluation batch
    loss = model(kiln.tensor(x), kiln.tensor(y))[1].item()
    assert abs(loss - float(saved["eval_loss"])) <= 1e-10


@pytest.mark.dist
@pytest.mark.parametrize("dp, tp, cp", [(2, 2, 1), (2, 1, 2)])
def test_zero_and_fsdp_on_a_mesh_equal_one_process_and_ddp_on_the_mesh(dp, tp, cp, tmp_path):
    """ZeRO-1/2 and FSDP shard each tp rank's (or cp rank's) parameters over the dp x cp ranks: 5 AdamW
    steps with the clip are the single process's (parameters, moments, losses, norms) and DDP's on the
    same mesh; their dense state continues in another strategy as one process does."""
    results, _, _ = run_ranks("mesh_sharded_equal.py", dp * tp * cp, tmp_path, dp, tp, cp, timeout=120)
    for r, res in enumerate(results):
        assert res["moved"] > 1e-3 and res["ref_norms"][0] > 0.5  # the weights moved, the clip acted
        for strategy, out in res["strategies"].items():
            assert out["sharded"] == (strategy != "ddp") and out["grad_group"] == dp * cp, (r, strategy, out)
            assert out["step_count"] == 5
            for key in ("param_diff", "moment_diff", "loss_diff", "norm_diff", "ddp_diff", "resumed_diff"):
                assert out[key] <= 1e-10, (r, strategy, key, out)
            assert out["tp_replicas_differ"] == 0.0, (r, strategy, out)  # one clip coefficient on every rank
            ddp_bytes = res["strategies"]["ddp"]["optimizer_bytes"]
            if strategy != "ddp":  # the moments are 1/(dp x cp) of the tp/cp-local model's, give or take padding
                assert out["optimizer_bytes"] <= ddp_bytes / (dp * cp) + 8 * 64, (r, strategy, out, ddp_bytes)


def _single_process_run(tmp_path, dropout: float = 0.0):
    """The control: one process training the same model on the whole global batch (metrics, weights)."""
    import json

    from safetensors.numpy import load_file

    from kiln.train import TrainConfig, Trainer
    summary = Trainer(TrainConfig(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32,
                                                   "dropout": dropout},
                                  precision="fp64", batch_size=4, seq_len=32, grad_accum=2, max_steps=4,
                                  eval_interval=2, eval_iters=3, sample_tokens=10, device="cpu", progress=False,
                                  out_dir=str(tmp_path / "single"), run_name="one", warmup_steps=1)).fit()
    run = tmp_path / "single" / "one"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return summary, rows, load_file(str(run / "model.safetensors"))


def _assert_same_run(run, rows_one, weights_one, tol):
    import json

    from safetensors.numpy import load_file
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, rows_one, strict=True):
        assert abs(a["loss"] - b["loss"]) < tol and abs(a["grad_norm"] - b["grad_norm"]) < tol, (a, b)
        assert ("val_loss" in a) == ("val_loss" in b) and abs(a.get("val_loss", 0) - b.get("val_loss", 0)) < tol
    weights = load_file(str(run / "model.safetensors"))  # the dense model, gathered from the tp shards
    assert sorted(weights) == sorted(weights_one)
    assert max(float(np.max(np.abs(weights[k] - weights_one[k]))) for k in weights_one) < tol


@pytest.mark.dist
@pytest.mark.parametrize("dp, transport, dropout", [(1, "p2p", 0.1), (2, "all_gather", 0.0)])
def test_trainer_tp2_cp2_equals_one_process(dp, transport, dropout, tmp_path):
    """tp 2 x cp 2 (async TP in 2 chunks) on 4 ranks, and 2 replicas of it (--parallel ddp) on 8: the
    loss curve, the gradient norms, the evaluations and the weights are the single process's. With
    dropout 0.1 (one replica) every rank draws one process's masks (tp: replicated activations; cp:
    its tokens of the whole sequence's mask)."""
    out = tmp_path / "mp"
    results, _, _ = run_ranks("train_model_parallel.py", 4 * dp, tmp_path, out, 2, 2, "ddp" if dp > 1 else "none",
                              4 // dp, 4, dropout, transport, 2, timeout=240)
    assert sorted((r["coordinate"]["dp"], r["coordinate"]["cp"], r["coordinate"]["tp"]) for r in results) == \
        sorted((a, b, c) for a in range(dp) for b in range(2) for c in range(2))
    assert [(r["replicas"], r["grad_accum"]) for r in results] == [(dp, 2)] * 4 * dp
    assert sorted(p.name for p in out.iterdir()) == ["run"]  # rank 0's run folder alone
    single, rows_one, weights_one = _single_process_run(tmp_path, dropout=dropout)
    _assert_same_run(out / "run", rows_one, weights_one, 1e-10)
    assert abs(results[0]["summary"]["final_val_loss"] - single["final_val_loss"]) < 1e-10
    assert (out / "run" / "sample.txt").read_text()  # rank 0 sampled from the gathered dense model


@pytest.mark.dist
def test_trainer_tp2_dp2_checkpoint_resumes_as_cp2_through_the_cli(tmp_path):
    """`kiln train --tp 2 --parallel ddp` on 4 ranks saves dense checkpoints (the tp shards gathered);
    `kiln train --resume RUN --tp 1 --cp 2` continues it on 2 ranks in another layout, and the whole
    run is the single process's."""
    import subprocess
    import sys

    from tests.mpi_runner import mpiexec
    out = tmp_path / "mp"
    results, _, _ = run_ranks("train_model_parallel.py", 4, tmp_path, out, 2, 1, "ddp", 2, 2, 0.0, "p2p", 1,
                              timeout=180)
    assert sorted((r["coordinate"]["dp"], r["coordinate"]["tp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(r["replicas"], r["grad_accum"]) for r in results] == [(2, 2)] * 4  # 256 tokens / (2 rows x 32 x 2)
    assert [p.name for p in sorted((out / "run" / "checkpoints").glob("ckpt-*.kiln"))] == ["ckpt-00000002.kiln"]
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "kiln.cli", "train", "--resume", str(out / "run"), "--tp", "1",
           "--cp", "2", "--parallel", "none", "--steps", "4", "--batch-size", "4", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming" in proc.stdout and "(dp 1 x tp 1 x cp 2, none)" in proc.stdout
    single, rows_one, weights_one = _single_process_run(tmp_path)
    _assert_same_run(out / "run", rows_one, weights_one, 1e-10)


@pytest.mark.dist
@pytest.mark.parametrize("parallel, tp, cp, wrapper", [("fsdp", 2, 1, "FullyShardedDataParallel"),
                                                       ("zero1", 1, 2, "ZeroDataParallel")])
def test_trainer_sharded_on_a_mesh_resumes_in_one_process(parallel, tp, cp, wrapper, tmp_path):
    """`Trainer(parallel="fsdp", tp=2)` (FSDP over the 2 replicas of each tp shard) and `Trainer(parallel=
    "zero1", cp=2)` (ZeRO-1 over the 2 replicas x 2 cp ranks) on 4 ranks, with accumulation, save the
    dense model and AdamW state; one process resumes it, and the whole run is the single process's."""
    from kiln.train import Trainer
    out = tmp_path / "mp"
    results, _, _ = run_ranks("train_model_parallel.py", 4, tmp_path, out, tp, cp, parallel, 2, 2, 0.0, "p2p", 1,
                              timeout=180)
    assert [(r["replicas"], r["grad_accum"], r["data_parallel"]) for r in results] == [(2, 2, wrapper)] * 4
    saved = load(out / "run" / "checkpoints" / "ckpt-00000002.kiln")
    assert saved["model"]["h.0.attn.c_attn.weight"].shape == (96, 32)  # dense, not a shard
    trainer = Trainer.from_checkpoint(out / "run", max_steps=4, tp=1, cp=1, parallel="none", batch_size=4)
    assert trainer.step == 2 and trainer.mesh is None and trainer.world_size == 1
    trainer.fit()
    single, rows_one, weights_one = _single_process_run(tmp_path)
    _assert_same_run(out / "run", rows_one, weights_one, 1e-10)


@pytest.mark.dist
def test_an_fsdp_run_without_tp_resumes_as_zero2_on_dp2_x_tp2_through_the_cli(tmp_path):
    """A plain FSDP run on 2 ranks saves sharded checkpoints (a file per rank); `kiln train --resume RUN
    --tp 2 --parallel zero2` continues it on 4 ranks (each tp rank reads the whole state from the shard
    files, cuts its tp shards and keeps its ZeRO pieces of them), and the whole run is the single process's."""
    import subprocess
    import sys

    from tests.mpi_runner import mpiexec
    out = tmp_path / "mp"
    run_ranks("train_sharded.py", 2, tmp_path / "a", out, "fsdp", 2, 2, 0, timeout=120)
    assert len(list((out / "run" / "checkpoints").glob("ckpt-00000002.shard-*.kiln"))) == 2
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "kiln.cli", "train", "--resume", str(out / "run"), "--tp", "2",
           "--parallel", "zero2", "--steps", "4", "--batch-size", "2", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resuming" in proc.stdout and "(dp 2 x tp 2 x cp 1, zero2)" in proc.stdout
    assert (out / "run" / "checkpoints" / "ckpt-00000004.kiln").is_file()  # the dense model, one file
    assert not list((out / "run" / "checkpoints").glob("ckpt-00000004.shard-*"))
    single, rows_one, weights_one = _single_process_run(tmp_path)
    _assert_same_run(out / "run", rows_one, weights_one, 1e-10)


def test_impossible_tp_cp_layouts_are_config_errors_naming_the_values():
    from kiln.train import TrainConfig
    from kiln.train.config import mesh_sizes
    model = GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=32)
    assert mesh_sizes(TrainConfig(tp=2, cp=2, parallel="ddp"), model, 32, 8) == {"dp": 2, "cp": 2, "tp": 2}
    assert mesh_sizes(TrainConfig(tp=2), model, 32, 2) == {"dp": 1, "cp": 1, "tp": 2}
    with pytest.raises(ConfigError, match="tp 2 x cp 2 = 4 ranks per model replica do not divide the 6 ranks"):
        mesh_sizes(TrainConfig(tp=2, cp=2, parallel="ddp"), model, 32, 6)
    with pytest.raises(ConfigError, match="4 ranks with tp 2 x cp 1 hold 2 model replicas: .* --parallel ddp"):
        mesh_sizes(TrainConfig(tp=2), model, 32, 4)
    with pytest.raises(ConfigError, match="tp 8 splits the model's 4 heads and 64 vocabulary rows over 8 ranks"):
        mesh_sizes(TrainConfig(tp=8), model, 32, 8)
    with pytest.raises(ConfigError, match="cp 4 cuts each sequence into 2 x 4 chunks .* seq_len 36 must be a multiple "
                                          "of 8"):
        mesh_sizes(TrainConfig(cp=4), model, 36, 4)
    with pytest.raises(ConfigError, match="all_to_all splits each tp rank's 2 heads over cp 4 ranks"):
        mesh_sizes(TrainConfig(tp=2, cp=4, cp_transport="all_to_all"), model, 32, 8)
    with pytest.raises(ConfigError, match="unknown cp_transport 'ring'; allowed: p2p, all_gather, all_to_all"):
        TrainConfig(cp=2, cp_transport="ring").validate()
    with pytest.raises(ConfigError, match="tp_chunks must be a positive integer, got 0"):
        TrainConfig(tp_chunks=0).validate()


@pytest.mark.dist
def test_tp_in_bf16_on_mpi_ranks_is_refused_before_anything_is_written(tmp_path):
    import subprocess
    import sys

    from tests.mpi_runner import mpiexec
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "kiln.cli", "train", "--tp", "2", "--precision", "bf16",
           "--device", "cpu", "--steps", "1", "--out", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tp 2 in bf16 sums bf16 activations over the tp ranks, which MPI cannot reduce" in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_cli_tp_cp_flags_reach_the_config():
    from kiln.cli import build_parser
    args = build_parser().parse_args(["train", "--tp", "2", "--cp", "4", "--cp-transport", "all_gather",
                                      "--tp-chunks", "2", "--parallel", "ddp"])
    assert (args.tp, args.cp, args.cp_transport, args.tp_chunks, args.parallel) == (2, 4, "all_gather", 2, "ddp")
