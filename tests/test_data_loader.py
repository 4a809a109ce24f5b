"""ShardLoader: batches against a reference walk of the shards, rank striding, shuffling, exact resume."""

import json
import struct

import numpy as np
import pytest

import kiln
from kiln.data.loader import ShardLoader
from kiln.data.shards import write_shard
from kiln.errors import ConfigError, DataError, DeviceError


def make_shards(folder, sizes, rng, vocab=60000, meta=True):
    """Shards of a random permutation of 0..sum(sizes)-1: random tokens that are all distinct."""
    stream = rng.permutation(sum(sizes))
    assert stream.max() < vocab
    shards, start = [], 0
    for i, n in enumerate(sizes):
        shards.append(stream[start:start + n])
        write_shard(folder / f"train_{i:06d}.bin", shards[-1], vocab)
        start += n
    if meta:
        names = [f"train_{i:06d}.bin" for i in range(len(sizes))]
        (folder / "meta.json").write_text(json.dumps(
            {"vocab_size": vocab, "splits": {"train": {"tokens": sum(sizes), "shards": names}}}))
    return shards


def reference_batches(shards, orders, B, T):
    """Every full B*T+1 window at offsets 0, BT, 2BT... of each shard, in each epoch's shard order."""
    bt = B * T
    for order in orders:
        for s in order:
            tokens = shards[s]
            for p in range(0, len(tokens) - bt, bt):
                yield tokens[p:p + bt].reshape(B, T), tokens[p + 1:p + bt + 1].reshape(B, T)


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_batches_follow_the_shards_in_sorted_order_and_wrap(tmp_path):
    rng = np.random.default_rng()
    sizes = [int(n) for n in rng.integers(700, 1600, size=3)]
    shards = make_shards(tmp_path, sizes, rng)
    loader = ShardLoader(tmp_path, batch_size=4, seq_len=32)
    assert loader.vocab_size == 60000 and loader.tokens_per_batch == 128
    expected = list(reference_batches(shards, [[0, 1, 2]] * 3, 4, 32))
    got = take(loader, len(expected))
    for (x, y), (ex, ey) in zip(got, expected):
        assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == (4, 32)
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)
    loader.reset()
    np.testing.assert_array_equal(loader.next_batch()[0], expected[0][0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_w_ranks_see_exactly_what_one_rank_with_a_w_times_batch_sees(tmp_path, world_size):
    rng = np.random.default_rng()
    B, T = 2, 16
    sizes = [int(n) for n in rng.integers(B * T * world_size + 1, 700, size=4)]
    make_shards(tmp_path, sizes, rng)
    ranks = [ShardLoader(tmp_path, batch_size=B, seq_len=T, rank=r, world_size=world_size, shuffle=True, seed=7)
             for r in range(world_size)]
    single = ShardLoader(tmp_path, batch_size=B * world_size, seq_len=T, shuffle=True, seed=7)
    steps = 3 * sum(n // (B * T * world_size) for n in sizes)  # about three epochs
    for _ in range(steps):
        parts = [loader.next_batch() for loader in ranks]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        sx, sy = single.next_batch()
        np.testing.assert_array_equal(x, sx)
        np.testing.assert_array_equal(y, sy)
        assert len(np.unique(x)) == x.size  # the shard tokens are distinct, so no rank reads another's row
    assert len({json.dumps(loader.state_dict()) for loader in ranks}) == 1  # one state for every rank


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path):
    rng = np.random.default_rng()
    sizes = [200] * 6
    shards = make_shards(tmp_path, sizes, rng)
    first = {int(s[0]): i for i, s in enumerate(shards)}  # shard index from its first token

    def epoch_orders(seed, epochs=4):
        loader = ShardLoader(tmp_path, batch_size=1, seq_len=100, shuffle=True, seed=seed)
        # 200 tokens give one step of 101 tokens each: one batch per shard
        return [[first[int(loader.next_batch()[0][0, 0])] for _ in range(6)] for _ in range(epochs)]

    orders = epoch_orders(seed=3)
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert orders == epoch_orders(seed=3)
    assert orders != epoch_orders(seed=4)
    assert len({tuple(o) for o in orders}) > 1  # a new order each epoch
    expected = reference_batches(shards, orders, 1, 100)
    loader = ShardLoader(tmp_path, batch_size=1, seq_len=100, shuffle=True, seed=3)
    for ex, _ in list(expected)[:24]:
        np.testing.assert_array_equal(loader.next_batch()[0], ex)


def test_restored_loader_yields_the_batches_of_one_that_never_stopped(tmp_path):
    rng = np.random.default_rng()
    make_shards(tmp_path, [int(n) for n in rng.integers(300, 900, size=5)], rng)
    kwargs = dict(batch_size=2, seq_len=24, rank=1, world_size=2, shuffle=True, seed=11)
    running = ShardLoader(tmp_path, **kwargs)
    for gap in (0, 7, 16, 30):  # stops across shard and epoch boundaries
        take(running, gap)
        state = json.loads(json.dumps(running.state_dict()))
        restored = ShardLoader(tmp_path, **kwargs)
        restored.load_state_dict(state)
        for (x, y), (rx, ry) in zip(take(running, 17), take(restored, 17)):
            np.testing.assert_array_equal(x, rx)
            np.testing.assert_array_equal(y, ry)


def test_state_from_a_different_loader_is_refused(tmp_path):
    make_shards(tmp_path, [1000, 1000], np.random.default_rng())
    state = ShardLoader(tmp_path, batch_size=4, seq_len=16).state_dict()
    with pytest.raises(DataError, match="tokens_per_step=64; this loader has tokens_per_step=128"):
        ShardLoader(tmp_path, batch_size=8, seq_len=16).load_state_dict(state)
    with pytest.raises(DataError, match="shuffle"):
        ShardLoader(tmp_path, batch_size=4, seq_len=16, shuffle=True).load_state_dict(state)
    with pytest.raises(DataError, match="position=5 is not a step"):
        ShardLoader(tmp_path, batch_size=4, seq_len=16).load_state_dict(state | {"position": 5})


def test_llmc_shards_load_by_glob(tmp_path):
    rng = np.random.default_rng()
    streams = [rng.integers(0, 50257, size=600).tolist() for _ in range(2)]
    for i, tokens in enumerate(streams):  # written with struct alone, as llm.c's data_common.py does
        header = struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253))
        (tmp_path / f"fineweb_train_{i:06d}.bin").write_bytes(header + struct.pack("<600H", *tokens))
    loader = ShardLoader(str(tmp_path / "fineweb_train_*.bin"), batch_size=3, seq_len=50)
    assert loader.vocab_size is None
    x, y = loader.next_batch()
    np.testing.assert_array_equal(x.ravel(), streams[0][:150])
    np.testing.assert_array_equal(y.ravel(), streams[0][1:151])
    assert ShardLoader(tmp_path, batch_size=3, seq_len=50).paths == loader.paths  # folder: *train*.bin


def test_token_outside_the_vocabulary_raises_naming_the_shard(tmp_path):
    rng = np.random.default_rng()
    make_shards(tmp_path, [500, 500], rng)
    tokens = rng.integers(0, 100, size=500)
    tokens[321] = 60001
    write_shard(tmp_path / "train_000001.bin", tokens)
    with pytest.raises(DataError, match=r"train_000001.bin: token 60001 at position 321 is outside the vocabulary 0..59999"):
        ShardLoader(tmp_path, batch_size=2, seq_len=50)  # found when the data is opened, before any batch


def test_shard_smaller_than_one_step_raises(tmp_path):
    make_shards(tmp_path, [1000, 128], np.random.default_rng())
    with pytest.raises(DataError, match=r"train_000001.bin: holds 128 tokens, fewer than the 129 of one step"):
        ShardLoader(tmp_path, batch_size=2, seq_len=32, world_size=2)
    ShardLoader(tmp_path, batch_size=1, seq_len=127)  # 128 tokens do hold a step of 127 + 1


def test_missing_or_damaged_shards_raise(tmp_path):
    make_shards(tmp_path, [400, 400], np.random.default_rng())
    with pytest.raises(DataError, match="lists no 'val' shards"):
        ShardLoader(tmp_path, split="val", batch_size=1, seq_len=8)
    with pytest.raises(DataError, match="no 'train' shards found"):
        ShardLoader(str(tmp_path / "nothing_*.bin"), batch_size=1, seq_len=8)
    (tmp_path / "train_000001.bin").write_bytes((tmp_path / "train_000001.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match="train_000001.bin: truncated"):
        ShardLoader(tmp_path, batch_size=1, seq_len=8)
    (tmp_path / "train_000001.bin").unlink()
    with pytest.raises(DataError, match="train_000001.bin: no such shard file"):
        ShardLoader(tmp_path, batch_size=1, seq_len=8)


def test_bad_arguments(tmp_path):
    make_shards(tmp_path, [400], np.random.default_rng())
    if not kiln.cuda_is_available():
        with pytest.raises(DeviceError, match="CuPy|CUDA"):
            ShardLoader(tmp_path, batch_size=1, seq_len=8, device="cuda")
    with pytest.raises(DeviceError, match="'tpu'"):
        ShardLoader(tmp_path, batch_size=1, seq_len=8, device="tpu")
    with pytest.raises(ConfigError, match=r"rank=2\): must be in 0..1"):
        ShardLoader(tmp_path, batch_size=1, seq_len=8, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="batch_size=0"):
        ShardLoader(tmp_path, batch_size=0, seq_len=8)
