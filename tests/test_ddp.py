"""DDP (Algorithm 1): bucket layout, and W real MPI ranks equal to one process on the whole batch."""

import numpy as np
import pytest

import kiln
import kiln.distributed as dist
from kiln.distributed.buckets import GradientBuckets
from kiln.errors import ConfigError, DistributedError
from kiln.nn import GPT, GPTConfig, Linear
from tests.mpi_runner import run_ranks


def test_buckets_respect_the_cap_dtype_and_padding():
    rng = np.random.default_rng(0)
    shapes = [(10, 10), (30,), (5, 4), (7,), (60, 2), (3,)]
    params = [kiln.tensor(rng.standard_normal(s), requires_grad=True) for s in shapes]
    params[3] = kiln.tensor(rng.standard_normal(7).astype(np.float32), requires_grad=True)
    b = GradientBuckets(params, cap_bytes=8 * 120, pad_to=4)
    index = {id(p): k for k, p in enumerate(params)}
    groups = [[index[id(p)] for p in bucket.params] for bucket in b.buckets]
    # 100+30 > 120 doubles: a new bucket; the float32 one alone; 120 doubles fill one, the 3 start the next
    assert groups == [[0], [1, 2], [3], [4], [5]]
    for bucket in b.buckets:
        assert bucket.buffer.numel() % 4 == 0 and bucket.buffer.numel() - bucket.numel < 4
        assert not bucket.buffer.numpy().any()
    bucket, i = b.slot(params[2])
    bucket.view(i)[...] = params[2].numpy()
    np.testing.assert_array_equal(bucket.buffer.numpy()[30:50], params[2].numpy().ravel())
    shards = [bucket.shard(r, 4) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate(shards), bucket.buffer.numpy())
    assert [id(p) for p in b.order] == [id(params[k]) for g in groups for k in g]


def _tiny(seed):
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16), generator=kiln.Generator(seed))
    model.to(dtype="float64")
    return model


def test_ddp_at_world_size_one_is_plain_training_and_learns_the_gradient_ready_order():
    dist.init_process_group("mpi", timeout=10)
    try:
        rng = np.random.default_rng(1)
        x, y = rng.integers(0, 32, (4, 8)), rng.integers(0, 32, (4, 8))
        plain, model = _tiny(0), _tiny(0)
        ddp = dist.DistributedDataParallel(model, bucket_cap_mb=0.002)
        assert len(ddp.buckets) > 2
        guess = [id(p) for p in ddp.buckets.order]
        for m in (plain, ddp):
            m(kiln.tensor(x), kiln.tensor(y))[1].backward()
        ddp.wait_gradients()
        for p, q in zip(plain.parameters(), model.parameters()):
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy())
        learned = [id(p) for p in ddp.buckets.order]
        # the guess (reverse registration order) has each bias before its weight; backward makes
        # each weight's gradient first; the tied wte (LM head and embedding) is last either way
        assert sorted(learned) == sorted(guess) and learned != guess
        assert learned[:2] == [id(model.ln_f.weight), id(model.ln_f.bias)]
        assert learned[-2:] == [id(model.wpe.weight), id(model.wte.weight)]
        with pytest.raises(ConfigError, match="bucket_cap_mb must be > 0"):
            dist.DistributedDataParallel(model, bucket_cap_mb=0)
    finally:
        dist.destroy_process_group()


def test_ddp_names_a_parameter_that_got_no_gradient():
    world = dist.init_process_group("mpi", timeout=10)
    try:
        class Two(kiln.nn.Module):
            def __init__(self):
                super().__init__()
                self.used, self.unused = Linear(3, 3), Linear(3, 3)

        m = Two()
        ddp = dist.DistributedDataParallel(m, group=world)
        m.used(kiln.randn(2, 3)).sum().backward()
        with pytest.raises(DistributedError, match=r"2 missing: \['unused.weight', 'unused.bias'\]"):
            ddp.wait_gradients()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("n, dtype, accum, tol, launcher", [(2, "float64", 3, 1e-12, "mpiexec"),
                                                            (4, "float64", 2, 1e-12, "mpiexec"),
                                                            (4, "float32", 1, 2e-5, "mpiexec"),
                                                            (2, "float64", 2, 1e-12, "torchrun")])
def test_ddp_on_w_ranks_equals_one_process_on_the_whole_batch(n, dtype, accum, tol, launcher, tmp_path):
    # float32: the batch's gradient is summed in another order (per rank, then across ranks), and
    # AdamW's g / sqrt(v) turns those last-bit differences of small gradients into ~1e-6 of 3e-3 steps.
    # torchrun: CPU ranks with no mpiexec (kiln.distributed.pmi)
    results, _, _ = run_ranks("ddp_equal.py", n, tmp_path, dtype, accum, 0.05, 0.5, timeout=120, launcher=launcher)
    for r, res in enumerate(results):
        assert res["max_param_diff"] <= tol, (r, res)
        np.testing.assert_allclose(res["norms"], res["ref_norms"], rtol=max(10 * tol, 1e-6))
        assert res["norms"][0] > 0.5  # the clip (0.5) acted on the first step at least
        assert res["buckets"] >= 3 and res["launches"] == [res["buckets_after"]] * 5  # none on micro-steps
        assert (res["start_diff"] > 0.01) == (r > 0)  # ranks started apart; the broadcast made them equal


@pytest.mark.dist
def test_trainer_ddp_on_two_ranks_equals_one_process_on_the_global_batch(tmp_path):
    """Rank r reads its rows of each global batch (the loader's rank stride), gradients and the
    logged and evaluated losses are averaged over ranks: the run is the single-process one."""
    import json

    from safetensors.numpy import load_file

    from kiln.train import TrainConfig, Trainer
    results, _, _ = run_ranks("train_ddp.py", 2, tmp_path, tmp_path / "ddp", 2, timeout=120)
    assert [r["grad_accum"] for r in results] == [2, 2]  # 256 tokens / (2 rows x 32 x 2 ranks)
    assert [r["summary"]["run_dir"] is None for r in results] == [False, True]
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == ["ddp"]  # one run folder, rank 0's
    single = Trainer(TrainConfig(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32},
                                 precision="fp64", batch_size=4, seq_len=32, grad_accum=2, max_steps=4,
                                 eval_interval=2, eval_iters=3, sample_tokens=10, device="cpu", progress=False,
                                 out_dir=str(tmp_path / "single"), run_name="one", warmup_steps=1)).fit()
    ddp_rows = [json.loads(line) for line in (tmp_path / "ddp" / "ddp" / "metrics.jsonl").read_text().splitlines()]
    one_rows = [json.loads(line) for line in (tmp_path / "single" / "one" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(ddp_rows, one_rows, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-12 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-12, (a, b)
        assert ("val_loss" in a) == ("val_loss" in b) and abs(a.get("val_loss", 0) - b.get("val_loss", 0)) < 1e-12
    assert abs(results[1]["summary"]["final_val_loss"] - single["final_val_loss"]) < 1e-12
    w_ddp = load_file(str(tmp_path / "ddp" / "ddp" / "model.safetensors"))
    w_one = load_file(str(tmp_path / "single" / "one" / "model.safetensors"))
    assert max(float(np.max(np.abs(w_ddp[k] - w_one[k]))) for k in w_one) < 1e-12


def test_trainer_parallel_settings_are_checked():
    from kiln.train import TrainConfig, Trainer
    from kiln.train.config import accumulation_steps
    small = {"model_overrides": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16}, "device": "cpu",
             "progress": False, "batch_size": 2}
    with pytest.raises(ConfigError, match="unknown parallel mode 'tp'; allowed: none, ddp, zero1, zero2, fsdp"):
        Trainer(TrainConfig(**small, parallel="tp"))
    assert accumulation_steps(TrainConfig(batch_size=4, global_batch=4 * 64 * 2 * 3), 64, 2) == 3
    with pytest.raises(ConfigError, match="global_batch 1000 tokens is not a multiple of .* 4 x 64 x 2 = 512"):
        accumulation_steps(TrainConfig(batch_size=4, global_batch=1000), 64, 2)
    with pytest.raises(ConfigError, match="not both"):
        accumulation_steps(TrainConfig(batch_size=4, global_batch=512, grad_accum=2), 64, 2)


def test_cli_parallel_flags_reach_the_config():
    from kiln.cli import build_parser
    args = build_parser().parse_args(["train", "--parallel", "ddp", "--global-batch", "4096", "--bucket-mb", "5"])
    assert (args.parallel, args.global_batch, args.bucket_mb) == ("ddp", 4096, 5.0)
