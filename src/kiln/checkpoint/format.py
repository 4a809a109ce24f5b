"""One file per checkpoint: a safetensors container whose JSON metadata holds the rest of the state.

The layout is plain safetensors, so `safetensors.safe_open` reads the tensors of a kiln checkpoint:
an 8-byte little-endian header length, the JSON header (tensor table and `__metadata__`, padded
with spaces so the data starts on a 4 KiB boundary), then the tensors' bytes back to back.
kiln's `__metadata__` (all strings, as safetensors requires):

    kiln.format           "kiln-checkpoint"
    kiln.format_version   FORMAT_VERSION
    kiln.version          the kiln that wrote it
    kiln.state            the state tree as JSON; a tensor leaf is {"__tensor__": key}
    kiln.chunk_bytes      CHUNK: the data is written, read and checksummed in blocks this size
    kiln.crc32            [CRC-32 of each CHUNK of the data, 8 hex digits]
    kiln.checksum         sha256 of the length prefix and the header with this value zeroed

So every byte of the file is covered: the header by `kiln.checksum`, the data by the CRC-32s in
the (checksummed) header. CRC-32 is the check of zip, gzip and PNG: it catches every burst of up
to 32 flipped bits and all but 2^-32 of other damage, at ~6 GB/s a core where sha256 does 2.

Blocks are written and read on a pool of threads (file calls and zlib release the GIL), each
checksumming the block it moves while it is in cache. Both directions bypass the page cache
(O_DIRECT; writes through a per-thread aligned bounce buffer, reads straight into the page-aligned
result) where the filesystem allows it: a checkpoint is written once and read once, so caching it
only evicts the training data. KILN_CHECKPOINT_DIRECT=0 turns that off (plain pwrite/preadv).
(From a859d51 to 0f60023 it was off by default: CUDA runs' checkpoints came back with the header's
padding zeroed. The cause was not the I/O: NVRTC had written into CPython's cached b" ", see
backend/cuda/compiler.py.) The file is
written to a temporary name in the same folder, fsync'd, renamed over the target and the folder
fsync'd, so a crash or a full disk mid-save leaves the previous file as it was (the paper's
"resume from the last uncorrupted point", section 4.6).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import hashlib
import json
import math
import mmap
import os
import struct
import threading
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
CHUNK = 4 * 1024 * 1024  # bytes per block: big enough for the disk, small enough for the cache
ALIGN = 4096             # O_DIRECT alignment of memory, offsets and lengths; the data starts here
DIRECT_IO = hasattr(os, "O_DIRECT") and os.environ.get("KILN_CHECKPOINT_DIRECT", "1") != "0"  # see above
_TENSOR = "__tensor__"
_ZERO_SHA = "0" * 64
_MAX_HEADER = 512 * 1024 * 1024

# safetensors dtype names <-> numpy (bfloat16 through ml_dtypes, a kiln dependency)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
           "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
_NAMES = {v: k for k, v in _DTYPES.items()}

_pool: ThreadPoolExecutor | None = None
_local = threading.local()


def _io_pool() -> ThreadPoolExecutor:
    """Threads that move and checksum blocks: at least four (they wait on I/O: the disk wants
    several requests in flight), at most eight."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(8, max(4, os.cpu_count() or 1)),
                                   thread_name_prefix="kiln-ckpt-io")
    return _pool


def _bounce() -> np.ndarray:
    """This thread's page-aligned CHUNK-byte buffer (anonymous mmap), reused from save to save."""
    buf = getattr(_local, "bounce", None)
    if buf is None:
        _local.mapping = _anonymous(CHUNK)
        buf = _local.bounce = np.frombuffer(_local.mapping, dtype=np.uint8)
    return buf


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1).view(np.uint8) if arr.size else np.zeros(0, np.uint8)


def _crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _blocks(nbytes: int):
    """(start, stop) of each CHUNK of nbytes of data."""
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


def _pwrite_all(fd: int, view, offset: int, rest_fd: int | None = None) -> None:
    """Write all of view at offset. After a short or refused O_DIRECT write the rest goes through
    rest_fd (the buffered descriptor: O_DIRECT cannot go on from an unaligned place), so a full
    disk or a file size limit is reported as what it is (ENOSPC, EFBIG), not as EINVAL."""
    view = memoryview(view).cast("B")
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as e:
            # an O_DIRECT write the kernel had to shorten (a size limit, a nearly full disk)
            # fails with EINVAL: the buffered descriptor gets the real answer
            if rest_fd is None or fd == rest_fd or e.errno != errno.EINVAL:
                raise
            fd = rest_fd
            continue
        view, offset = view[n:], offset + n
        if rest_fd is not None:
            fd = rest_fd


class _Segments:
    """The data region as (offset, bytes) pieces, one per tensor: which bytes fill a block."""

    def __init__(self, pieces):
        self.starts = [start for start, _ in pieces]
        self.pieces = pieces

    def overlapping(self, lo: int, hi: int):
        """(dst offset in the block, source bytes) of every piece of [lo, hi)."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.pieces) and self.starts[i] < hi:
            start, data = self.pieces[i]
            a, b = max(lo, start), min(hi, start + data.size)
            if a < b:
                yield a - lo, data[a - start:b - start]
            i += 1


def _write_block(fd: int, segments: _Segments, lo: int, hi: int, offset: int, direct: int | None) -> int:
    """Write data bytes [lo, hi) at file offset `offset` (through the O_DIRECT descriptor
    `direct` when there is one); return their CRC-32."""
    if direct is not None:  # gather into the aligned bounce buffer: one aligned write of whole pages
        buf = _bounce()
        n = hi - lo
        for at, piece in segments.overlapping(lo, hi):
            buf[at:at + piece.size] = piece
        padded = -(-n // ALIGN) * ALIGN
        buf[n:padded] = 0  # the file is truncated to its length afterwards
        crc = zlib.crc32(buf[:n])
        _pwrite_all(direct, buf[:padded], offset, rest_fd=fd)
        return crc
    crc = 0
    for at, piece in segments.overlapping(lo, hi):
        _pwrite_all(fd, piece, offset + at)
        crc = zlib.crc32(piece, crc)
    return crc


def _open_direct(path: Path):
    """A second, O_DIRECT descriptor on the temporary file, or None where that is refused."""
    if not DIRECT_IO:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return None
    try:  # some filesystems accept the flag and refuse the write
        os.pwrite(fd, memoryview(_bounce())[:ALIGN], 0)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    return fd


# ---------------------------------------------------------------------- save
def _header(table: dict, meta: dict) -> bytes:
    """The JSON header, padded with spaces so the data starts at a multiple of ALIGN."""
    body = json.dumps({"__metadata__": meta, **table}, separators=(",", ":")).encode()
    return body + b" " * (-(8 + len(body)) % ALIGN)


def _checksum(prefix: bytes, header: bytes, checksum: str) -> str:
    zeroed = header.replace(f'"kiln.checksum":"{checksum}"'.encode(),
                            f'"kiln.checksum":"{_ZERO_SHA}"'.encode(), 1)
    return hashlib.sha256(prefix + zeroed).hexdigest()


def save(path, state: dict, fsync: bool = True) -> dict:
    """Write `state` (nested dicts/lists of NumPy arrays and JSON values) to one file, atomically.

    The data goes first, in CHUNK blocks on the I/O threads, each checksummed as it is written;
    the header, whose length does not depend on the CRCs (fixed width), goes last. Returns
    {"path", "bytes", "checksum"}. A write error raises CheckpointError and leaves `path` as it was."""
    path = Path(path)
    tree, tensors = flatten(state)
    # widest dtype first: each tensor then starts at a multiple of its itemsize (mmap-friendly)
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    arrays = {k: np.ascontiguousarray(tensors[k]) for k in order}
    table, pieces, size = {}, [], 0
    for k in order:
        a = arrays[k]
        name = _NAMES.get(a.dtype.name)
        if name is None:
            raise CheckpointError(f"tensor {k!r} has dtype {a.dtype}; allowed: {', '.join(_NAMES)}")
        table[k] = {"dtype": name, "shape": list(a.shape), "data_offsets": [size, size + a.nbytes]}
        if a.nbytes:
            pieces.append((size, _bytes_of(a)))
        size += a.nbytes
    blocks = _blocks(size)
    meta = {"kiln.format": FORMAT, "kiln.format_version": str(FORMAT_VERSION),
            "kiln.version": kiln.__version__, "kiln.state": json.dumps(tree, separators=(",", ":")),
            "kiln.chunk_bytes": str(CHUNK), "kiln.crc32": json.dumps(["0" * 8] * len(blocks)),
            "kiln.checksum": _ZERO_SHA}
    data_start = 8 + len(_header(table, meta))
    segments = _Segments(pieces)
    pool = _io_pool()
    with atomic_file(path, fsync=fsync) as f:
        direct, fd = _open_direct(f.name), f.fileno()
        try:
            futures = [pool.submit(_write_block, fd, segments, lo, hi, data_start + lo, direct)
                       for lo, hi in blocks]
            try:
                crcs = [_crc_hex(fut.result()) for fut in futures]
            finally:
                for fut in futures:
                    fut.cancel()
                for fut in futures:
                    with contextlib.suppress(BaseException):
                        fut.result()  # no write may land after the file is closed
            meta["kiln.crc32"] = json.dumps(crcs)
            header = _header(table, meta)
            prefix = struct.pack("<Q", len(header))
            assert 8 + len(header) == data_start  # CRCs are fixed-width hex
            meta["kiln.checksum"] = _checksum(prefix, header, _ZERO_SHA)
            head = prefix + _header(table, meta)
            if direct is not None:  # the header fills whole pages: one aligned write
                buf = _anonymous(len(head))
                buf.write(head)
                _pwrite_all(direct, buf, 0, rest_fd=fd)
                buf.close()
                os.ftruncate(fd, data_start + size)
            else:
                _pwrite_all(fd, head, 0)
        finally:
            if direct is not None:
                os.close(direct)
    return {"path": str(path), "bytes": data_start + size, "checksum": meta["kiln.checksum"]}


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
            shape = entry["shape"]
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise _corrupt(path, f"tensor {key!r} has shape {shape!r}: allowed are integers >= 0")
            count = math.prod(shape)  # Python ints: a crafted shape cannot wrap around to a small size
            if start != end or stop - start != count * _np_dtype(_DTYPES[entry["dtype"]]).itemsize:
                raise _corrupt(path, f"tensor {key!r} has inconsistent offsets {entry['data_offsets']}")
            end = stop
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(path, f"its tensor table is malformed ({e!r})") from None
    if 8 + n + end != size:
        raise _corrupt(path, f"it is {size} bytes long but its header says {8 + n + end} "
                             f"({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return header, meta, 8 + n


def host_buffer(nbytes: int) -> np.ndarray:
    """nbytes of page-aligned host memory (O_DIRECT reads land in it directly): an anonymous
    mapping of small pages, not NumPy's allocation, which asks for transparent huge pages for big
    arrays and then waits for the kernel to compact memory into 2 MiB pages (about twice as slow
    to fault in on the CPU machine, measured)."""
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(_anonymous(nbytes), dtype=np.uint8)


def _anonymous(nbytes: int) -> mmap.mmap:
    """Private anonymous memory (Python's default, MAP_SHARED, would be shared memory)."""
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, nbytes)


def _read_block(fd: int, view: memoryview, n: int, offset: int, verify: bool, rest_fd: int):
    """Read the first n bytes of view (an O_DIRECT read fills all of it, whole pages, short at the
    end of the file) at offset; their CRC-32 (or None without verify); EOFError if the file ends."""
    got = 0
    while got < n:
        try:
            k = os.preadv(fd, [view[got:] if fd != rest_fd else view[got:n]], offset + got)
        except OSError as e:
            if fd == rest_fd or e.errno != errno.EINVAL:
                raise
            fd = rest_fd  # a filesystem that refuses O_DIRECT reads: the buffered descriptor
            continue
        if k == 0:
            raise EOFError
        got += k
        fd = rest_fd if got % ALIGN else fd  # O_DIRECT cannot go on from an unaligned place
    return zlib.crc32(view[:n]) if verify else None


def load(path, verify: bool = True) -> dict:
    """The state tree that `save` wrote, tensors as NumPy arrays on the host (views into one buffer).

    Blocks are read on the I/O threads; with verify (the default) each one's CRC-32 is checked as
    it arrives. Any mismatch, truncation or corrupt header is a CheckpointError."""
    path = Path(path)
    table, meta, data_start = read_header(path)
    try:
        crcs = json.loads(meta["kiln.crc32"])
        tree = json.loads(meta["kiln.state"])
        chunk = int(meta["kiln.chunk_bytes"])
    except (KeyError, ValueError) as e:
        raise _corrupt(path, f"its metadata lacks or garbles {e}") from None
    size = max((e["data_offsets"][1] for e in table.values()), default=0)
    blocks = [(i, min(i + chunk, size)) for i in range(0, size, chunk)] if chunk > 0 else []
    if chunk <= 0 or len(crcs) != len(blocks):
        raise _corrupt(path, f"it lists {len(crcs)} block checksums for {len(blocks)} blocks")
    padded = -(-size // ALIGN) * ALIGN
    buffer = host_buffer(padded)
    view = memoryview(buffer)
    pool = _io_pool()
    fd = os.open(path, os.O_RDONLY)
    direct = None
    if DIRECT_IO and data_start % ALIGN == 0:
        with contextlib.suppress(OSError):
            direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        futures = [pool.submit(_read_block, direct if direct is not None else fd,
                               view[lo:lo + -(-(hi - lo) // ALIGN) * ALIGN], hi - lo, data_start + lo,
                               verify, fd)
                   for lo, hi in blocks]
        bad, short = [], False
        for (lo, hi), expect, fut in zip(blocks, crcs, futures):
            try:
                crc = fut.result()
            except EOFError:
                short = True
                continue
            if verify and _crc_hex(crc) != expect:
                bad.append((lo, hi))
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)
    if short:
        raise _corrupt(path, "it ends before its last tensor (truncated while being read)")
    if bad:
        lo, hi = bad[0]
        names = [k for k, e in table.items() if e["data_offsets"][0] < min(hi, e["data_offsets"][1])
                 and e["data_offsets"][1] > lo]
        raise _corrupt(path, f"checksum mismatch in {len(bad)} data block{'s' if len(bad) > 1 else ''}, the "
                             f"first (data bytes {lo}..{hi}) holding {', '.join(repr(k) for k in names[:5])}"
                             f"{' ...' if len(names) > 5 else ''}")
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
