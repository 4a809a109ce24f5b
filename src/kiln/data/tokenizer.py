"""Tokenizers: plain UTF-8 bytes, or byte-level BPE trained on a corpus or loaded from a
Hugging Face `tokenizer.json` or a tiktoken rank file (e.g. GPT-2's, parsed here, no tiktoken).

Every tokenizer has `encode(str) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `eot_id` (the
end-of-text id that separates documents in a shard) and `save(dir)`; `load_tokenizer` reads one back.
Text is always encoded as ordinary text: a literal "<|endoftext|>" in a document is not the eot id.
"""

import base64
import binascii
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.errors import ConfigError, DataError

EOT = "<|endoftext|>"
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")  # what a loaded tokenizer.json may call it
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
BPE_FILE = "tokenizer.json"
BYTES_FILE = "bytes-tokenizer.json"


def padded_vocab_size(n: int, multiple: int = 64) -> int:
    """`n` rounded up to a multiple of `multiple`, the model's embedding rows (50257 -> 50304)."""
    if n < 1 or multiple < 1:
        raise ConfigError(f"padded_vocab_size(n={n}, multiple={multiple}): both must be at least 1")
    return -(-n // multiple) * multiple


def _check_ids(ids, vocab_size: int) -> list[int]:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DataError(f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    return ids


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 for end-of-text: no training, nothing to download."""

    vocab_size = 257
    eot_id = 256
    eot_token = EOT
    kind = "bytes"
    source = "utf-8 bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = _check_ids(ids, self.vocab_size)
        eot = EOT.encode()
        return b"".join(eot if i == self.eot_id else bytes((i,)) for i in ids).decode("utf-8", "replace")

    def save(self, directory) -> Path:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / BYTES_FILE
        path.write_text(json.dumps({"kind": self.kind, "vocab_size": self.vocab_size, "eot": EOT}) + "\n")
        return path


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, the alphabet of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = _byte_chars()


def _byte_pair_merge(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on `token` with ranks below `max_rank`: merge the lowest-ranked adjacent pair."""
    parts = [bytes((b,)) for b in token]
    while len(parts) > 1:
        pair_ranks = [ranks.get(a + b, max_rank) for a, b in zip(parts, parts[1:])]
        best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
        if pair_ranks[best] >= max_rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def read_tiktoken_ranks(path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one `<base64 token> <rank>` per line, ranks 0..n-1, all 256 bytes."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise DataError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}") from None
        if token in ranks or not token:
            raise DataError(f"{path}:{lineno}: token {token!r} is empty or listed twice")
        ranks[token] = rank
    if not ranks:
        raise DataError(f"{path}: holds no token ranks; a tiktoken file has one '<base64 token> <rank>' a line")
    missing = sorted(set(range(len(ranks))) - set(ranks.values()))
    if missing:
        raise DataError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once; rank {missing[0]} is missing")
    absent = [b for b in range(256) if bytes((b,)) not in ranks]
    if absent:
        raise DataError(f"{path}: byte {absent[0]:#04x} has no token; byte-level BPE needs all 256 bytes")
    return ranks


class BPETokenizer:
    """Byte-level BPE run by Hugging Face `tokenizers` (GPT-2's pre-tokenizer and byte alphabet)."""

    kind = "bpe"

    def __init__(self, hf: Tokenizer, source: str):
        self._hf, self.source = hf, source
        self._hf.encode_special_tokens = True  # a literal "<|endoftext|>" in text stays text
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.eot_token = next((name for name in EOT_NAMES if hf.token_to_id(name) is not None), None)
        self.eot_id = None if self.eot_token is None else hf.token_to_id(self.eot_token)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, progress: bool = False) -> "BPETokenizer":
        """Learn `vocab_size` ids (256 bytes, end-of-text, merges) from `texts`."""
        if vocab_size < 257:
            raise ConfigError(f"vocab_size={vocab_size}: byte-level BPE needs at least 257 ids "
                              "(256 bytes and end-of-text)")
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=progress,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        hf.train_from_iterator(texts, trainer)
        return cls(hf, f"trained to {vocab_size} ids")

    @classmethod
    def from_file(cls, path) -> "BPETokenizer":
        """Load a Hugging Face `tokenizer.json`."""
        try:
            hf = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise DataError(f"{path}: not a tokenizer.json that Hugging Face tokenizers can load: {e}") from None
        return cls(hf, str(path))

    @classmethod
    def from_tiktoken(cls, path, pattern: str = GPT2_PATTERN) -> "BPETokenizer":
        """Load a tiktoken rank file; end-of-text gets the id after the last rank (50256 for GPT-2).

        BPE merges are recovered from ranks: a token's merge is what tiktoken's own merging of its
        bytes, with lower ranks only, leaves as two parts (for GPT-2, exactly its merges.txt).
        """
        ranks = read_tiktoken_ranks(path)
        merges = []
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            if len(token) > 1:
                parts = _byte_pair_merge(ranks, token, rank)
                if len(parts) != 2:
                    raise DataError(f"{path}: token {token!r} of rank {rank} is not one merge of two "
                                    "lower-ranked tokens: not a BPE rank file")
                merges.append(tuple("".join(BYTE_CHARS[b] for b in p) for p in parts))
        vocab = {"".join(BYTE_CHARS[b] for b in token): rank for token, rank in ranks.items()}
        hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        if EOT.encode() not in ranks:
            hf.add_special_tokens([EOT])
        return cls(hf, str(path))

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._hf.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=False)

    def save(self, directory) -> Path:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / BPE_FILE
        self._hf.save(str(path))
        return path


def load_tokenizer(path) -> ByteTokenizer | BPETokenizer:
    """A tokenizer from a folder that `save` wrote, a `tokenizer.json`, or a tiktoken rank file."""
    path = Path(path)
    if path.is_dir():
        for name in (BPE_FILE, BYTES_FILE):
            if (path / name).is_file():
                return load_tokenizer(path / name)
        raise DataError(f"{path}: holds no tokenizer; looked for {BPE_FILE} and {BYTES_FILE}")
    if not path.is_file():
        raise DataError(f"{path}: no such tokenizer file or folder")
    if path.name == BYTES_FILE:
        return ByteTokenizer()
    if path.suffix == ".json":
        return BPETokenizer.from_file(path)
    return BPETokenizer.from_tiktoken(path)
