"""Which cuBLASLt algorithm a GEMM plan runs: the fastest of the heuristic's candidates, timed once per
shape per machine, and the JSON file beside the kernel cache that keeps that choice (issue 14).

cuBLASLt's heuristic (`cublasLtMatmulAlgoGetHeuristic`) ranks algorithms by a model, not by measurement; in
the GPT-2 124M bf16 step its first pick is often not the fastest (the weight-gradient GEMMs with K = 16384
get split-K kernels plus a splitKreduce kernel). With KILN_GEMM_AUTOTUNE=1 a plan of at least
MIN_FLOP operations asks for up to CANDIDATES algorithms, and the first time it runs outside a CUDA graph capture cublaslt.py times
each on the device (TIMED launches after WARMUP, the median of the per-launch times) and keeps the
fastest; the choice goes into a file per machine (the device's name and the cuBLASLt version in its name
and contents), keyed by the plan's key, as the 64-byte `cublasLtMatmulAlgo_t` (8 uint64), and a later
process takes it from there after `cublasLtMatmulAlgoCheck` accepts it (else it tunes again).
KILN_GEMM_AUTOTUNE=0 (the default until the tuning has been measured on a GPU: it has not yet) runs the heuristic's
first pick, as kiln did before, and neither reads nor writes the file.

Reproducibility (bit-equal losses from two runs with one seed): a plan's algorithm is fixed at its first
use and never changes within a process (a plan first met inside a capture keeps the heuristic's pick, or the
file's, for the whole run, so a graph and the eager steps around it run the same code). On a fresh machine
the first run tunes, so its algorithms may differ from the heuristic's and from another machine's; it writes
its choices, and every later run on that machine reads them and runs the same algorithms, bit for bit. Ranks
that tune at once agree too: a choice is written under a file lock, and a process that finds one already
written for its key (another rank's, timed a moment earlier) runs that one instead of its own. Only where
the file cannot be written (a read-only cache directory: kiln warns once) may two runs time their way to
different algorithms; KILN_GEMM_AUTOTUNE=0 or a writable KILN_KERNEL_CACHE restores reproducibility.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from pathlib import Path

from kiln.backend.cuda.compiler import cache_dir
from kiln.errors import ConfigError

ENV = "KILN_GEMM_AUTOTUNE"
CANDIDATES = 8      # algorithms asked of the heuristic per plan when tuning
WARMUP = 2          # untimed launches of each candidate before its timed ones
TIMED = 10          # timed launches of each candidate; its time is their median
# A candidate replaces the heuristic's first pick only when its median is faster by more than this fraction:
# below it the two are within the noise of 10 launches (and a GEMM shorter than the host's ~10 us per
# launch measures the host), so the heuristic's pick, the one kiln ran before tuning, stays.
MARGIN = 0.02
# GEMMs of fewer floating-point operations keep the heuristic's pick, untimed and unwritten: a few
# microseconds each at most, where no choice moves a step, and tests' and small models' many shapes would
# only fill the file and lengthen their first step.
MIN_FLOP = 1 << 30
FORMAT = 1          # the file's layout version


def enabled() -> bool:
    """Whether GEMM plans are tuned (KILN_GEMM_AUTOTUNE, "0" by default)."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ConfigError(f"{ENV}={value!r}: allowed are 1 (tune each GEMM shape once per machine) and 0 "
                          "(run cuBLASLt's heuristic pick)")
    return value == "1"


def candidate_count(flop: int) -> int:
    """How many algorithms a new plan of `flop` operations asks the heuristic for: CANDIDATES when it is to be
    tuned, else its first."""
    return CANDIDATES if enabled() and flop >= MIN_FLOP else 1


def choose(times_ms, margin: float = MARGIN) -> int:
    """The index of the candidate to keep, given each one's median time (index 0 the heuristic's first pick;
    inf or nan for one that failed): the fastest, if it beats the heuristic's first by more than `margin`."""
    finite = [(t, i) for i, t in enumerate(times_ms) if math.isfinite(t)]
    if not finite:
        return 0
    best_t, best = min(finite)
    first = times_ms[0]
    if best == 0 or (math.isfinite(first) and best_t >= first * (1 - margin)):
        return 0
    return best


def disk_key(plan_key) -> str:
    """A plan's key as the file stores it: the shape, layouts, dtypes and epilogue, not the device id
    (the file is per device name already)."""
    return json.dumps([list(v) if isinstance(v, tuple) else v for v in plan_key[1:]], separators=(",", ":"),
                      default=int)  # a NumPy integer among the sizes is written as the number it is


def valid_algo(value) -> bool:
    """Whether value is a stored `cublasLtMatmulAlgo_t`: 8 integers that fit uint64."""
    return (isinstance(value, list) and len(value) == 8 and
            all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in value))


def cache_path(device_name: str, version: int) -> Path:
    """The machine's file beside the kernel cache (compiler.cache_dir, KILN_KERNEL_CACHE)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") or "device"
    return cache_dir() / f"gemm-algos-{slug}-cublasLt{version}.json"


class AlgoCache:
    """The algorithms chosen on one device name and cuBLASLt version: in memory, and in `path`.

    Writes take an exclusive lock on path + ".lock", read the file again, add the entry and replace the file
    atomically (a temporary file and a rename), so ranks tuning at once lose none of each other's entries;
    and an entry already there for the key wins over the one being written (its writer may have run it)."""

    def __init__(self, path: Path, device_name: str, version: int):
        self.path, self.device_name, self.version = Path(path), device_name, int(version)
        self._entries: dict | None = None
        self._warned_unwritable = False

    def _read(self) -> dict:
        """The file's entries for this device and version; {} when it is missing, torn or another's."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("device") != self.device_name \
                or data.get("cublaslt_version") != self.version or not isinstance(data.get("algos"), dict):
            return {}
        return {k: v for k, v in data["algos"].items() if isinstance(v, dict) and valid_algo(v.get("algo"))}

    def get(self, key: str) -> dict | None:
        """The stored entry for a plan's disk key ({"algo": [8 ints], ...}), or None."""
        if self._entries is None:
            self._entries = self._read()
        return self._entries.get(key)

    def put(self, key: str, entry: dict, stale: list | None = None) -> dict:
        """Store entry for key unless the file already holds another valid entry for it (not `stale`, the
        one this process found wanting); returns the entry in force, which the caller runs."""
        if self._entries is None:
            self._entries = self._read()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_name(self.path.name + ".lock")):
                on_disk = self._read()
                theirs = on_disk.get(key)
                if theirs is not None and theirs["algo"] != stale:
                    self._entries.update(on_disk)
                    return theirs
                on_disk[key] = entry
                record = {"format": FORMAT, "device": self.device_name, "cublaslt_version": self.version,
                          "algos": on_disk}
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
                self._entries.update(on_disk)
        except OSError as e:
            self._entries[key] = entry
            if not self._warned_unwritable:
                self._warned_unwritable = True
                warnings.warn(f"kiln: the GEMM algorithms chosen by tuning cannot be kept in {self.path} ({e}): "
                              "this run uses them, but a later run tunes again and may choose others (its "
                              f"losses may then differ in the last bits); set KILN_KERNEL_CACHE to a writable "
                              f"folder, or {ENV}=0", RuntimeWarning, stacklevel=3)
        return entry


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive advisory lock on lock_path (fcntl.flock) while the block runs; a file system without
    flock (some network mounts) goes without it: the rename still keeps the file whole."""
    with open(lock_path, "a") as f:
        try:
            import fcntl
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield  # closing the file releases the lock
