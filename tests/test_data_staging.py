"""The staged (CUDA) loader's bookkeeping on the CPU: Algorithm 2's prefetch order, the saved
position of a loader that has a batch staged ahead, errors at the same batch as the CPU loader,
and the choice of the synchronous fallback. A NumPy stand-in plays the staging engine; the real
engines run on the device in tests/test_data_staging_cuda.py."""

import json
import warnings

import numpy as np
import pytest

from kiln.data.loader import ShardLoader
from kiln.data.staging import split_window
from tests.test_data_loader import make_shards, take


class HostStaging:
    """A staging engine on the host that checks the protocol: a slot is taken once, after its put,
    and holds a copy of the window made at put time (as the pinned copy does)."""

    synchronous = False

    def __init__(self, batch_size, seq_len):
        self.shape = (batch_size, seq_len)
        self.slots = [None, None]
        self.log = []

    def put(self, slot, window):
        self.log.append(("put", slot))
        self.slots[slot] = np.array(window)

    def take(self, slot):
        self.log.append(("take", slot))
        assert self.slots[slot] is not None, f"slot {slot} taken without a batch staged in it"
        window, self.slots[slot] = self.slots[slot], None
        return split_window(window, *self.shape)


def staged(loader):
    """The loader, switched to the staged path with a HostStaging engine."""
    loader._staging = HostStaging(loader.batch_size, loader.seq_len)
    loader.reset()
    return loader


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for (x, y), (ex, ey) in zip(a, b):
        assert x.dtype == ex.dtype == np.int64 and x.shape == ex.shape
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


def test_split_window_is_the_cpu_batch():
    rng = np.random.default_rng()
    window = rng.integers(0, 60000, size=3 * 7 + 1).astype(np.uint16)
    x, y = split_window(window, 3, 7)
    assert x.dtype == np.int64 and x.shape == (3, 7)
    np.testing.assert_array_equal(x.ravel(), window[:-1])
    np.testing.assert_array_equal(y.ravel(), window[1:])


@pytest.mark.parametrize("world_size,shuffle", [(1, False), (3, True)])
def test_staged_batches_equal_the_cpu_loader_over_several_wraps(tmp_path, world_size, shuffle):
    rng = np.random.default_rng()
    B, T = 2, 16
    sizes = [int(n) for n in rng.integers(B * T * world_size + 1, 600, size=3)]
    make_shards(tmp_path, sizes, rng)
    steps = 3 * sum(n // (B * T * world_size) for n in sizes) + 5  # past three epochs
    for rank in range(world_size):
        kw = dict(batch_size=B, seq_len=T, rank=rank, world_size=world_size, shuffle=shuffle, seed=5)
        cpu, loader = ShardLoader(tmp_path, **kw), staged(ShardLoader(tmp_path, **kw))
        for _ in range(steps):
            assert_same_batches([loader.next_batch()], [cpu.next_batch()])
            assert loader.state_dict() == cpu.state_dict()  # the next batch returned, not the one staged


def test_next_batch_takes_one_slot_and_stages_the_next_in_the_other(tmp_path):
    make_shards(tmp_path, [500, 500], np.random.default_rng())
    loader = staged(ShardLoader(tmp_path, batch_size=2, seq_len=8))
    take(loader, 4)
    log = loader._staging.log
    # Algorithm 2: batch i+1 is staged right after batch i is taken, alternating buffers
    assert log == [("put", 0), ("take", 0), ("put", 1), ("take", 1), ("put", 0), ("take", 0),
                   ("put", 1), ("take", 1), ("put", 0)]


def test_restoring_a_staged_loader_resumes_exactly_both_ways(tmp_path):
    rng = np.random.default_rng()
    make_shards(tmp_path, [int(n) for n in rng.integers(300, 900, size=4)], rng)
    kw = dict(batch_size=2, seq_len=24, rank=1, world_size=2, shuffle=True, seed=11)
    running = staged(ShardLoader(tmp_path, **kw))
    reference = ShardLoader(tmp_path, **kw)
    for gap in (0, 1, 6, 13, 25):  # across shard and epoch boundaries
        take(running, gap)
        take(reference, gap)
        state = json.loads(json.dumps(running.state_dict()))
        assert state == reference.state_dict()
        into_cpu, into_staged = ShardLoader(tmp_path, **kw), staged(ShardLoader(tmp_path, **kw))
        into_cpu.load_state_dict(state)
        into_staged.load_state_dict(state)
        ahead = take(reference, 9)
        assert_same_batches(take(running, 9), ahead)
        assert_same_batches(take(into_cpu, 9), ahead)
        assert_same_batches(take(into_staged, 9), ahead)


def test_reset_and_load_drop_the_batch_staged_ahead(tmp_path):
    make_shards(tmp_path, [700, 700], np.random.default_rng())
    loader = staged(ShardLoader(tmp_path, batch_size=2, seq_len=16))
    first = take(loader, 3)
    loader.reset()
    assert loader.state_dict()["position"] == 0 and loader.state_dict()["shard"] == 0
    assert_same_batches(take(loader, 3), first)
    state = loader.state_dict()
    later = take(loader, 5)
    loader.load_state_dict(state)
    assert_same_batches(take(loader, 5), later)


def test_a_data_error_raises_at_the_same_batch_as_on_the_cpu(tmp_path):
    make_shards(tmp_path, [500, 500], np.random.default_rng())

    def batches_before_the_error(loader):
        n = 0
        with pytest.raises(Exception) as info:
            for _ in range(10):
                loader.next_batch()
                n += 1
        return n, str(info.value)

    kw = dict(batch_size=2, seq_len=50)
    loaders = ShardLoader(tmp_path, **kw), staged(ShardLoader(tmp_path, **kw))
    (tmp_path / "train_000001.bin").write_bytes(b"")  # damaged after the loaders opened (and checked) it
    cpu = batches_before_the_error(loaders[0])
    assert cpu[0] == 3 and "train_000001.bin: the shard file is empty" in cpu[1]
    assert batches_before_the_error(loaders[1]) == cpu


class FakeBackend:
    """Just enough of a device backend's stream verbs for the staging engines, logging each stream
    operation in issue order: (stream, "copy"/"wait"/"record", what) and ("host", "sync", event)."""

    def __init__(self):
        self.log = []
        self.compute = FakeStream(self, "compute")
        self._events = iter(["copied0", "copied1", "consumed0", "consumed1"])

    def on_device(self, index):
        import contextlib
        return contextlib.nullcontext()

    def stream(self):
        return self.compute

    def new_stream(self, high_priority=False):
        return FakeStream(self, "copy")

    def event(self, timing=False):
        return FakeEvent(self, next(self._events))

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def empty(self, shape, dtype):
        return FakeDeviceArray(np.empty(shape, dtype))

    def copy_async(self, dst, src, stream):
        assert isinstance(dst, FakeDeviceArray) and type(src) is np.ndarray
        assert src.dtype == dst.dtype and src.shape == dst.shape
        self.log.append((stream.name, "copy", "slot"))
        dst[...] = src


class FakeStream:
    def __init__(self, fake, name):
        self.fake, self.name = fake, name

    def wait_event(self, event):
        self.fake.log.append((self.name, "wait", event.name))

    def synchronize(self):
        self.fake.log.append(("host", "sync", self.name))


class FakeEvent:
    def __init__(self, fake, name):
        self.fake, self.name = fake, name

    def record(self, stream):
        self.fake.log.append((stream.name, "record", self.name))

    def synchronize(self):
        self.fake.log.append(("host", "sync", self.name))


class FakeDeviceArray(np.ndarray):
    """A "device" array: copy_async checks that the engines copy into these from host arrays."""

    def __new__(cls, array):
        return array.view(cls)


@pytest.fixture
def fake_cuda():
    from kiln.data import staging
    return staging, FakeBackend()


def test_pinned_staging_orders_its_copies_with_the_two_events_of_algorithm_2(tmp_path, fake_cuda):
    staging, fake = fake_cuda
    make_shards(tmp_path, [900, 900], np.random.default_rng())
    kw = dict(batch_size=2, seq_len=16)
    loader, cpu = ShardLoader(tmp_path, **kw), ShardLoader(tmp_path, **kw)
    loader._staging = staging.PinnedStaging(33, loader.token_dtype, 2, 16, fake)
    assert loader.pinned
    fake.log.clear()
    assert_same_batches(take(loader, 3), take(cpu, 3))
    c, k = "compute", "copy"
    assert fake.log == [
        (k, "copy", "slot"), (k, "record", "copied0"),                          # batch 0 -> slot 0
        (c, "wait", "copied0"), (c, "record", "consumed0"),                     # take batch 0
        (k, "copy", "slot"), (k, "record", "copied1"),                          # batch 1 -> slot 1
        (c, "wait", "copied1"), (c, "record", "consumed1"),                     # take batch 1
        ("host", "sync", "copied0"), (k, "wait", "consumed0"),                  # slot 0 free on host and device
        (k, "copy", "slot"), (k, "record", "copied0"),                          # batch 2 -> slot 0
        (c, "wait", "copied0"), (c, "record", "consumed0"),                     # take batch 2
        ("host", "sync", "copied1"), (k, "wait", "consumed1"),
        (k, "copy", "slot"), (k, "record", "copied1"),                          # batch 3 -> slot 1
    ]
    loader.close()
    assert fake.log[-1] == ("host", "sync", "copy")  # nothing in flight when the buffers go


def test_the_synchronous_fallback_copies_on_the_compute_stream_only(tmp_path, fake_cuda):
    staging, fake = fake_cuda
    make_shards(tmp_path, [900, 900], np.random.default_rng())
    kw = dict(batch_size=2, seq_len=16)
    loader, cpu = ShardLoader(tmp_path, **kw), ShardLoader(tmp_path, **kw)
    loader._staging = staging.open_staging(33, loader.token_dtype, 2, 16, fake, pinned=False)
    assert not loader.pinned
    n = 2 * (900 // 32) + 3  # past a wrap
    assert_same_batches(take(loader, n), take(cpu, n))
    assert fake.log == [("compute", "copy", "slot")] * n


def test_the_fallback_is_chosen_and_said_once_when_pinned_memory_cannot_be_had(tmp_path, fake_cuda, monkeypatch):
    staging, fake = fake_cuda

    def refuse(shape, dtype):
        raise MemoryError("cudaErrorMemoryAllocation: out of memory")

    monkeypatch.setattr(fake, "pinned_empty", refuse)
    make_shards(tmp_path, [900, 900], np.random.default_rng())
    kw = dict(batch_size=2, seq_len=16)
    loader, cpu = ShardLoader(tmp_path, **kw), ShardLoader(tmp_path, **kw)
    with pytest.warns(RuntimeWarning, match=r"ShardLoader\('train'\): pinned host memory for 2 x 33 tokens "
                                            r"cannot be had \(MemoryError: cudaErrorMemoryAllocation.*copied "
                                            "synchronously") as record:
        loader._staging = staging.open_staging(33, loader.token_dtype, 2, 16, fake, what="ShardLoader('train')")
    assert len(record) == 1 and isinstance(loader._staging, staging.SyncStaging) and not loader.pinned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n = 2 * (900 // 32) + 3
        assert_same_batches(take(loader, n), take(cpu, n))  # no further word, the same batches
        assert isinstance(staging.open_staging(33, np.uint16, 2, 16, fake, pinned=False), staging.SyncStaging)


def test_errors_other_than_pinned_memory_are_not_hidden_by_the_fallback(fake_cuda, monkeypatch):
    staging, fake = fake_cuda

    def broken(*args, **kwargs):
        raise ValueError("a device fault")

    monkeypatch.setattr(fake, "empty", broken)
    with pytest.raises(ValueError, match="a device fault"):
        staging.open_staging(33, np.uint16, 2, 16, fake)


@pytest.mark.parametrize("pinned", [True, False])
def test_the_staging_engines_on_the_cpu_backend_give_the_cpu_loaders_batches(tmp_path, pinned):
    """The engines are written with backend verbs only, so the CPU backend's (plain copies, no-op
    streams and events) runs them: the same batches as the unstaged loader, past a shard wrap."""
    from kiln.backend import get_backend
    from kiln.data import staging
    make_shards(tmp_path, [900, 700], np.random.default_rng())
    kw = dict(batch_size=2, seq_len=16)
    loader, cpu = ShardLoader(tmp_path, **kw), ShardLoader(tmp_path, **kw)
    loader._staging = staging.open_staging(33, loader.token_dtype, 2, 16, get_backend("cpu"), pinned=pinned)
    assert loader.pinned == pinned
    n = 900 // 32 + 700 // 32 + 5
    assert_same_batches(take(loader, n), take(cpu, n))
