"""`kiln prepare`: text files, folders and JSONL into train/val token shards, the tokenizer beside them.

Each text file is a document, and so is each JSONL record's text field; every document starts with
the tokenizer's end-of-text id. Documents are cut into pieces of about PIECE_CHARS characters,
encoded by parallel workers in order, and each piece goes to validation only while that keeps the
validation share of tokens at or under `val_fraction`, so the output does not depend on `workers`.
"""

import dataclasses
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kiln.data.shards import MAX_TOKENS, META_FILE, token_dtype, write_shard
from kiln.data.tokenizer import BPE_FILE, BYTES_FILE, BPETokenizer, ByteTokenizer, load_tokenizer, padded_vocab_size
from kiln.errors import ConfigError, DataError
from kiln.paths import output_folder

PIECE_CHARS = 8192  # the unit of parallel work and of the train/val split
SPLITS = ("train", "val")


@dataclass(frozen=True)
class PreparedData:
    """What `prepare` wrote into `out_dir` (also recorded in its meta.json)."""

    out_dir: Path
    tokenizer: str
    vocab_size: int
    padded_vocab_size: int
    documents: int
    tokens: dict[str, int]  # split -> tokens
    shards: dict[str, list[str]]  # split -> shard file names
    skipped: dict[str, int]  # what the walk of input folders left out -> how many


SKIPPED_FOLDERS = ("__pycache__", "node_modules")  # and every folder whose name starts with "."
BINARY_PROBE = 8192  # a NUL byte in a file's first 8 KiB makes it binary (git's test)


def _input_files(inputs: Iterable, pattern: str | None = None) -> tuple[list[Path], dict[str, int]]:
    """(files, {"hidden or cache folders": n, "binary files": n}) of the inputs. Folders are walked
    without their hidden and cache folders and binary files; with `pattern` (a glob such as '*.py')
    only files whose path inside the folder matches it are taken. Files named as inputs are taken."""
    files, skipped = [], {"hidden or cache folders": 0, "binary files": 0}
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = []
            for root, dirs, names in os.walk(path):
                keep = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_FOLDERS]
                skipped["hidden or cache folders"] += len(dirs) - len(keep)
                dirs[:] = sorted(keep)
                for name in names:
                    file = Path(root) / name
                    if name.startswith(".") or (pattern and not file.relative_to(path).match(pattern)):
                        continue
                    if _is_binary(file):
                        skipped["binary files"] += 1
                        continue
                    found.append(file)
            if not found:
                raise DataError(f"{path}: the input folder holds no files"
                                + (f" matching {pattern!r}" if pattern else "") + " (skipped: "
                                + ", ".join(f"{n} {what}" for what, n in skipped.items()) + ")")
            files += sorted(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: no such input file or folder")
    if not files:
        raise DataError("prepare: no inputs given; pass text files, folders or JSONL files")
    return files, skipped


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_PROBE)


def _bad_utf8_offset(path: Path) -> int:
    """The file offset of the first byte that is not UTF-8 (decoding it block by block)."""
    import codecs
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            pending = len(decoder.getstate()[0])  # bytes of a character the last block began
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                return offset - pending + e.start
            offset += len(block)
    return offset


def _text_lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": keep \r\n, for exact round trips
            yield from f
    except UnicodeDecodeError as e:  # e.start counts from the decoder's block, not the file
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {_bad_utf8_offset(path)})") from None


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str]:
    records = 0
    for lineno, line in enumerate(_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not a JSON record: {e}") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            has = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{path}:{lineno}: no string field {text_field!r} (the record has {has}); "
                            "name the text field with --text-field")
        records += 1
        yield text
    if records == 0:
        raise DataError(f"{path}: the JSONL file holds no records")


def _documents(files: list[Path], text_field: str) -> Iterator[Iterable[str]]:
    """Each document as an iterable of its lines."""
    for path in files:
        if path.stat().st_size == 0:
            continue  # an empty file is an empty document: nothing to add
        if path.suffix == ".jsonl":
            yield from (text.splitlines(keepends=True) for text in _jsonl_texts(path, text_field))
        else:
            yield _text_lines(path)


def _pieces(lines: Iterable[str]) -> Iterator[str]:
    """A document cut, once PIECE_CHARS are held, before a newline that ends a run of white space and
    that a non-space follows. GPT-2's pre-tokenizer regex splits there (the run's last character is
    a chunk of its own), so the pieces encode to exactly the whole document's tokens."""
    held, size = [], 0
    for line in lines:
        if size >= PIECE_CHARS and held[-1].endswith("\n") and not line[:1].isspace():
            yield "".join(held[:-1]) + held[-1][:-1]
            held, size = ["\n"], 1
        held.append(line)
        size += len(line)
    yield "".join(held)


def _work(files: list[Path], text_field: str) -> Iterator[tuple[str, bool]]:
    for document in _documents(files, text_field):
        for i, piece in enumerate(_pieces(document)):
            yield piece, i == 0


_worker_tokenizer = None


def _init_worker(tokenizer_dir: Path) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_dir)


def _encode_piece(item: tuple[str, bool]) -> tuple[np.ndarray, bool]:
    text, starts_document = item
    ids = _worker_tokenizer.encode(text)
    if starts_document:
        ids = [_worker_tokenizer.eot_id, *ids]
    return np.array(ids, dtype=token_dtype(_worker_tokenizer.vocab_size)), starts_document


def _encoded(work: Iterator, tokenizer_dir: Path, workers: int) -> Iterator[tuple[np.ndarray, bool]]:
    if workers == 1:
        _init_worker(tokenizer_dir)
        yield from map(_encode_piece, work)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer_dir,)) as pool:
        yield from pool.imap(_encode_piece, work, chunksize=16)


class _SplitWriter:
    """One split's token stream cut into shards of `shard_tokens`. A shard is written once one and a
    half are held, so the last holds half to one and a half shards: none is tiny unless all are."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, vocab_size: int):
        self.out_dir, self.split, self.shard_tokens, self.vocab_size = out_dir, split, shard_tokens, vocab_size
        self.held: list[np.ndarray] = []
        self.held_tokens = self.tokens = 0
        self.names: list[str] = []

    def add(self, tokens: np.ndarray) -> None:
        self.held.append(tokens)
        self.held_tokens += len(tokens)
        self.tokens += len(tokens)
        while self.held_tokens >= self.shard_tokens + self.shard_tokens // 2:
            stream = np.concatenate(self.held)
            self._write(stream[:self.shard_tokens])
            self.held, self.held_tokens = [stream[self.shard_tokens:]], len(stream) - self.shard_tokens

    def close(self) -> list[str]:
        if self.held_tokens:
            self._write(np.concatenate(self.held))
        return self.names

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.split}_{len(self.names):06d}.bin"
        write_shard(self.out_dir / name, tokens, self.vocab_size)
        self.names.append(name)


def _make_tokenizer(tokenizer, vocab_size, files, text_field, progress):
    if tokenizer == "bpe":
        if vocab_size is None:
            raise ConfigError("tokenizer='bpe' trains a BPE on the inputs and needs vocab_size "
                              "(--vocab-size), e.g. 8192")
        texts = (piece for document in _documents(files, text_field) for piece in _pieces(document))
        return BPETokenizer.train(texts, vocab_size, progress)
    if vocab_size is not None:
        raise ConfigError(f"vocab_size={vocab_size} applies only to tokenizer='bpe', not {tokenizer!r}")
    if tokenizer == "bytes":
        return ByteTokenizer()
    if isinstance(tokenizer, (str, os.PathLike)):
        if not Path(tokenizer).exists():
            raise ConfigError(f"tokenizer={str(tokenizer)!r}: allowed are 'bytes', 'bpe', or a path to a "
                              "tokenizer.json, a tiktoken file or a folder holding a saved tokenizer")
        return load_tokenizer(tokenizer)
    return tokenizer  # a tokenizer object, from the Python API


def _old_output(out_dir: Path, overwrite: bool) -> list[Path]:
    """An earlier run's prepared files in out_dir, refused unless overwrite (the loader would read
    stale shards beside new ones); they are deleted only when the new data is complete."""
    old = [p for pattern in ("train_*.bin", "val_*.bin", META_FILE, BPE_FILE, BYTES_FILE)
           for p in sorted(out_dir.glob(pattern))] if out_dir.is_dir() else []
    if old and not overwrite:
        raise DataError(f"{out_dir}: already holds prepared data ({', '.join(p.name for p in old[:3])}, ...); "
                        "choose an empty folder or pass overwrite=True (--overwrite)")
    return old


def _move_into(tmp: Path, out_dir: Path, old: list[Path]) -> None:
    """Put the finished data of `tmp` in out_dir: a rename when out_dir does not exist, else file by
    file with meta.json last (a folder without it is refused by the loader, never half-read)."""
    if not out_dir.exists():
        tmp.rename(out_dir)
        return
    for p in old:
        p.unlink(missing_ok=True)
    for p in sorted(tmp.iterdir(), key=lambda p: p.name == META_FILE):
        os.replace(p, out_dir / p.name)
    tmp.rmdir()


def prepare(inputs, out_dir, tokenizer="bpe", vocab_size: int | None = None, val_fraction: float = 0.1,
            shard_tokens: int = 100_000_000, workers: int = 1, text_field: str = "text",
            progress: bool = True, overwrite: bool = False, pattern: str | None = None) -> PreparedData:
    """Tokenize `inputs` into `out_dir`: train_/val_NNNNNN.bin shards, the tokenizer and meta.json.

    `tokenizer` is 'bytes', 'bpe' (train one of `vocab_size` ids on the inputs), a path to a
    tokenizer.json, a tiktoken file or a saved tokenizer's folder, or a tokenizer object. `pattern`
    (a glob, e.g. '*.py') picks the files of input folders. Everything is written into a temporary
    folder beside out_dir and moved in at the end: a prepare that fails leaves nothing behind.
    """
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction={val_fraction}: allowed is 0 <= val_fraction < 1")
    if not 1 <= shard_tokens <= MAX_TOKENS:
        raise ConfigError(f"shard_tokens={shard_tokens}: allowed is 1 to {MAX_TOKENS}")
    if workers < 1:
        raise ConfigError(f"workers={workers}: allowed is 1 or more")
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    files, skipped = _input_files(inputs, pattern)
    out_dir = output_folder(out_dir, "--out")
    old = _old_output(out_dir, overwrite)
    tok = _make_tokenizer(tokenizer, vocab_size, files, text_field, progress)
    if tok.eot_id is None:
        raise DataError(f"tokenizer {tok.source}: has no end-of-text token to separate documents "
                        "(looked for <|endoftext|>, <|end_of_text|>, </s>, <eos>)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.prepare-", dir=out_dir.parent))
    try:
        result = _write(files, tmp, tok, val_fraction, shard_tokens, workers, text_field, progress, inputs,
                        skipped)
        _move_into(tmp, out_dir, old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dataclasses.replace(result, out_dir=out_dir)


def _write(files, out_dir: Path, tok, val_fraction, shard_tokens, workers, text_field, progress, inputs,
           skipped) -> PreparedData:
    tok.save(out_dir)
    writers = {split: _SplitWriter(out_dir, split, shard_tokens, tok.vocab_size) for split in SPLITS}
    total = documents = 0
    with tqdm(unit="tok", unit_scale=True, desc="prepare", disable=not progress) as bar:
        for tokens, starts_document in _encoded(_work(files, text_field), out_dir, workers):
            n = len(tokens)
            to_val = writers["val"].tokens + n <= val_fraction * (total + n)
            writers["val" if to_val else "train"].add(tokens)
            total += n
            documents += starts_document
            bar.update(n)
    if total == 0:
        raise DataError(f"the inputs hold no text: {', '.join(str(f) for f in files[:3])}"
                        f"{', ...' if len(files) > 3 else ''} {'are' if len(files) > 1 else 'is'} empty")
    shards = {split: w.close() for split, w in writers.items()}
    if val_fraction > 0 and not shards["val"]:
        raise DataError(f"val_fraction={val_fraction} put no text in validation: {total} tokens are too few "
                        f"pieces of about {PIECE_CHARS} characters; give more text or val_fraction=0")

    described = f"{tok.kind} ({tok.source})"
    result = PreparedData(out_dir, described, tok.vocab_size, padded_vocab_size(tok.vocab_size), documents,
                          {s: w.tokens for s, w in writers.items()}, shards, skipped)
    meta = {"format": "kiln token shards (llm.c .bin)", "tokenizer": described, "vocab_size": tok.vocab_size,
            "padded_vocab_size": result.padded_vocab_size, "eot_id": tok.eot_id,
            "token_dtype": token_dtype(tok.vocab_size).name, "documents": documents,
            "val_fraction": val_fraction, "shard_tokens": shard_tokens, "inputs": [str(i) for i in inputs],
            "skipped": skipped, "splits": {s: {"tokens": result.tokens[s], "shards": shards[s]} for s in SPLITS}}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return result
