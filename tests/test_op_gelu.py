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
