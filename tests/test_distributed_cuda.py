"""The NCCL paths on one GPU (world size 1, DESIGN.md: NCCL cannot put two ranks on one GPU):
collectives on CUDA tensors, DDP's buckets on the comm stream, and the DDP step as a CUDA graph."""

import json

import numpy as np
import pytest

import kiln
import kiln.distributed as dist
from kiln.nn import GPT, GPTConfig


def gpu(test):
    return pytest.mark.cuda(pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")(test))


@pytest.fixture
def nccl_world():
    dist.destroy_process_group()
    world = dist.init_process_group("nccl", timeout=60, env=dist.Environment(0, 1, 0, 1, "127.0.0.1", 29500, "single"))
    yield world
    dist.destroy_process_group()


@gpu
def test_nccl_collectives_at_world_size_one(nccl_world):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 33)).astype(np.float32)
    for op in ("sum", "avg", "max"):
        t = kiln.tensor(x, device="cuda")
        nccl_world.all_reduce(t, op)
        np.testing.assert_array_equal(t.numpy(), x)
    b = kiln.tensor(x, device="cuda").to("bfloat16")
    nccl_world.all_reduce(b, "sum")
    np.testing.assert_array_equal(b.numpy().astype(np.float32), kiln.tensor(x).to("bfloat16").numpy().astype(np.float32))
    out = kiln.zeros(64, 33, device="cuda")
    nccl_world.all_gather(out, kiln.tensor(x, device="cuda"))
    np.testing.assert_array_equal(out.numpy(), x)
    nccl_world.reduce_scatter(out, kiln.tensor(x * 2, device="cuda"), "sum")
    np.testing.assert_array_equal(out.numpy(), x * 2)
    t = kiln.tensor(x, device="cuda")
    nccl_world.reduce_scatter_all_gather(t, "avg")  # DDP's bucket all-reduce
    np.testing.assert_array_equal(t.numpy(), x)
    t = kiln.tensor(x, device="cuda")
    work = nccl_world.all_reduce(t * 3.0, "sum", async_op=True)
    assert work.event is not None
    work.wait()         # the compute stream waits on the comm stream; the host does not
    work.synchronize()  # the host waits
    assert work.is_completed()
    nccl_world.barrier()


@gpu
def test_ddp_on_cuda_gives_the_plain_gradients(nccl_world):
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
    plain, model = GPT(cfg, generator=kiln.Generator(0)), GPT(cfg, generator=kiln.Generator(0))
    plain.to("cuda")
    model.to("cuda")
    ddp = dist.DistributedDataParallel(model, nccl_world, bucket_cap_mb=0.05)
    assert len(ddp.buckets) > 3
    rng = np.random.default_rng(1)
    for _ in range(2):  # the second backward runs on the buckets laid out in the observed order
        x, y = (kiln.tensor(rng.integers(0, 128, (4, 32)), device="cuda") for _ in range(2))
        for p in list(plain.parameters()) + list(model.parameters()):
            p.grad = None
        plain(x, y)[1].backward()
        model(x, y)[1].backward()
        ddp.wait_gradients()
        for p, q in zip(plain.parameters(), model.parameters()):
            np.testing.assert_array_equal(q.grad.numpy(), p.grad.numpy())


@gpu
def test_trainer_ddp_step_as_a_cuda_graph_equals_eager(nccl_world, tmp_path):
    from kiln.train import TrainConfig, Trainer
    rows = {}
    for graph in (False, True):
        cfg = TrainConfig(model_overrides={"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64}, device="cuda",
                          batch_size=4, grad_accum=2, max_steps=6, eval_interval=6, eval_iters=2, sample_tokens=0,
                          progress=False, parallel="ddp", bucket_mb=0.05, cuda_graph=graph,
                          out_dir=str(tmp_path), run_name=f"graph{graph}")
        Trainer(cfg).fit()
        rows[graph] = [json.loads(line) for line in (tmp_path / f"graph{graph}" / "metrics.jsonl").read_text().splitlines()]
    for eager, replay in zip(rows[False], rows[True], strict=True):
        assert abs(eager["loss"] - replay["loss"]) <= 1e-5 * abs(eager["loss"]), (eager, replay)
        assert abs(eager["grad_norm"] - replay["grad_norm"]) <= 1e-4 * eager["grad_norm"], (eager, replay)


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("parallel", ["zero1", "zero2", "fsdp"])
def test_trainer_sharded_step_as_a_cuda_graph_equals_eager(parallel, precision, nccl_world, tmp_path):
    # the graph records ZeRO's reduce-scatters and all-gathers (and, in bf16, its rewrite of the
    # weights' kept bf16 copies), or FSDP's per-unit gathers, frees and reduce-scatters, and
    # ShardedAdamW's update reading lr and the step from device buffers
    from safetensors.numpy import load_file

    from kiln.train import TrainConfig, Trainer
    rows, weights = {}, {}
    tol = 1e-5 if precision == "fp32" else 2e-3
    for graph in (False, True):
        cfg = TrainConfig(model_overrides={"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 64}, device="cuda",
                          batch_size=4, grad_accum=2, max_steps=6, eval_interval=2, eval_iters=2, sample_tokens=0,
                          progress=False, parallel=parallel, bucket_mb=0.05, cuda_graph=graph, precision=precision,
                          lr=1e-2, out_dir=str(tmp_path), run_name=f"{parallel}-{precision}-graph{graph}")
        trainer = Trainer(cfg)
        trainer.fit()
        assert (trainer._graph_step is not None and trainer._graph_step.captured) == graph
        for n, p in trainer.model.named_parameters():  # a kept copy is the value's after the last replay too
            if getattr(p, "kept", None) is not None and p.kept.data is not None:
                np.testing.assert_array_equal(kiln.Tensor._wrap(p.kept.data, p.device).numpy().astype(np.float32),
                                              p.to(p.kept.dtype).numpy().astype(np.float32), err_msg=n)
        run = tmp_path / f"{parallel}-{precision}-graph{graph}"
        rows[graph] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        weights[graph] = load_file(str(run / "model.safetensors"))
    for eager, replay in zip(rows[False], rows[True], strict=True):
        assert abs(eager["loss"] - replay["loss"]) <= tol * abs(eager["loss"]), (eager, replay)
        assert abs(eager["grad_norm"] - replay["grad_norm"]) <= 10 * tol * eager["grad_norm"], (eager, replay)
        if "val_loss" in eager:
            assert abs(eager["val_loss"] - replay["val_loss"]) <= tol * eager["val_loss"], (eager, replay)
    for k, w in weights[False].items():
        np.testing.assert_allclose(weights[True][k], w, rtol=0, atol=1e-5 if precision == "fp32" else 1e-3, err_msg=k)
