"""softmax and log-softmax: the ops on the CPU; the CUDA kernels against the CPU backend (`cuda`)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.backend import cpu
from kiln.nn import functional as F
from tests.conftest import DTYPE_IDS, DTYPES, close, f64, rand, rel
from tests.gradcheck import gradcheck, randn


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_and_log_softmax(dim):
    x = randn(3, 4, 5) * 3
    t = torch.tensor(x)
    assert rel(F.softmax(kiln.tensor(x), dim).numpy(), torch.softmax(t, dim).numpy()) < 1e-14
    assert rel(F.log_softmax(kiln.tensor(x), dim).numpy(), torch.log_softmax(t, dim).numpy()) < 1e-14
    gradcheck(lambda a: F.softmax(a, dim), x)
    gradcheck(lambda a: F.log_softmax(a, dim), x)


# --- softmax ------------------------------------------------------------------------------

SM_SHAPES = [(4, 10), (3, 5, 1000), (2, 1023), (8, 1024), pytest.param((64, 50304), marks=pytest.mark.slow)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SM_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_softmax(gpu, rng, shape, dtype, kind):
    x, g = rand(shape, dtype, rng, 3.0), rand(shape, dtype, rng)
    fwd, bwd = getattr(gpu, f"{kind}_fwd"), getattr(gpu, f"{kind}_bwd")
    rfwd, rbwd = getattr(cpu, f"{kind}_fwd"), getattr(cpu, f"{kind}_bwd")
    y = fwd(gpu.asarray(x))
    ry = rfwd(f64(x))
    close(gpu, y, ry, dtype)
    # The backward from the kernel's own (rounded) output, as autograd would call it.
    yh = gpu.to_numpy(y)
    close(gpu, bwd(gpu.asarray(g), y), rbwd(f64(g), f64(yh)), dtype, factor=2)
