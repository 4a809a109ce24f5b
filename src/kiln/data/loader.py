"""`ShardLoader`: training batches read from memory-mapped token shards (paper, Algorithm 2)."""

import glob
import json
from pathlib import Path

import numpy as np

from kiln.data.shards import open_shard, read_header
from kiln.errors import ConfigError, DataError, DeviceError, NotBuiltError

META_FILE = "meta.json"


def _read_meta(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{file}: not a readable meta.json: {e}") from None


def _shard_paths(path, split: str) -> tuple[list[Path], dict]:
    """The shards of `split` and the dataset's meta.json (or {}) for a folder, a glob or a list."""
    if isinstance(path, (list, tuple)):
        paths = [Path(p) for p in path]
    elif Path(path).is_dir():
        folder = Path(path)
        if (folder / META_FILE).is_file():
            meta = _read_meta(folder / META_FILE)
            names = meta.get("splits", {}).get(split, {}).get("shards", [])
            if not names:
                raise DataError(f"{folder}: {META_FILE} lists no {split!r} shards; it has "
                                f"{sorted(meta.get('splits', {}))}")
            return sorted(folder / name for name in names), meta
        paths = sorted(folder.glob(f"*{split}*.bin"))  # llm.c names: fineweb_train_000001.bin
    else:
        paths = [Path(p) for p in sorted(glob.glob(str(path)))]
    if not paths:
        raise DataError(f"{path}: no {split!r} shards found (a folder of *{split}*.bin, a glob or a list)")
    meta_file = paths[0].parent / META_FILE
    return sorted(paths), _read_meta(meta_file) if meta_file.is_file() else {}


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
    """

    def __init__(self, path, split: str = "train", *, batch_size: int, seq_len: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, device: str = "cpu", shuffle: bool = False):
        if device != "cpu":
            if str(device).startswith("cuda"):
                raise NotBuiltError(f"ShardLoader(device={device!r}): the CUDA path of Algorithm 2 (pinned "
                                    "buffers, a copy stream, events) is not built yet; use device='cpu'")
            raise DeviceError(f"ShardLoader(device={device!r}): allowed devices are 'cpu' (and later 'cuda')")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"ShardLoader({name}={value!r}): must be a positive integer")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ConfigError(f"ShardLoader(rank={rank!r}): must be in 0..{world_size - 1} for world_size={world_size}")
        self.paths, meta = _shard_paths(path, split)
        self.batch_size, self.seq_len, self.rank, self.world_size = batch_size, seq_len, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.vocab_size: int | None = meta.get("vocab_size")
        self._step = batch_size * seq_len * world_size
        self._sizes = [read_header(p).num_tokens for p in self.paths]
        for p, n in zip(self.paths, self._sizes):
            if n < self._step + 1:
                raise DataError(f"{p}: holds {n} tokens, fewer than the {self._step + 1} of one step "
                                f"(world_size {world_size} x batch_size {batch_size} x seq_len {seq_len}, +1)")
        self._checked: set[int] = set()
        self.reset()

    @property
    def tokens_per_batch(self) -> int:
        """Tokens in one rank's x: batch_size x seq_len."""
        return self.batch_size * self.seq_len

    def reset(self) -> None:
        """Back to the start of epoch 0."""
        self._set_position(epoch=0, shard=0, pos=0)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's next (x, y), int64 arrays of shape (batch_size, seq_len), on the CPU."""
        bt = self.tokens_per_batch
        start = self._pos + bt * self.rank
        x = self._tokens[start:start + bt].astype(np.int64).reshape(self.batch_size, self.seq_len)
        y = self._tokens[start + 1:start + bt + 1].astype(np.int64).reshape(self.batch_size, self.seq_len)
        self._pos += self._step
        if self._pos + self._step + 1 > len(self._tokens):  # Algorithm 2, line 25 (for the whole step)
            if self._shard + 1 < len(self.paths):
                self._set_position(self._epoch, self._shard + 1, 0)
            else:
                self._set_position(self._epoch + 1, 0, 0)
        return x, y

    def state_dict(self) -> dict:
        """Where the next batch comes from, JSON-serialisable; equal on every rank."""
        return {"epoch": self._epoch, "shard": self._shard, "position": self._pos,
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
        self._set_position(state["epoch"], shard, pos)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.paths)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.paths)).tolist()

    def _set_position(self, epoch: int, shard: int, pos: int) -> None:
        self._epoch, self._shard, self._pos = epoch, shard, pos
        index = self._order(epoch)[shard]
        self._tokens = open_shard(self.paths[index])
        if self.vocab_size is not None and index not in self._checked:  # once per shard: a full scan
            if int(self._tokens.max()) >= self.vocab_size:
                at = int(np.argmax(self._tokens >= self.vocab_size))
                raise DataError(f"{self.paths[index]}: token {int(self._tokens[at])} at position {at} is "
                                f"outside the vocabulary 0..{self.vocab_size - 1}")
            self._checked.add(index)
