"""One file per checkpoint: a safetensors container whose JSON metadata holds the rest of the state.

The layout is plain safetensors, so `safetensors.safe_open` reads the tensors of a kiln checkpoint:
an 8-byte little-endian header length, the JSON header (tensor table and `__metadata__`), then
the tensors' bytes back to back. kiln's `__metadata__` (all strings, as safetensors requires):

    kiln.format           "kiln-checkpoint"
    kiln.format_version   FORMAT_VERSION
    kiln.version          the kiln that wrote it
    kiln.state            the state tree as JSON; a tensor leaf is {"__tensor__": key}
    kiln.chunk_bytes      CHUNK: tensors are written, read and checksummed in pieces this size
    kiln.crc32            {key: [CRC-32 of each chunk of the tensor's bytes, 8 hex digits]}
    kiln.checksum         sha256 of the length prefix and the header with this value zeroed

So every byte of the file is covered: the header by `kiln.checksum`, each tensor's bytes by the
CRC-32s in the (checksummed) header (CRC-32 as in zip, gzip and PNG: it catches every burst of up
to 32 flipped bits and all but 2^-32 of other damage, at ~6 GB/s a core where sha256 does 2), and
`load` checks both. Chunks are written with pwrite and read with preadv on a pool of threads, each
checksumming the piece it just moved (zlib and the file calls release the GIL). The file is
written to a temporary name in the same folder, fsync'd, renamed over the target and the folder
fsync'd, so a crash or a full disk mid-save leaves the previous file as it was (the paper's
"resume from the last uncorrupted point", section 4.6).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import kiln
from kiln.errors import KilnError


class CheckpointError(KilnError):
    """A checkpoint that cannot be written, read or applied: truncated, corrupt, foreign, from
    another model, or a disk that refused the write."""


FORMAT = "kiln-checkpoint"
FORMAT_VERSION = 1
SUFFIX = ".kiln"
CHUNK = 4 * 1024 * 1024  # bytes per I/O + CRC job: big enough for the kernel, small enough for cache
_TENSOR = "__tensor__"
_ZERO_SHA = "0" * 64
_MAX_HEADER = 512 * 1024 * 1024

# safetensors dtype names <-> numpy (bfloat16 through ml_dtypes, a kiln dependency)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
           "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
_NAMES = {v: k for k, v in _DTYPES.items()}

_pool: ThreadPoolExecutor | None = None


def _io_pool() -> ThreadPoolExecutor:
    """Threads that move and checksum chunks, at least two (I/O waits), at most eight."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(8, max(2, os.cpu_count() or 1)),
                                   thread_name_prefix="kiln-ckpt-io")
    return _pool


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _bytes_of(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")


def _crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _pieces(nbytes: int):
    """(start, stop) of each CHUNK of a tensor's nbytes."""
    return [(i, min(i + CHUNK, nbytes)) for i in range(0, nbytes, CHUNK)]


# ---------------------------------------------------------------------- the state tree
def flatten(state) -> tuple[object, dict[str, np.ndarray]]:
    """(JSON tree, {key: array}): every NumPy array leaf of nested dicts/lists replaced by a
    reference {"__tensor__": key}, the key being its path ("optimizer/exp_avg/3")."""
    tensors: dict[str, np.ndarray] = {}

    def walk(node, path):
        if isinstance(node, np.ndarray):
            key = "/".join(path) or "tensor"
            while key in tensors:
                key += "#"
            tensors[key] = node
            return {_TENSOR: key}
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"checkpoint state keys must be strings, got {k!r} at "
                                          f"{'/'.join(path) or 'the top'}")
                out[k] = walk(v, path + [k])
            return out
        if isinstance(node, (list, tuple)):
            return [walk(v, path + [str(i)]) for i, v in enumerate(node)]
        if isinstance(node, (np.integer, np.floating, np.bool_)):
            return node.item()
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise CheckpointError(f"cannot store a {type(node).__name__} at "
                              f"{'/'.join(path) or 'the top'} in a checkpoint; allowed: NumPy arrays, "
                              "dicts, lists, numbers, strings, None (snapshot device arrays first)")

    return walk(state, []), tensors


def unflatten(tree, tensors: dict[str, np.ndarray]):
    """The inverse of `flatten`."""
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    return tree


# ---------------------------------------------------------------------- atomic files
def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX: the directory entry lives in the folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without directory fds (Windows): the rename is all we can do
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path, fsync: bool = True):
    """Yield a binary file at a temporary name beside `path`; on success fsync it, rename it over
    `path` and fsync the folder; on any error remove it and leave `path` untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    f = open(tmp, "wb", buffering=0)  # written with os.pwrite on its descriptor
    try:
        yield f
        if fsync:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, path)
    except BaseException as e:
        f.close()
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"could not write {path}: {e.strerror or e} (errno {e.errno}); "
                                  f"{'the file there is unchanged' if path.exists() else 'nothing was written'}"
                                  ) from e
        raise
    if fsync:
        fsync_dir(path.parent)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_chunk(fd: int, view: memoryview, offset: int) -> int:
    """Write one chunk at its offset and return its CRC-32 (computed while it is in cache)."""
    _pwrite_all(fd, view, offset)
    return zlib.crc32(view)


# ---------------------------------------------------------------------- save
def _header(table: dict, meta: dict) -> bytes:
    """The JSON header, padded with spaces so the data starts at a multiple of 64 bytes."""
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    return body + b" " * (-(8 + len(body)) % 64)


def _checksum(prefix: bytes, header: bytes, checksum: str) -> str:
    zeroed = header.replace(f'"kiln.checksum":"{checksum}"'.encode(),
                            f'"kiln.checksum":"{_ZERO_SHA}"'.encode(), 1)
    return hashlib.sha256(prefix + zeroed).hexdigest()


def save(path, state: dict, fsync: bool = True) -> dict:
    """Write `state` (nested dicts/lists of NumPy arrays and JSON values) to one file, atomically.

    The tensors go first, in CHUNK pieces on the I/O threads, each piece checksummed as it is
    written; the header, whose length does not depend on the CRCs (fixed width), goes last.
    Returns {"path", "bytes", "checksum"}. A write error raises CheckpointError and leaves `path`
    as it was."""
    path = Path(path)
    tree, tensors = flatten(state)
    # widest dtype first: each tensor then starts at a multiple of its itemsize (mmap-friendly)
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    arrays = {k: np.ascontiguousarray(tensors[k]) for k in order}
    table, offset = {}, 0
    for k in order:
        a = arrays[k]
        name = _NAMES.get(a.dtype.name)
        if name is None:
            raise CheckpointError(f"tensor {k!r} has dtype {a.dtype}; allowed: {', '.join(_NAMES)}")
        table[k] = {"dtype": name, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    meta = {"kiln.format": FORMAT, "kiln.format_version": str(FORMAT_VERSION),
            "kiln.version": kiln.__version__, "kiln.state": json.dumps(tree, separators=(",", ":")),
            "kiln.chunk_bytes": str(CHUNK),
            "kiln.crc32": json.dumps({k: ["0" * 8] * len(_pieces(arrays[k].nbytes)) for k in order},
                                     separators=(",", ":")),
            "kiln.checksum": _ZERO_SHA}
    data_start = 8 + len(_header(table, meta))
    pool = _io_pool()
    with atomic_file(path, fsync=fsync) as f:
        fd = f.fileno()
        futures = {k: [pool.submit(_write_chunk, fd, _bytes_of(arrays[k])[lo:hi],
                                   data_start + table[k]["data_offsets"][0] + lo)
                       for lo, hi in _pieces(arrays[k].nbytes)] for k in order}
        try:
            crcs = {k: [_crc_hex(fut.result()) for fut in futs] for k, futs in futures.items()}
        finally:
            for fut in (fut for futs in futures.values() for fut in futs):
                fut.cancel()
            for fut in (fut for futs in futures.values() for fut in futs):
                with contextlib.suppress(BaseException):
                    fut.result()  # no write may land after the file is closed
        meta["kiln.crc32"] = json.dumps(crcs, separators=(",", ":"))
        header = _header(table, meta)
        prefix = struct.pack("<Q", len(header))
        assert 8 + len(header) == data_start  # CRCs are fixed-width hex
        meta["kiln.checksum"] = _checksum(prefix, header, _ZERO_SHA)
        header = _header(table, meta)
        _pwrite_all(fd, memoryview(prefix + header), 0)
    return {"path": str(path), "bytes": data_start + offset, "checksum": meta["kiln.checksum"]}


# ---------------------------------------------------------------------- load
def _corrupt(path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a readable kiln checkpoint: {why}")


def read_header(path) -> tuple[dict, dict, int]:
    """(tensor table, kiln metadata, data start) of a checkpoint, its header checksum verified."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"it is {size} bytes long, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > min(_MAX_HEADER, size - 8):
                raise _corrupt(path, f"its header length {n} does not fit in its {size} bytes "
                                     "(truncated or corrupt)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
        meta = header.pop("__metadata__", {})
        stored = meta.get("kiln.checksum")
    except (UnicodeDecodeError, ValueError, TypeError, AttributeError):
        raise _corrupt(path, "its header is not valid safetensors JSON (truncated or corrupt)") from None
    if not isinstance(stored, str):
        raise _corrupt(path, "its header has no kiln checksum (a safetensors file kiln did not "
                             "write, or a corrupt one)")
    if _checksum(prefix, raw, stored) != stored:
        raise _corrupt(path, "checksum mismatch in the header (the file was changed after it was written)")
    if meta.get("kiln.format") != FORMAT:
        raise _corrupt(path, f"its metadata says format {meta.get('kiln.format')!r}, not {FORMAT!r}")
    version = meta.get("kiln.format_version")
    if version != str(FORMAT_VERSION):
        raise CheckpointError(f"{path} has checkpoint format version {version}; this kiln "
                              f"({kiln.__version__}) reads version {FORMAT_VERSION}")
    end = 0
    try:
        for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, stop = entry["data_offsets"]
            count = int(np.prod(entry["shape"], dtype=np.int64))
            if start != end or stop - start != count * _np_dtype(_DTYPES[entry["dtype"]]).itemsize:
                raise _corrupt(path, f"tensor {key!r} has inconsistent offsets {entry['data_offsets']}")
            end = stop
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(path, f"its tensor table is malformed ({e!r})") from None
    if 8 + n + end != size:
        raise _corrupt(path, f"it is {size} bytes long but its header says {8 + n + end} "
                             f"({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return header, meta, 8 + n


def _read_chunk(fd: int, view: memoryview, offset: int, verify: bool):
    """Read one chunk into view; its CRC-32 (or None without verify); EOFError if the file ends."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise EOFError
        got += n
    return zlib.crc32(view) if verify else None


def load(path, verify: bool = True) -> dict:
    """The state tree that `save` wrote, tensors as NumPy arrays on the host (views into one buffer).

    Chunks are read on the I/O threads; with verify (the default) each one's CRC-32 is checked as
    it arrives. Any mismatch, truncation or corrupt header is a CheckpointError."""
    path = Path(path)
    table, meta, data_start = read_header(path)
    try:
        crcs = json.loads(meta["kiln.crc32"])
        tree = json.loads(meta["kiln.state"])
        chunk = int(meta["kiln.chunk_bytes"])
    except (KeyError, ValueError) as e:
        raise _corrupt(path, f"its metadata lacks or garbles {e}") from None
    if chunk != CHUNK:
        raise _corrupt(path, f"its chunk size is {chunk}, kiln's is {CHUNK}")
    total = max((e["data_offsets"][1] for e in table.values()), default=0)
    buffer = np.empty(total, dtype=np.uint8)
    view = memoryview(buffer)
    pool = _io_pool()
    fd = os.open(path, os.O_RDONLY)
    try:
        futures = {k: [pool.submit(_read_chunk, fd, view[e["data_offsets"][0] + lo:e["data_offsets"][0] + hi],
                                   data_start + e["data_offsets"][0] + lo, verify)
                       for lo, hi in _pieces(e["data_offsets"][1] - e["data_offsets"][0])]
                   for k, e in table.items()}
        bad, short = [], []
        for k, futs in futures.items():
            expect = crcs.get(k, [])
            for i, fut in enumerate(futs):
                try:
                    crc = fut.result()
                except EOFError:
                    short.append(k)
                    continue
                if verify and (i >= len(expect) or _crc_hex(crc) != expect[i]):
                    bad.append(k)
    finally:
        os.close(fd)
    if short:
        raise _corrupt(path, f"it ends inside tensor {short[0]!r} (truncated while being read)")
    if bad:
        bad = list(dict.fromkeys(bad))
        raise _corrupt(path, f"checksum mismatch in tensor{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(repr(k) for k in bad[:5])}{' ...' if len(bad) > 5 else ''}")
    tensors = {k: buffer[e["data_offsets"][0]:e["data_offsets"][1]].view(_np_dtype(_DTYPES[e["dtype"]]))
               .reshape(e["shape"]) for k, e in table.items()}
    try:
        return unflatten(tree, tensors)
    except KeyError as e:
        raise _corrupt(path, f"its state refers to a tensor {e} that it does not hold") from None


def describe(path) -> dict:
    """Version, kiln version, size and the tensor table of a checkpoint, without reading its tensors."""
    table, meta, _ = read_header(path)
    return {"format_version": int(meta["kiln.format_version"]), "kiln_version": meta.get("kiln.version"),
            "bytes": Path(path).stat().st_size, "checksum": meta["kiln.checksum"],
            "tensors": {k: (e["dtype"], tuple(e["shape"])) for k, e in table.items()}}
