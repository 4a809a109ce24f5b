"""TP and CP code paths at world size 1 (what one GPU runs: DESIGN.md, NCCL cannot put two ranks
on one GPU): a GPT made tensor- and context-parallel over a group of one, with async-TP chunks and
each CP transport, equals the dense GPT, loss and every gradient. The CPU runs it over MPI, the
GPU over NCCL (send/recv to itself, all-to-all, all-gather, reduce-scatter, chunked all-reduces)."""

import numpy as np
import pytest

import kiln
import kiln.distributed as dist
from kiln.distributed.context_parallel import TRANSPORTS, parallelize_context
from kiln.distributed.tensor_parallel import parallelize_tensor
from kiln.nn import GPT, GPTConfig

CASES = [(chunks, transport) for chunks in (1, 4) for transport in TRANSPORTS]


def _check(backend: str, device: str, dtype: str, tol: float) -> None:
    dist.destroy_process_group()
    world = dist.init_process_group(backend, timeout=60, env=dist.Environment(0, 1, 0, 1, "127.0.0.1", 29500, "single"))
    try:
        cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
        rng = np.random.default_rng(0)
        x, y = (kiln.tensor(rng.integers(0, 64, (2, 32)), device=device) for _ in range(2))

        def model():
            return GPT(cfg, generator=kiln.Generator(3)).to(device, dtype=dtype)

        ref = model()
        ref_loss = ref(x, y)[1]
        ref_loss.backward()
        want = {name: p.grad.numpy() for name, p in ref.named_parameters()}
        for chunks, transport in CASES:
            m = parallelize_context(parallelize_tensor(model(), world, chunks), world, transport, zigzag=True)
            loss = m(x, y)[1]
            loss.backward()
            assert abs(loss.item() - ref_loss.item()) <= tol, (chunks, transport)
            grads = {name: p.grad.numpy() for name, p in m.named_parameters()}
            assert sorted(grads) == sorted(want)
            for name, g in grads.items():
                np.testing.assert_allclose(g, want[name], rtol=0, atol=tol, err_msg=name)
    finally:
        dist.destroy_process_group()


def test_tp_and_cp_over_a_world_of_one_equal_the_dense_gpt_on_the_cpu():
    _check("mpi", "cpu", "float64", 1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")
def test_tp_and_cp_over_nccl_at_world_size_one_equal_the_dense_gpt_on_the_gpu():
    _check("nccl", "cuda", "float32", 1e-5)


def test_async_tp_launches_each_chunks_all_reduce_before_the_next_chunks_gemm(monkeypatch):
    from kiln.distributed.tensor_parallel import RowParallelLinear
    from kiln.nn import Linear
    dist.destroy_process_group()
    world = dist.init_process_group("mpi", timeout=60, env=dist.Environment(0, 1, 0, 1, "127.0.0.1", 29500, "single"))
    try:
        row = RowParallelLinear(Linear(16, 8), world, chunks=4)
        x = kiln.randn(2, 8, 16)
        events = []
        backend = x.backend
        gemm, all_reduce = backend.linear_fwd, world.all_reduce

        def traced_gemm(a, w, b):
            events.append(("gemm", a.shape[0]))
            return gemm(a, w, b)

        class Traced:  # the Work of an all-reduce, recording when it is waited on
            def __init__(self, work, i):
                self.work, self.i = work, i

            def wait(self):
                events.append(("wait", self.i))
                self.work.wait()

        def traced_all_reduce(t, op="sum", async_op=False):
            events.append(("all_reduce", t.numel()))
            return Traced(all_reduce(t, op, async_op=async_op), len([e for e in events if e[0] == "all_reduce"]) - 1)

        monkeypatch.setattr(backend, "linear_fwd", traced_gemm)
        monkeypatch.setattr(world, "all_reduce", traced_all_reduce)
        y = row(x)
        # chunk i's all-reduce is in flight while chunk i+1's GEMM runs; the waits come after the last launch
        assert events == [e for i in range(4) for e in (("gemm", 4), ("all_reduce", 32))] + \
            [("wait", i) for i in range(4)]
        np.testing.assert_allclose(y.numpy(), (x.numpy() @ row.weight.numpy().T + row.bias.numpy()), rtol=1e-6)
    finally:
        dist.destroy_process_group()
