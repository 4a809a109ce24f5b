"""GELU (tanh form): the op against PyTorch and finite differences on the CPU; the CUDA kernels against the CPU backend (`cuda`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import kiln
from kiln.backend import cpu
from kiln.nn import functional as F
from tests.conftest import DTYPE_IDS, DTYPES, close, f64, rand, rel
from tests.gradcheck import gradcheck, randn


def test_gelu_is_the_tanh_form():
    x = randn(4, 9) * 2
    ref = TF.gelu(torch.tensor(x), approximate="tanh").numpy()
    assert rel(F.gelu(kiln.tensor(x)).numpy(), ref) < 1e-14
    gradcheck(F.gelu, x)


def test_gelu_float32_cpu_is_close_everywhere_and_in_the_negative_tail():
    """The CPU kernel computes 0.5 x (1 + tanh u) as x sigmoid(2u), the same function without the cancellation
    of 1 + tanh u where tanh u is near -1: in float32 it stays within 4e-6 of float64 over [-12, 12], and within
    1e-4 relatively over [-9, -3] (the tanh form was off by a factor of 13 at x = -9). Backward likewise."""
    k, c = np.sqrt(2 / np.pi), 0.044715
    for lo, hi, bound, relative in ((-12, 12, 4e-6, False), (-9, -3, 1e-4, True)):
        x = np.linspace(lo, hi, 20001).astype(np.float32).reshape(1, -1)
        xd = x.astype(np.float64)
        s = 1 / (1 + np.exp(-2 * k * (xd + c * xd ** 3)))
        want_y, want_g = xd * s, s * (1 + 2 * k * xd * (1 + 3 * c * xd ** 2) * (1 - s))
        got_y, got_g = cpu.gelu_fwd(x), cpu.gelu_bwd(np.ones_like(x), x)
        assert got_y.dtype == got_g.dtype == np.float32
        for got, want in ((got_y, want_y), (got_g, want_g)):
            err = np.abs(got - want) / (np.abs(want) if relative else 1.0)
            assert err.max() < bound, (lo, hi, err.max())


# --- GELU ---------------------------------------------------------------------------------

GELU_SHAPES = [(7,), (3, 1001), (4, 64, 3072), pytest.param((16, 1024, 3072), marks=pytest.mark.slow)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", GELU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gelu(gpu, rng, shape, dtype):
    x, g = rand(shape, dtype, rng), rand(shape, dtype, rng)
    close(gpu, gpu.gelu_fwd(gpu.asarray(x)), cpu.gelu_fwd(f64(x)), dtype)
    close(gpu, gpu.gelu_bwd(gpu.asarray(g), gpu.asarray(x)), cpu.gelu_bwd(f64(g), f64(x)), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 8), (3, 1001), (33, 768), (300, 3072),
                                   pytest.param((16384, 3072), marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gelu_bwd_bias(gpu, rng, shape, dtype):
    """The GELU backward with the bias gradient in its pass: dx as gelu_bwd's, bit for bit; dbias the column
    sums of that dx (against float64 sums of it), the same bits on a second call (fixed-order sums)."""
    x, g = rand(shape, dtype, rng), rand(shape, dtype, rng)
    dx, db = gpu.gelu_bwd_bias(gpu.asarray(g), gpu.asarray(x))
    assert np.array_equal(gpu.to_numpy(dx), gpu.to_numpy(gpu.gelu_bwd(gpu.asarray(g), gpu.asarray(x))))
    close(gpu, db, f64(gpu.to_numpy(dx)).sum(axis=0), dtype)
    ref_dx, ref_db = cpu.gelu_bwd_bias(f64(g), f64(x))
    close(gpu, dx, ref_dx, dtype)
    close(gpu, db, ref_db, dtype, factor=4.0)  # dx rounded to dtype before it is summed
    again = gpu.gelu_bwd_bias(gpu.asarray(g), gpu.asarray(x))[1]
    assert np.array_equal(gpu.to_numpy(again), gpu.to_numpy(db))
    db32 = gpu.gelu_bwd_bias(gpu.asarray(g), gpu.asarray(x), np.float32)[1]  # an fp32 bias's gradient: not rounded
    assert db32.dtype == np.float32
    close(gpu, db32, f64(gpu.to_numpy(dx)).sum(axis=0), np.float32, factor=10)


@pytest.mark.cuda
def test_gelu_unaligned_view(gpu, rng):
    x = rand((1027,), np.float32, rng)
    xd = gpu.asarray(x)[1:]  # 4 bytes past a 16-byte boundary: the scalar path
    close(gpu, gpu.gelu_fwd(xd), cpu.gelu_fwd(f64(x[1:])), np.float32)
