"""`ShardLoader`: training batches read from memory-mapped token shards (paper, Algorithm 2)."""

import glob
import json
from pathlib import Path

import numpy as np

from kiln.backend import device as parse_device
from kiln.data.shards import META_FILE, open_shard, read_header
from kiln.data.staging import open_staging, split_window
from kiln.errors import ConfigError, DataError
from kiln.paths import file_inside


def read_meta(folder) -> dict | None:
    """A data folder's meta.json, checked (an object; `splits` maps each split to its list of shard
    names; the vocabulary sizes are positive integers), or None when the folder has none."""
    file = Path(folder) / META_FILE
    if not file.is_file():
        return None
    try:
        meta = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as e:
        raise DataError(f"{file}: not a readable meta.json: {e.strerror or e}") from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DataError(f"{file}: not UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{file}: holds a {type(meta).__name__}, not an object as `kiln prepare` writes")
    splits = meta.get("splits", {})
    if not isinstance(splits, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("shards"), list)
            and all(isinstance(n, str) for n in v["shards"]) for v in splits.values()):
        raise DataError(f"{file}: 'splits' must map train and val to their shards "
                        f'({{"train": {{"shards": ["train_000000.bin", ...]}}, ...}}), got {splits!r:.200}')
    for key in ("vocab_size", "padded_vocab_size"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DataError(f"{file}: {key} must be a positive integer, got {value!r}")
    return meta


def _shard_paths(path, split: str) -> tuple[list[Path], dict]:
    """The shards of `split` and the dataset's meta.json (or {}) for a folder, a glob or a list."""
    if isinstance(path, (list, tuple)):
        paths = [Path(p) for p in path]
    elif Path(path).is_dir():
        folder = Path(path)
        meta = read_meta(folder)
        if meta is not None:
            names = meta.get("splits", {}).get(split, {}).get("shards", [])
            if not names:
                raise DataError(f"{folder}: {META_FILE} lists no {split!r} shards; it has "
                                f"{sorted(meta.get('splits', {}))}")
            return sorted(file_inside(folder, name, f"{folder / META_FILE}") for name in names), meta
        paths = sorted(folder.glob(f"*{split}*.bin"))  # llm.c names: fineweb_train_000001.bin
    else:
        paths = [Path(p) for p in sorted(glob.glob(str(path)))]
    if not paths:
        raise DataError(f"{path}: no {split!r} shards found (a folder of *{split}*.bin, a glob or a list)")
    return sorted(paths), read_meta(paths[0].parent) or {}


class ShardLoader:
    """Batches (x, y) of B x T tokens from sorted, memory-mapped shards; y is x shifted by one.

    The cursor follows Algorithm 2 of the paper: rank r of W reads B·T+1 tokens at pos + B·T·r and
    pos steps by B·T·W, so W ranks with batch B together read exactly the rows that one rank with
    batch W·B reads, in rank order, with no overlap. Unlike Algorithm 2 (line 25 tests the rank's own
    offset, so rank W-1 can leave a shard one step before rank 0), pos here is the step's offset, the
    same on every rank, and all ranks move to the next shard together when a further step would not
    fit; the tokens after a shard's last full step are not read. Shards are read in sorted order;
    with `shuffle`, each epoch's order is a permutation drawn from (seed, epoch), the same on every
    rank. So `state_dict` is the same on every rank, and restoring it resumes exactly.

    On `device="cuda"` batches come as CuPy arrays, equal to the CPU ones bit for bit, staged as
    Algorithm 2 stages them (kiln.data.staging): while batch i trains, batch i+1 is copied from
    pinned memory on a copy stream; `state_dict` names the batch the next call returns, not the
    one staged ahead. `pinned=False` (or pinned memory that cannot be had, with a warning) copies
    each batch synchronously on the compute stream instead, with the same batches.
    """

    def __init__(self, path, split: str = "train", *, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, device="cpu", shuffle: bool = False,
                 pinned: bool = True, vocab_size: int | None = None):
        self.device = parse_device(device)  # a DeviceError names a bad device
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"ShardLoader({name}={value!r}): must be a positive integer")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ConfigError(f"ShardLoader(rank={rank!r}): must be in 0..{world_size - 1} for world_size={world_size}")
        self.paths, meta = _shard_paths(path, split)
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.vocab_size: int | None = vocab_size or meta.get("vocab_size")  # every token id is below it
        self._step = batch_size * seq_len * world_size
        headers = [read_header(p) for p in self.paths]
        self._sizes = [h.num_tokens for h in headers]
        self.token_dtype = np.result_type(*(h.dtype for h in headers))  # what the staging buffers hold
        for p, n in zip(self.paths, self._sizes):
            if n < self._step + 1:
                raise DataError(f"{p}: holds {n} tokens, fewer than the {self._step + 1} of one step "
                                f"(world_size {world_size} x batch_size {batch_size} x seq_len {seq_len}, +1)")
        if self.vocab_size is not None:  # every shard, now: one pass over each memory map
            for path in self.paths:
                _check_tokens(path, self.vocab_size)
        self._staging = None        # CUDA: a kiln.data.staging engine
        self._ahead = None          # CUDA: (slot, position) of the batch staged ahead
        self._ahead_error = None    # CUDA: an error of the step past the staged batch, raised in turn
        self._slot = 0
        backend = self.device.backend  # raises a DeviceError naming what is missing for cuda
        if not backend.host_memory:
            self._staging = open_staging(self.tokens_per_batch + 1, self.token_dtype, batch_size, seq_len,
                                         backend, self.device.index, pinned=pinned,
                                         what=f"ShardLoader({split!r}, device={str(self.device)!r})")
        self.reset()

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one rank's x: batch_size x seq_len."""
        return self.batch_size * self.seq_len

    @property
    def batches_per_epoch(self) -> int:
        """Distinct steps in one pass over the shards (each shard's tokens after its last full step
        are not read)."""
        return sum((n - 1) // self._step for n in self._sizes)

    @property
    def pinned(self) -> bool:
        """True when batches are staged through pinned memory on a copy stream (CUDA, Algorithm 2)."""
        return self._staging is not None and not self._staging.synchronous

    def reset(self) -> None:
        """Back to the start of epoch 0."""
        self._drop_staged()
        self._set_position(epoch=0, shard=0, pos=0)

    def next_batch(self):
        """This rank's next (x, y), int64 arrays of shape (batch_size, seq_len): NumPy on the CPU,
        CuPy on kiln's stream on CUDA."""
        if self._staging is not None:
            return self._next_staged()
        window = self._window()
        self._advance()
        return split_window(window, self.batch_size, self.seq_len)

    def _window(self) -> np.ndarray:
        """This rank's B·T+1 tokens at the cursor: a view of the memory-mapped shard."""
        start = self._pos + self.tokens_per_batch * self.rank
        return self._tokens[start:start + self.tokens_per_batch + 1]

    def _advance(self) -> None:
        """Step the cursor by B·T·W, to the next shard when a further step would not fit."""
        self._pos += self._step
        if self._pos + self._step + 1 > len(self._tokens):  # Algorithm 2, line 25 (for the whole step)
            if self._shard + 1 < len(self.paths):
                self._set_position(self._epoch, self._shard + 1, 0)
            else:
                self._set_position(self._epoch + 1, 0, 0)

    def _next_staged(self):
        """Algorithm 2's NEXTBATCH: take the batch staged by the last call, stage the next one into the
        other buffer, so its copy runs while this batch trains."""
        if self._ahead_error is not None:  # raised where the CPU loader raises it: at this batch
            error = self._ahead_error
            self._drop_staged()
            raise error
        if self._ahead is None:  # the first batch, or after reset / load_state_dict
            self._stage()
            if self._ahead_error is not None:
                return self._next_staged()
        slot, _ = self._ahead
        batch = self._staging.take(slot)
        self._ahead = None
        self._stage()
        return batch

    def _stage(self) -> None:
        """Start the copy of the batch at the cursor into the next slot and step the cursor past it;
        the position before the step is what state_dict reports while the batch waits."""
        slot, self._slot = self._slot, self._slot ^ 1
        position = (self._epoch, self._shard, self._pos)
        self._staging.put(slot, self._window())
        self._ahead = (slot, position)
        try:
            self._advance()
        except DataError as e:  # the CPU loader raises this when it returns this batch: so do we
            self._ahead_error = e

    def _drop_staged(self) -> None:
        """Forget the batch staged ahead (its slot's events keep the buffers safe to reuse)."""
        self._ahead = self._ahead_error = None

    def close(self) -> None:
        """Wait for staging copies in flight (CUDA); the loader's buffers can then be freed."""
        if self._staging is not None:
            self._staging.close()

    def state_dict(self) -> dict:
        """Where the next batch comes from, JSON-serialisable; equal on every rank."""
        epoch, shard, pos = self._ahead[1] if self._ahead is not None else (self._epoch, self._shard, self._pos)
        return {"epoch": epoch, "shard": shard, "position": pos,
                "shards": [p.name for p in self.paths], "tokens_per_step": self._step,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly where `state_dict` was taken, on the same shards and step size."""
        mine = self.state_dict()
        for key in ("shards", "tokens_per_step", "seed", "shuffle"):
            if state.get(key) != mine[key]:
                raise DataError(f"loader state was saved with {key}={state.get(key)!r}; this loader has "
                                f"{key}={mine[key]!r}, so it cannot resume exactly")
        shard, pos = state["shard"], state["position"]
        if not (0 <= shard < len(self.paths) and 0 <= pos and pos % self._step == 0
                and pos + self._step + 1 <= self._sizes[self._order(state["epoch"])[shard]]):
            raise DataError(f"loader state shard={shard}, position={pos} is not a step of these shards")
        self._drop_staged()
        self._set_position(state["epoch"], shard, pos)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.paths)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.paths)).tolist()

    def _set_position(self, epoch: int, shard: int, pos: int) -> None:
        self._epoch, self._shard, self._pos = epoch, shard, pos
        index = self._order(epoch)[shard]
        self._tokens = open_shard(self.paths[index])


def _check_tokens(path: Path, vocab_size: int) -> None:
    """A DataError naming the first token of the shard at `path` that is not below vocab_size."""
    tokens = open_shard(path)
    if int(tokens.max()) >= vocab_size:
        at = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{path}: token {int(tokens[at])} at position {at} is outside the vocabulary "
                        f"0..{vocab_size - 1}")
