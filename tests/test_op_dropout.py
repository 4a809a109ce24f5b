"""dropout and random numbers: the op on the CPU; the Philox generator and the dropout kernel on the GPU (`cuda`)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.errors import ConfigError
from kiln.nn import functional as F
from tests.conftest import DTYPE_IDS, DTYPES, rand
from tests.gradcheck import randn


def test_dropout_is_seeded_scaled_and_its_backward_is_the_mask():
    x = kiln.tensor(np.abs(randn(200, 50)) + 1.0, requires_grad=True)
    a = F.dropout(x, 0.3, generator=kiln.Generator(7))
    b = F.dropout(x, 0.3, generator=kiln.Generator(7))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    kept = a.numpy() != 0
    assert abs(kept.mean() - 0.7) < 0.02
    np.testing.assert_allclose(a.numpy()[kept], x.numpy()[kept] / 0.7, rtol=1e-6)
    a.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), kept / 0.7, rtol=1e-6)
    assert F.dropout(x, 0.3, training=False) is x
    with pytest.raises(ConfigError, match=r"\[0, 1\)"):
        F.dropout(x, 1.0)


# --- random numbers and dropout -----------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_rng_statistics_and_state(gpu, dtype):
    gen = gpu.new_generator(1234)
    state = gpu.generator_state(gen)
    n = gpu.to_numpy(gpu.rng_normal(gen, (1000, 1001), dtype)).astype(np.float64)
    u = gpu.to_numpy(gpu.rng_uniform(gen, (1000, 1001), dtype)).astype(np.float64)
    assert abs(n.mean()) < 5e-3 and abs(n.std() - 1.0) < 5e-3
    assert abs(u.mean() - 0.5) < 5e-3 and abs(u.var() - 1 / 12) < 5e-3
    assert u.min() >= 0.0 and (u.max() < 1.0 or dtype != np.float32)
    gpu.set_generator_state(gen, state)
    again = gpu.to_numpy(gpu.rng_normal(gen, (1000, 1001), dtype)).astype(np.float64)
    assert np.array_equal(n, again)
    other = gpu.to_numpy(gpu.rng_normal(gpu.new_generator(1235), (1000, 1001), dtype)).astype(np.float64)
    assert not np.array_equal(n, other)
    import json
    json.dumps(gpu.generator_state(gen))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dropout(gpu, rng, dtype):
    x = rand((513, 257), dtype, rng)
    gen = gpu.new_generator(7)
    p = 0.3
    y, mask = gpu.dropout_fwd(gpu.asarray(x), p, gen)
    yh, mh = gpu.to_numpy(y).astype(np.float64), gpu.to_numpy(mask).astype(np.float64)
    keep_value = float(np.asarray(1.0 / (1.0 - p), dtype=dtype))
    assert set(np.unique(mh)) <= {0.0, keep_value}
    assert abs((mh == 0).mean() - p) < 0.01
    assert np.array_equal(yh, (x * np.asarray(mh, dtype=dtype)).astype(np.float64))
    y2, _ = gpu.dropout_fwd(gpu.asarray(x), p, gen)
    assert not np.array_equal(gpu.to_numpy(y2).astype(np.float64), yh)  # the generator moved on
