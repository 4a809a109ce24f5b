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
def test_gelu_unaligned_view(gpu, rng):
    x = rand((1027,), np.float32, rng)
    xd = gpu.asarray(x)[1:]  # 4 bytes past a 16-byte boundary: the scalar path
    close(gpu, gpu.gelu_fwd(xd), cpu.gelu_fwd(f64(x[1:])), np.float32)
