"""The backend's stream, event, pinned-memory and copy verbs (kiln.backend.{cpu,cuda}.streams): on
the CPU plain copies and host-clock events; on CUDA a high-priority side stream ordered against
kiln's stream by events only (what a communication stream needs, paper Algorithm 1)."""

import time

import numpy as np
import pytest

import kiln
from kiln.backend import get_backend

VERBS = ("stream", "new_stream", "use_stream", "event", "elapsed_ms", "pinned_empty", "copy_async", "on_device")


def test_the_cpu_verbs_copy_and_time_on_the_host():
    cpu = get_backend("cpu")
    rng = np.random.default_rng()
    src = rng.standard_normal((3, 5)).astype(np.float32)
    dst = cpu.pinned_empty(src.shape, src.dtype)
    side = cpu.new_stream(high_priority=True)
    start, end = cpu.event(timing=True), cpu.event(timing=True)
    start.record(cpu.stream())
    with cpu.on_device(0), cpu.use_stream(side) as s:
        assert s is side
        cpu.copy_async(dst, src, side)
    time.sleep(0.02)
    end.record(side)
    side.wait_event(end)
    end.synchronize()
    assert end.done
    np.testing.assert_array_equal(dst, src)
    assert 15.0 < cpu.elapsed_ms(start, end) < 2000.0
    with pytest.raises(ValueError, match="timing events"):
        cpu.elapsed_ms(cpu.event(), end)


def cuda():
    if not kiln.cuda_is_available():
        pytest.skip("needs an NVIDIA GPU and CuPy")
    return get_backend("cuda")


@pytest.mark.cuda
def test_cuda_copies_round_trip_through_pinned_memory():
    be = cuda()
    rng = np.random.default_rng()
    host = rng.standard_normal((257, 33)).astype(np.float32)
    pinned = be.pinned_empty(host.shape, host.dtype)
    pinned[...] = host
    dev, dev2 = be.empty(host.shape, host.dtype), be.empty(host.shape, host.dtype)
    side = be.new_stream()
    be.copy_async(dev, pinned, side)          # host -> device on the side stream
    landed = be.event()
    landed.record(side)
    be.stream().wait_event(landed)           # kiln's stream reads it only once it has landed
    be.copy_async(dev2, dev)                 # device -> device on kiln's stream
    back = be.pinned_empty(host.shape, host.dtype)
    be.copy_async(back, dev2 * 2)            # device -> host
    be.synchronize()
    np.testing.assert_array_equal(back, 2 * host)


@pytest.mark.cuda
def test_cuda_use_stream_runs_kiln_kernels_on_a_high_priority_stream_ordered_by_events():
    be = cuda()
    import cupy as cp
    compute = be.stream()
    comm = be.new_stream(high_priority=True)
    assert comm.ptr not in (0, compute.ptr)
    assert comm.priority < compute.priority == 0  # lower numbers are scheduled first
    rng = np.random.default_rng()
    x = be.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    ready = be.event()
    ready.record(compute)
    with be.use_stream(comm):
        comm.wait_event(ready)
        assert be.stream() is comm and cp.cuda.get_current_stream().ptr == comm.ptr
        y = be.gelu_fwd(x)                   # a kiln kernel, launched on the side stream
        done = be.event()
        done.record(comm)
    assert be.stream() is compute and cp.cuda.get_current_stream().ptr == compute.ptr
    compute.wait_event(done)
    want = get_backend("cpu").gelu_fwd(be.to_numpy(x))
    np.testing.assert_allclose(be.to_numpy(y), want, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cuda_timing_events_measure_device_time():
    be = cuda()
    start, end = be.event(timing=True), be.event(timing=True)
    a = be.asarray(np.random.default_rng().standard_normal((2048, 2048)).astype(np.float32))
    start.record(be.stream())
    for _ in range(5):
        be.matmul(a, a)
    end.record(be.stream())
    assert be.elapsed_ms(start, end) > 0.0


def test_both_backends_have_the_verbs():
    from kiln.backend import (
        cpu,
        cuda as gpu,  # imports without a GPU
    )
    for verb in VERBS:
        assert callable(getattr(cpu, verb)) and callable(getattr(gpu, verb)), verb
