"""Token shards on disk: llm.c's `.bin` format, a 256-int32 header then the tokens.

Header ints: [0] magic, [1] version, [2] token count; the other 253 are zero. The tokens follow
as little-endian unsigned integers whose width the (magic, version) pair fixes:

    magic 20240520, version 1: uint16   what llm.c and nanoGPT's FineWeb scripts write (GPT-2)
    magic 20240520, version 2: uint32   kiln's own, for vocabularies over 65536 ids
    magic 20240801, version 7: uint32   llm.c's Llama 3 shards (read only)

kiln writes version 1 whenever the vocabulary fits 16 bits, so its shards load in llm.c.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import DataError

META_FILE = "meta.json"  # beside the shards: the splits, their shard names, the vocabulary (kiln prepare)
MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = 2**31 - 1  # the count is an int32
FORMATS = {(20240520, 1): np.dtype("<u2"), (20240520, 2): np.dtype("<u4"), (20240801, 7): np.dtype("<u4")}
_KNOWN = "20240520 version 1 (uint16) or 2 (uint32), or 20240801 version 7 (llm.c Llama 3, uint32)"


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's header says: its format and how many tokens follow."""

    path: Path
    magic: int
    version: int
    num_tokens: int
    dtype: np.dtype


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token type for ids below `vocab_size`: uint16 up to 65536 ids, else uint32."""
    if not 0 < vocab_size <= 2**32:
        raise DataError(f"vocab_size={vocab_size} cannot be stored in a shard; allowed: 1 to 2**32")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write_shard(path, tokens, vocab_size: int | None = None) -> ShardHeader:
    """Write `tokens` (ids below `vocab_size`, default: their maximum + 1) to a shard, atomically."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise DataError(f"{path}: a shard holds a non-empty 1-D array of integer ids, got "
                        f"shape {tokens.shape} of {tokens.dtype}")
    if tokens.size > MAX_TOKENS:
        raise DataError(f"{path}: {tokens.size} tokens exceed the {MAX_TOKENS} an int32 header can count")
    low, high = int(tokens.min()), int(tokens.max())
    vocab_size = high + 1 if vocab_size is None else vocab_size
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise DataError(f"{path}: token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
    dtype = token_dtype(vocab_size)
    version = 1 if dtype.itemsize == 2 else 2
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, version, tokens.size
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())
    os.replace(tmp, path)
    return ShardHeader(path, MAGIC, version, int(tokens.size), dtype)


def read_header(path) -> ShardHeader:
    """Read and check a shard's header against the file's size; raise `DataError` naming the fault."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such shard file")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the shard file is empty")
    if size < HEADER_BYTES:
        raise DataError(f"{path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    if magic not in {m for m, _ in FORMATS}:
        raise DataError(f"{path}: bad magic number {magic}: not a token shard; kiln reads magic {_KNOWN}")
    if (magic, version) not in FORMATS:
        raise DataError(f"{path}: magic {magic} with version {version} is not a format kiln reads; "
                        f"allowed: magic {_KNOWN}")
    if count <= 0:
        raise DataError(f"{path}: the header counts {count} tokens; a shard holds at least one")
    dtype = FORMATS[magic, version]
    expected = HEADER_BYTES + count * dtype.itemsize
    if size < expected:
        raise DataError(f"{path}: truncated: the header promises {count} tokens ({expected} bytes) "
                        f"but the file holds {size} bytes")
    if size > expected:
        raise DataError(f"{path}: {size} bytes, more than the {expected} its header promises "
                        f"({count} tokens): a damaged or foreign file")
    return ShardHeader(path, magic, version, count, dtype)


def open_shard(path) -> np.ndarray:
    """A shard's tokens, memory-mapped read-only (nothing is read until it is touched)."""
    header = read_header(path)
    mapped = np.memmap(header.path, dtype=header.dtype, mode="r", offset=HEADER_BYTES,
                       shape=(header.num_tokens,))
    return np.asarray(mapped)  # a plain ndarray view: slicing it costs less than slicing a memmap


def unigram_entropy(paths, vocab_size: int) -> float:
    """Entropy (nats/token) of the token frequencies in these shards: the loss of a model that
    ignores context, the bar a trained model must get well under."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        counts += np.bincount(np.asarray(open_shard(path)), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
