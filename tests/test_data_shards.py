"""Token shards: kiln's writer and reader against an independent reader and writer of llm.c's format."""

import struct

import numpy as np
import pytest

from kiln.data.shards import open_shard, read_header, token_dtype, write_shard
from kiln.errors import DataError, KilnError


def llmc_write(path, tokens, magic=20240520, version=1, fmt="H"):
    """A shard as llm.c's dev/data/data_common.py writes it: 256 int32s, then the tokens."""
    header = struct.pack("<256i", magic, version, len(tokens), *([0] * 253))
    path.write_bytes(header + struct.pack(f"<{len(tokens)}{fmt}", *tokens))


def llmc_read(path):
    """(magic, version, tokens) read with struct alone, as llm.c's dataloader.h reads a shard."""
    data = path.read_bytes()
    magic, version, count = struct.unpack_from("<3i", data)
    fmt = "H" if (magic, version) == (20240520, 1) else "I"
    assert len(data) == 1024 + count * struct.calcsize(fmt)
    return magic, version, list(struct.unpack_from(f"<{count}{fmt}", data, 1024))


def test_kiln_shard_reads_in_an_independent_llmc_reader(tmp_path):
    tokens = np.random.default_rng().integers(0, 50257, size=4097)
    header = write_shard(tmp_path / "a.bin", tokens, vocab_size=50257)
    assert (header.magic, header.version, header.num_tokens) == (20240520, 1, 4097)
    assert llmc_read(tmp_path / "a.bin") == (20240520, 1, tokens.tolist())
    raw = (tmp_path / "a.bin").read_bytes()
    assert raw[12:1024] == bytes(1012)  # the unused header ints are zero


def test_llmc_shard_reads_in_kiln(tmp_path):
    tokens = np.random.default_rng().integers(0, 2**16, size=3001).tolist()
    llmc_write(tmp_path / "b.bin", tokens)
    header = read_header(tmp_path / "b.bin")
    assert (header.version, header.num_tokens, header.dtype) == (1, 3001, np.dtype("<u2"))
    assert open_shard(tmp_path / "b.bin").tolist() == tokens


def test_large_vocabularies_use_uint32_version_2(tmp_path):
    vocab = 128256
    tokens = np.random.default_rng().integers(0, vocab, size=2000)
    assert tokens.max() > 65535
    write_shard(tmp_path / "c.bin", tokens, vocab_size=vocab)
    assert llmc_read(tmp_path / "c.bin") == (20240520, 2, tokens.tolist())
    assert open_shard(tmp_path / "c.bin").dtype == np.dtype("<u4")
    assert open_shard(tmp_path / "c.bin").tolist() == tokens.tolist()
    assert token_dtype(65536) == np.dtype("<u2") and token_dtype(65537) == np.dtype("<u4")


def test_llmc_llama3_shard_reads_as_uint32(tmp_path):
    tokens = np.random.default_rng().integers(0, 128256, size=1500).tolist()
    llmc_write(tmp_path / "d.bin", tokens, magic=20240801, version=7, fmt="I")
    assert open_shard(tmp_path / "d.bin").tolist() == tokens


def test_open_shard_is_a_read_only_map(tmp_path):
    write_shard(tmp_path / "e.bin", np.arange(1, 100))
    tokens = open_shard(tmp_path / "e.bin")
    with pytest.raises(ValueError):
        tokens[0] = 5


def _bad_files():
    tokens = np.random.default_rng().integers(0, 1000, size=600).tolist()
    good = struct.pack("<256i", 20240520, 1, 600, *([0] * 253)) + struct.pack("<600H", *tokens)
    return {
        "missing.bin": (None, "no such shard file"),
        "empty.bin": (b"", "empty"),
        "short_header.bin": (good[:700], "truncated: 700 bytes"),
        "cut_tokens.bin": (good[:-10], "truncated: the header promises 600 tokens"),
        "extra.bin": (good + b"\0\0", "more than the 2224"),
        "foreign.bin": (b"Hello, world\n" * 100, "bad magic number"),
        "bad_version.bin": (struct.pack("<256i", 20240520, 3, 600, *([0] * 253)) + good[1024:], "version 3"),
        "zero_tokens.bin": (struct.pack("<256i", 20240520, 1, 0, *([0] * 253)), "counts 0 tokens"),
    }


@pytest.mark.parametrize("name", ["missing.bin", "empty.bin", "short_header.bin", "cut_tokens.bin",
                                  "extra.bin", "foreign.bin", "bad_version.bin", "zero_tokens.bin"])
def test_bad_shards_raise_data_error_naming_file_and_fault(tmp_path, name):
    content, fault = _bad_files()[name]
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=fault) as caught:
        open_shard(tmp_path / name)
    assert str(tmp_path / name) in str(caught.value)
    assert isinstance(caught.value, KilnError)


@pytest.mark.parametrize("tokens, vocab, fault", [
    ([5, 1000, 3], 1000, "token id 1000 is outside the vocabulary 0..999"),
    ([5, -1, 3], 1000, "token id -1"),
    ([], 1000, "non-empty"),
    ([1.5, 2.0], 1000, "integer ids"),
])
def test_write_refuses_bad_tokens(tmp_path, tokens, vocab, fault):
    with pytest.raises(DataError, match=fault):
        write_shard(tmp_path / "w.bin", np.array(tokens), vocab_size=vocab)
    assert not (tmp_path / "w.bin").exists()
