"""The device's measured ceilings: GEMM TFLOP/s per precision and copy bandwidth (bytes read +
written per second). Measured once per device and cached on disk, since a kernel's fraction of
the machine's limit is what tells whether it has room left (paper §2.3's profiler)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np


def cache_path(device) -> Path:
    cache = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device.backend.device_name()).strip("-").lower()
    return cache / f"ceilings-{slug}.json"


def _timed(backend, fn, repeat: int) -> float:
    """Seconds per call of fn, after two warm-up calls, the device drained before and after."""
    fn()
    fn()
    backend.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    backend.synchronize()
    return (time.perf_counter() - t0) / repeat


def measure(device, gemm_n: int | None = None, copy_mib: int | None = None) -> dict:
    """GEMM TFLOP/s (an n x n x n linear_fwd, kiln's own GEMM path) for each precision the device
    runs, and copy GB/s (a copy of copy_mib MiB). Defaults: n 8192 and 1 GiB on CUDA, 1024 and 64 MiB
    on the CPU."""
    backend = device.backend
    cuda = device.type == "cuda"
    n = gemm_n or (8192 if cuda else 1024)
    mib = copy_mib or (1024 if cuda else 64)
    rng = np.random.default_rng(0)
    gemm = {}
    modes = (("fp32", np.float32), ("tf32", np.float32), ("bf16", "bfloat16")) if cuda else \
        (("fp64", np.float64), ("fp32", np.float32))
    from kiln.dtypes import get_dtype
    for mode, dt in modes:
        dt = get_dtype(dt).np if isinstance(dt, str) else dt
        a = backend.asarray(rng.standard_normal((n, n), dtype=np.float32).astype(dt))
        w = backend.asarray(rng.standard_normal((n, n), dtype=np.float32).astype(dt))
        before = backend.get_matmul_precision() if cuda else None
        if cuda:
            backend.set_matmul_precision("fp32" if mode == "bf16" else mode)
        try:
            s = _timed(backend, lambda a=a, w=w: backend.linear_fwd(a, w, None), repeat=10 if cuda else 3)
        finally:
            if cuda:
                backend.set_matmul_precision(before)
        gemm[mode] = 2.0 * n ** 3 / s / 1e12
    src = backend.asarray(rng.standard_normal(mib * 2 ** 18, dtype=np.float32))
    dst = src.copy()  # allocated once: a copy that allocates its output times the allocator too (1,688
    # GB/s on an H200 where PyTorch's device copy moves ~4,300)

    def copy():
        dst[...] = src

    s = _timed(backend, copy, repeat=20 if cuda else 5)
    return {"device": backend.device_name(), "gemm_tflops": gemm, "copy_gbps": 2.0 * src.nbytes / s / 1e9,
            "gemm_n": n, "copy_mib": mib, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}


def ceilings(device, refresh: bool = False) -> dict:
    """The cached ceilings of this device, measured (and cached) the first time or on refresh."""
    path = cache_path(device)
    if not refresh and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass  # a torn or foreign file: measure again
    found = measure(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(found, indent=1))
    tmp.replace(path)
    return found
