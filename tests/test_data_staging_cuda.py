"""The CUDA loader (paper, Algorithm 2) on the device: batches equal the CPU loader's bit for bit over
several wraps, exact resume, the synchronous fallback gives the same batches, the copy runs on its
own stream and overlaps compute, and the two events order the buffers both ways."""

import json
import time

import numpy as np
import pytest

import kiln
from kiln.data.loader import ShardLoader
from kiln.data.staging import split_window
from tests.test_checkpoint import stopped_run_folder
from tests.test_data_loader import make_shards, take

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not kiln.cuda_is_available(), reason="needs an NVIDIA GPU and CuPy")]

SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


def cupy():
    import cupy as cp
    return cp


def rt():
    from kiln.backend.cuda import device
    return device


def spin(stream, seconds):
    """Keep `stream` busy for `seconds` with a one-thread kernel that reads the global timer."""
    cp = cupy()
    kernel = cp.RawKernel(SPIN, "spin")
    with stream:
        kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),))


def host(batch):
    x, y = batch
    assert isinstance(x, cupy().ndarray) and x.dtype == np.int64 and y.dtype == np.int64
    return x.get(), y.get()


def assert_same(gpu_batches, cpu_batches):
    assert len(gpu_batches) == len(cpu_batches)
    for g, (ex, ey) in zip(gpu_batches, cpu_batches):
        x, y = host(g)
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def warm_up_conversion(loader):
    """Compile the uint->int64 conversion kernel outside a timed region."""
    cp = cupy()
    split_window(cp.zeros(loader.tokens_per_batch + 1, dtype=loader.token_dtype), loader.batch_size, loader.seq_len)
    rt().synchronize()


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "sync-fallback"])
@pytest.mark.parametrize("world_size,shuffle,vocab", [(1, False, 60000), (2, True, 60000), (1, True, 100000)])
def test_cuda_batches_equal_cpu_batches_over_several_wraps(tmp_path, pinned, world_size, shuffle, vocab):
    rng = np.random.default_rng()
    B, T = 3, 32
    sizes = [int(n) for n in rng.integers(B * T * world_size + 1, 1500, size=3)]
    make_shards(tmp_path, sizes, rng, vocab=vocab)  # vocab 100000: uint32 shards
    steps = 3 * sum(n // (B * T * world_size) for n in sizes) + 3  # past three epochs
    for rank in range(world_size):
        kw = dict(batch_size=B, seq_len=T, rank=rank, world_size=world_size, shuffle=shuffle, seed=3)
        gpu = ShardLoader(tmp_path, device="cuda", pinned=pinned, **kw)
        cpu = ShardLoader(tmp_path, **kw)
        assert gpu.pinned is pinned
        got, want = [], []
        for _ in range(steps):
            got.append(gpu.next_batch())
            want.append(cpu.next_batch())
            assert gpu.state_dict() == cpu.state_dict()
        # checked only now: batches kept by the caller are not overwritten by later staging
        assert_same(got, want)
        gpu.reset()
        cpu.reset()
        assert_same(take(gpu, 5), take(cpu, 5))
        gpu.close()


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "sync-fallback"])
def test_a_restored_cuda_loader_yields_the_batches_of_one_that_never_stopped(tmp_path, pinned):
    rng = np.random.default_rng()
    make_shards(tmp_path, [int(n) for n in rng.integers(300, 900, size=4)], rng)
    kw = dict(batch_size=2, seq_len=24, rank=1, world_size=2, shuffle=True, seed=11)
    running = ShardLoader(tmp_path, device="cuda", pinned=pinned, **kw)
    reference = ShardLoader(tmp_path, **kw)
    for gap in (0, 1, 7, 16, 30):  # stops across shard and epoch boundaries, a batch always staged ahead
        take(running, gap)
        take(reference, gap)
        state = json.loads(json.dumps(running.state_dict()))
        assert state == reference.state_dict()
        restored = ShardLoader(tmp_path, device="cuda", pinned=pinned, **kw)
        restored.load_state_dict(state)
        on_cpu = ShardLoader(tmp_path, **kw)
        on_cpu.load_state_dict(state)
        want = take(reference, 17)
        assert_same(take(running, 17), want)
        assert_same(take(restored, 17), want)
        for (x, y), (ex, ey) in zip(take(on_cpu, 17), want):  # a CPU loader resumes from it too
            np.testing.assert_array_equal(x, ex)
            np.testing.assert_array_equal(y, ey)


def test_no_pinned_memory_falls_back_with_one_warning_and_the_same_batches(tmp_path, monkeypatch):
    from kiln.backend import get_backend
    rng = np.random.default_rng()
    make_shards(tmp_path, [800, 900], rng)

    def refuse(shape, dtype):
        raise RuntimeError("cudaErrorMemoryAllocation: out of memory (pinned)")

    monkeypatch.setattr(get_backend("cuda"), "pinned_empty", refuse)
    with pytest.warns(RuntimeWarning, match="pinned host memory.*cannot be had.*copied synchronously") as record:
        gpu = ShardLoader(tmp_path, batch_size=4, seq_len=16, device="cuda")
    assert len(record) == 1 and not gpu.pinned
    cpu = ShardLoader(tmp_path, batch_size=4, seq_len=16)
    n = 2 * (800 // 64 + 900 // 64)
    assert_same(take(gpu, n), take(cpu, n))


def test_the_copy_runs_on_its_own_stream_and_compute_waits_for_its_event(tmp_path):
    rng = np.random.default_rng()
    make_shards(tmp_path, [5000, 5000], rng)
    kw = dict(batch_size=4, seq_len=128)
    gpu, cpu = ShardLoader(tmp_path, device="cuda", **kw), ShardLoader(tmp_path, **kw)
    assert gpu.pinned
    st = gpu._staging
    compute = rt().stream()
    assert st.copy_stream.ptr not in (0, compute.ptr)  # neither the legacy null stream nor kiln's
    runtime = cupy().cuda.runtime
    for h, d in zip(st.host, st.dev):  # page-locked host buffers, device buffers kept for the loader's life
        assert runtime.pointerGetAttributes(h.ctypes.data).type == runtime.memoryTypeHost
        assert runtime.pointerGetAttributes(d.data.ptr).type == runtime.memoryTypeDevice
    warm_up_conversion(gpu)
    spin(st.copy_stream, 1.0)  # the copy stream is busy: batch 0 lands only after a second
    t0 = time.perf_counter()
    batch = gpu.next_batch()
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"next_batch waited {elapsed:.3f} s for the copy stream"
    assert not st.copied[0].done  # the copy is queued behind the spin on the copy stream
    # the compute stream waited for the copy event: the batch is right, not the buffer's old bytes
    assert_same([batch], take(cpu, 1))
    assert st.copied[0].done


def test_the_next_copy_overlaps_compute_and_never_overwrites_a_buffer_in_use(tmp_path):
    rng = np.random.default_rng()
    make_shards(tmp_path, [5000, 5000], rng)
    kw = dict(batch_size=4, seq_len=128)
    gpu, cpu = ShardLoader(tmp_path, device="cuda", **kw), ShardLoader(tmp_path, **kw)
    st = gpu._staging
    compute = rt().stream()
    warm_up_conversion(gpu)
    b0 = gpu.next_batch()  # took slot 0, staged batch 1 in slot 1
    compute.synchronize()
    st.copy_stream.synchronize()
    spin(compute, 1.0)     # a long "step" on kiln's stream
    t0 = time.perf_counter()
    b1 = gpu.next_batch()  # takes slot 1 (read after the spin); stages batch 2 in slot 0
    b2 = gpu.next_batch()  # takes slot 0; stages batch 3 in slot 1, which batch 1 still has to read
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"next_batch waited {elapsed:.3f} s on the compute stream"
    deadline = time.perf_counter() + 0.3
    while not st.copied[0].done and time.perf_counter() < deadline:
        time.sleep(0.001)
    # batch 2's copy landed while the compute stream was still spinning: the copy overlaps compute
    assert st.copied[0].done and not st.consumed[1].done
    # batch 3's copy waits for the compute stream to be done with slot 1 (the consumed event)
    assert not st.copied[1].done
    b3 = gpu.next_batch()
    assert_same([b0, b1, b2, b3], take(cpu, 4))


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["op-by-op", "graph"])
def test_the_trainer_trains_from_the_staged_loader_and_resumes_exactly(tmp_path, cuda_graph):
    from kiln.checkpoint import CheckpointFolder, load
    from kiln.train import TrainConfig, Trainer
    cfg = dict(model_overrides={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 32, "dropout": 0.0},
               batch_size=4, progress=False, eval_iters=2, sample_tokens=0, out_dir=str(tmp_path),
               cuda_graph=cuda_graph)
    gpu, cpu = Trainer(TrainConfig(**cfg, device="cuda")), Trainer(TrainConfig(**cfg, device="cpu"))
    assert gpu.train_loader.pinned and gpu.val_loader.pinned
    for loader in ("train_loader", "val_loader"):
        for _ in range(3):
            (gx, gy), (cx, cy) = gpu._batch(getattr(gpu, loader)), cpu._batch(getattr(cpu, loader))
            assert gx.device.type == "cuda" and gx.dtype == cx.dtype
            assert np.array_equal(gx.numpy(), cx.numpy()) and np.array_equal(gy.numpy(), cy.numpy())

    full = Trainer(TrainConfig(**dict(cfg, device="cuda", max_steps=8, eval_interval=3, checkpoint_interval=4,
                                      grad_accum=2), run_name="full"))
    full.fit()
    ck = CheckpointFolder(tmp_path / "full" / "checkpoints")
    stopped = stopped_run_folder(tmp_path / "full", 4, tmp_path / "stopped")
    resumed = Trainer.from_checkpoint(stopped)
    assert resumed.train_loader.pinned
    # the saved position is the next batch to train on: 4 steps x 2 micro-batches read
    reference = ShardLoader(full.data_dir, "train", batch_size=4, seq_len=32, seed=full.config.seed)
    take(reference, 8)
    assert load(ck.path_for(4))["loaders"]["train"] == reference.state_dict() == resumed.train_loader.state_dict()
    resumed.fit()

    def losses(run):
        return [json.loads(line)["loss"] for line in open(run / "metrics.jsonl")]
    np.testing.assert_allclose(losses(stopped), losses(tmp_path / "full"), rtol=1e-4)
    assert load(CheckpointFolder(stopped / "checkpoints").path_for(8))["loaders"] == load(ck.path_for(8))["loaders"]
