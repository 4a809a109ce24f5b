"""The backend's stream, event, pinned-memory and copy verbs (kiln.backend.{cpu,cuda}.streams): on
the CPU plain copies and host-clock events; on CUDA a high-priority side stream ordered against
kiln's stream by events only (what a communication stream needs, paper Algorithm 1)."""

import threading
import time
import types

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


class FakeCuPyStreams:
    """CuPy's per-thread current stream as cupy/cuda/stream.pyx (v14.2, _ThreadLocal) keeps it, for
    one device: `use()` sets the current stream and leaves the stack alone; `with stream:` pushes it,
    and its exit pops it and makes the stack's previous entry current (the null stream at the bottom).
    Enough of `cupy` for kiln.backend.cuda.device to make and choose its stream with no GPU."""

    class Stream:
        def __init__(self, owner, ptr=None, non_blocking=False):
            self.owner, self.ptr, self.non_blocking = owner, ptr if ptr is not None else id(self), non_blocking

        def use(self):
            self.owner.current = self
            return self

        def __enter__(self):
            self.owner.stack.append(self)
            self.owner.current = self
            return self

        def __exit__(self, *exc):
            self.owner.stack.pop()
            self.owner.current = self.owner.stack[-1]

    def __init__(self):
        self.null = self.Stream(self, ptr=0)
        self.current, self.stack = self.null, [self.null]
        self.cuda = types.SimpleNamespace(
            Stream=lambda non_blocking=False, priority=0: self.Stream(self, non_blocking=non_blocking),
            get_current_stream=lambda: self.current, runtime=types.SimpleNamespace(getDevice=lambda: 0))


def test_kilns_stream_stays_current_after_a_cupy_with_block(monkeypatch):
    """CuPy's `ndarray.get()` of a strided array (every to_host of a view: a CPU fallback's first
    step) runs `with current_stream:` inside. With kiln's stream made current by `use()` alone, that
    block's exit left the legacy null stream current, and CuPy's work until kiln's next launch (the
    fallback's upload of its results, the copies into the gradient's views) ran there, unordered with
    kiln's non-blocking stream: the H200 runs of 2026-12-05 with head dim 8 or 48 (CPU attention)
    lost bit-exactness (a resumed run, AdamW in backward) and once read an upload before it landed."""
    from kiln.backend.cuda import device as rt, streams
    cp = FakeCuPyStreams()
    monkeypatch.setattr(rt, "cupy", lambda: cp)
    monkeypatch.setattr(rt, "_streams", {})
    monkeypatch.setattr(rt, "_current", threading.local())
    monkeypatch.setenv("KILN_CUDA_ALLOCATOR", "cupy")  # no allocator to install on the fake
    other = cp.cuda.Stream(non_blocking=True)
    other.use()
    with other:
        pass
    assert cp.current is cp.null  # what CuPy does: use() alone does not survive a `with` block
    s = rt.stream()
    assert s.non_blocking and cp.current is s and s.ptr not in (0, other.ptr)
    with cp.cuda.get_current_stream():  # ndarray.get() of a strided array
        pass
    assert cp.current is s
    with other:  # a `with` block on another stream comes back to kiln's too
        pass
    assert cp.current is s
    other.use()  # something else makes its stream current: kiln's next call takes its own back
    assert rt.stream() is s and cp.current is s
    comm = streams.new_stream(high_priority=True)
    with streams.use_stream(comm):
        assert rt.stream() is comm and cp.current is comm
        with cp.cuda.get_current_stream():  # a strided get() inside the block stays on the block's stream
            pass
        assert cp.current is comm
    assert cp.current is s and rt.stream() is s
    with cp.cuda.get_current_stream():
        pass
    assert cp.current is s


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
def test_cuda_kilns_stream_stays_current_after_a_strided_copy_to_the_host_and_a_cpu_fallback():
    """The real CuPy of test_kilns_stream_stays_current_after_a_cupy_with_block: its `get()` of a
    strided view, and a CPU fallback (attention at head dim 48, inputs strided views of one qkv
    buffer), leave kiln's stream current, so the fallback's uploads are ordered with kiln's work."""
    be = cuda()
    import cupy as cp
    compute = be.stream()
    rng = np.random.default_rng()
    x = be.asarray(rng.standard_normal((6, 8)).astype(np.float32))
    np.testing.assert_array_equal(be.to_numpy(x.T), be.to_numpy(x).T)
    assert cp.cuda.get_current_stream().ptr == compute.ptr != 0
    qkv = be.asarray(rng.standard_normal((1, 40, 3, 2, 48)).astype(np.float32))
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    with pytest.warns(RuntimeWarning, match="runs on the CPU"):
        out, lse = be.attention_fwd(q, k, v, 48 ** -0.5)
    assert cp.cuda.get_current_stream().ptr == compute.ptr
    want, want_lse = get_backend("cpu").attention_fwd(*(be.to_numpy(a) for a in (q, k, v)), 48 ** -0.5)
    np.testing.assert_array_equal(be.to_numpy(out), want)
    np.testing.assert_array_equal(be.to_numpy(lse), want_lse)


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
