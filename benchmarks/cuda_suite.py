"""The CUDA test suite on one GPU in a few concurrent shards (`device_check.sh tests`).

Run serially the suite takes ~550 s on a fresh H200, most of it NVRTC compiling kernel families one after
another and the GPU idle between small tests. Here every family is compiled first, all at once in a process
pool, into the kernel cache (compiler.load_or_compile's cubins, keyed on source, options and NVRTC version);
then the suite's test ids are dealt round-robin into `--shards` pytest processes that run side by side on the
one GPU, each reading the cache. A shard's log is `<logs>/pytest-cuda-<i>.log` (with its 20 slowest tests);
the summary line of every shard and the failures of all of them are printed at the end.

    PYTHONPATH=src python3 benchmarks/cuda_suite.py --shards 4 --logs /tmp/logs [-k expression] [pytest -m expression]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def _compile(family: str, arch: str) -> tuple[str, float]:
    import kiln.backend.cuda  # noqa: F401  (its modules register every family's instantiations)
    from kiln.backend.cuda.compiler import load_or_compile
    t0 = time.perf_counter()
    load_or_compile(family, arch)
    return family, time.perf_counter() - t0


def prebuild(arch: str, workers: int) -> None:
    """Compile every registered kernel family into the kernel cache, `workers` at a time."""
    import kiln.backend.cuda  # noqa: F401
    from kiln.backend.cuda.compiler import FAMILIES
    t0 = time.perf_counter()
    # spawned, not forked: the parent has a CUDA context (it asked the device its arch)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn) as pool:
        for family, seconds in pool.map(_compile, sorted(FAMILIES), [arch] * len(FAMILIES)):
            print(f"  {family}: {seconds:.1f} s", flush=True)
    print(f"kernel cache: {len(FAMILIES)} families in {time.perf_counter() - t0:.1f} s", flush=True)


def collect(marker: str, paths: list[str], keyword: str = "") -> list[str]:
    """The node ids pytest selects with `-m marker` (and `-k keyword`, if given) under `paths`."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", marker, *(["-k", keyword] if keyword else []), *paths], capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"no tests collected for -m {marker!r}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def deal(ids: list[str], shards: int) -> list[list[str]]:
    """Round-robin, so each shard gets a like share of every file (the three big files are half the ids)."""
    return [ids[i::shards] for i in range(shards)]


_SUMMARY = re.compile(r"^=* ?(\d+ \w+.* in [\d.]+s.*?)(?: =+)?$")  # pytest -q prints it without the rules


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("marker", nargs="?", default="cuda and not slow")
    ap.add_argument("--paths", nargs="*", default=["tests"])
    ap.add_argument("-k", dest="keyword", default="",
                    help="pytest -k expression, e.g. to leave out a kernel that has never run (its part tries it alone)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--logs", type=Path, required=True)
    args = ap.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    from kiln.backend.cuda.device import arch
    prebuild(arch(), args.compile_workers)
    ids = collect(args.marker, args.paths, args.keyword)
    groups = deal(ids, args.shards)
    print(f"{len(ids)} tests in {len(groups)} shards of {[len(g) for g in groups]}", flush=True)
    threads = str(max(1, (os.cpu_count() or 1) // args.shards))
    env = dict(os.environ, OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    t0 = time.perf_counter()
    procs = []
    for i, group in enumerate(groups):
        log = open(args.logs / f"pytest-cuda-{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                        "--durations=20", "-rfE", *group], stdout=log, stderr=subprocess.STDOUT,
                                       env=env), log))
    # device_check's time limit sends SIGTERM: the shards go with this process, not on as orphans holding the GPU
    def stop(*_):
        for proc, _ in procs:
            proc.kill()
        sys.exit(124)
    signal.signal(signal.SIGTERM, stop)
    rc = 0
    for i, (proc, log) in enumerate(procs):
        code = proc.wait()
        log.close()
        text = (args.logs / f"pytest-cuda-{i}.log").read_text()
        summary = [m.group(1) for line in text.splitlines() if (m := _SUMMARY.match(line))]
        print(f"shard {i}: exit {code}: {summary[-1] if summary else 'no summary (killed?)'}", flush=True)
        for line in text.splitlines():
            if line.startswith(("FAILED ", "ERROR ")):
                print("  " + line, flush=True)
        rc = rc or code
    print(f"suite: {time.perf_counter() - t0:.1f} s after the kernel cache", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
