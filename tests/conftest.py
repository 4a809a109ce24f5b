"""Test-wide settings and the helpers every op family's tests share.

A private cache for prepared data, so a test run never reads stale shards. For the kernel checks
(`tests/test_op_<family>.py`, marked `cuda`): relative error `rel` against the CPU backend in
float64, tolerances per dtype (float32 <= 1e-5, bfloat16 <= 1e-2, float16 <= 2e-3), random
inputs rounded to the tested dtype (`rand`, never zeros), and the `gpu` fixture whose kernel
wrappers allocate NaN-poisoned arrays, so an element a kernel forgets to write fails the
comparison. Run those on a GPU machine with `pytest -m cuda`.

Random inputs are reproducible: every `np.random.default_rng()` a test makes without a seed is seeded from
the run's seed and the test's id, so a test draws the same inputs on every machine and a red run can be
replayed. The run's seed is 0 unless `KILN_TEST_SEED` names another, or `random` for fresh draws (the header
prints the seed drawn, to replay a failure: `KILN_TEST_SEED=<seed> pytest <test>`).
"""

import os
import secrets
import tempfile
import zlib

import ml_dtypes
import numpy as np
import pytest

import kiln

os.environ.setdefault("KILN_CACHE", tempfile.mkdtemp(prefix="kiln-cache-"))
# Every kernel launch of the CUDA tests checked against the kernel's parameters (launch.check_arguments)
os.environ.setdefault("KILN_CHECK_LAUNCHES", "1")

_unseeded_default_rng = np.random.default_rng


def _run_seed() -> int:
    value = os.environ.get("KILN_TEST_SEED", "0")
    if value == "random":
        return secrets.randbits(32)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"KILN_TEST_SEED={value!r}: an integer or 'random'") from None


RUN_SEED = _run_seed()


def pytest_report_header(config):
    return f"kiln test seed: {RUN_SEED} (KILN_TEST_SEED; 'random' for fresh draws)"


@pytest.fixture(autouse=True)
def _seeded_default_rng(request, monkeypatch):
    """np.random.default_rng() without a seed, inside a test, seeded from the run's seed and the test's id."""
    stream = np.random.SeedSequence([RUN_SEED, zlib.crc32(request.node.nodeid.encode())])

    def default_rng(seed=None):
        return _unseeded_default_rng(stream.spawn(1)[0] if seed is None else seed)

    monkeypatch.setattr(np.random, "default_rng", default_rng)


BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float32): 1e-5, BF16: 1e-2, np.dtype(np.float16): 2e-3}
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


class _PoisonedXP:
    """CuPy, except that empty/empty_like return NaN-filled (floats) or 0x5a-filled arrays."""

    def __init__(self, xp):
        self._xp = xp

    def __getattr__(self, name):
        return getattr(self._xp, name)

    @staticmethod
    def _poison(a):
        if np.dtype(a.dtype).kind in "fV" or a.dtype == BF16:
            a.fill(np.nan)
        elif a.dtype.kind in "iu":
            a.fill(0x5a)
        return a

    def empty(self, shape, dtype=float, order="C"):
        return self._poison(self._xp.empty(shape, dtype=dtype, order=order))

    def empty_like(self, a, dtype=None, order="K", subok=None, shape=None):
        return self._poison(self._xp.empty_like(a, dtype=dtype, shape=shape))


@pytest.fixture(autouse=True)
def _fp32_matmuls_after_each_test():
    """A bf16 or tf32 Trainer sets the process's float32 GEMM precision (as torch's
    set_float32_matmul_precision does); each test leaves it exact again, so an fp32 test after a bf16
    run is not checked against tf32 or bf16 products (the fused head's fp32 test failed so on the H200)."""
    yield
    import sys
    kiln.backend.get_backend("cpu").set_matmul_precision("fp32")
    if "kiln.backend.cuda.cublaslt" in sys.modules:
        sys.modules["kiln.backend.cuda.cublaslt"].set_matmul_precision("fp32")


@pytest.fixture
def gpu(monkeypatch):
    """The cuda backend with every array its kernel wrappers allocate poisoned (skips without a GPU)."""
    if not kiln.cuda_is_available():
        pytest.skip("needs an NVIDIA GPU with CuPy")
    from kiln.backend.cuda import device
    backend = kiln.backend.get_backend("cuda")
    real = device.cupy
    monkeypatch.setattr(device, "cupy", lambda: _PoisonedXP(real()))
    return backend


def rand(shape, dtype, rng, scale=1.0):
    """Standard normal draws rounded to dtype (never zeros)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def rel(got, ref) -> float:
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), "non-finite values (an unwritten, poisoned element?)"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0))


def close(gpu, got, ref, dtype, factor=1.0):
    host = gpu.to_numpy(got) if not isinstance(got, np.ndarray) else got
    err = rel(host, ref)
    assert err <= TOL[np.dtype(dtype)] * factor, f"relative error {err:.3g} > {TOL[np.dtype(dtype)] * factor:.3g}"


@pytest.fixture
def rng():
    """A generator seeded from the run's seed and the test's id (see the module's docstring)."""
    return np.random.default_rng()
