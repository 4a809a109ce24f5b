"""Elementwise ops: gradients and values on the CPU; the add and cast kernels and host/device arrays on
the GPU (`cuda`)."""

import ml_dtypes
import numpy as np
import pytest

import kiln
from kiln.errors import DTypeError, ShapeError
from kiln.nn import functional as F
from tests.conftest import BF16, DTYPE_IDS, DTYPES, rand
from tests.gradcheck import gradcheck, randn

BROADCAST_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((1,), (2, 3))]


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", BROADCAST_SHAPES)
def test_binary_ops_gradients_broadcast_both_ways(op, shapes):
    a, b = randn(*shapes[0]), randn(*shapes[1])
    if op == "div":  # both are divisors below (fn(y, x)): away from 0, where the differences are not exact
        a, b = (np.sign(v) * (np.abs(v) + 0.5) for v in (a, b))
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
          "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[op]
    gradcheck(fn, a, b)
    gradcheck(lambda x, y: fn(y, x), a, b)


@pytest.mark.parametrize("name", ["neg", "exp", "log", "sqrt", "tanh"])
def test_unary_ops_gradients_and_values(name):
    a = randn(3, 5)
    if name in ("log", "sqrt"):
        a = np.abs(a) + 0.3
    fn = {"neg": lambda x: -x, "exp": lambda x: x.exp(), "log": lambda x: x.log(),
          "sqrt": lambda x: x.sqrt(), "tanh": lambda x: x.tanh()}[name]
    ref = {"neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh}[name]
    np.testing.assert_allclose(fn(kiln.tensor(a)).numpy(), ref(a), rtol=1e-14)
    gradcheck(fn, a)


def test_pow_gradients_for_base_and_exponent():
    a = np.abs(randn(2, 3)) + 0.5
    e = randn(3)
    gradcheck(lambda x, y: x ** y, a, e)
    gradcheck(lambda x: x ** 3, a)
    gradcheck(lambda x: 2.0 ** x, e)


def test_scalars_keep_the_tensor_dtype():
    x = kiln.randn(4, dtype="float32")
    for y in (x + 1, 2.5 * x, 1 - x, x / 3, x ** 2):
        assert y.dtype is kiln.float32


def test_where_gradients():
    rng = np.random.default_rng()
    cond = rng.random((3, 4)) > 0.5
    gradcheck(lambda a, b: F.where(kiln.tensor(cond), a, b), randn(3, 4), randn(4))


def test_comparisons_give_bool_tensors_without_grad():
    a = kiln.tensor([1.0, 2.0, 3.0], requires_grad=True)
    m = a > 1.5
    assert m.dtype is kiln.bool_ and not m.requires_grad
    assert m.tolist() == [False, True, True]


def test_mismatched_dtypes_and_shapes_raise():
    a = kiln.randn(3, dtype="float32")
    with pytest.raises(DTypeError, match="float32 and kiln.float64"):
        a + kiln.randn(3, dtype="float64")
    with pytest.raises(ShapeError, match=r"\(3,\) and \(4,\)"):
        a + kiln.randn(4)
    with pytest.raises(DTypeError, match="float scalar"):
        kiln.arange(3) * 0.5


# --- arrays -------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64, np.int64], ids=str)
def test_asarray_roundtrip(gpu, rng, dtype):
    x = (rng.standard_normal((3, 5)) * 10).astype(dtype)
    d = gpu.asarray(x)
    assert d.dtype == np.dtype(dtype) and d.shape == x.shape
    assert np.array_equal(gpu.to_numpy(d), x)
    assert gpu.to_numpy(gpu.zeros((2, 3), dtype)).sum() == 0
    assert gpu.empty((4,), dtype).shape == (4,)

# --- elementwise add and casts --------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099, 3 * 2**20 + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_and_cast_match_numpy(gpu, rng, n, dtype):
    a, b = rand((n,), dtype, rng), rand((n,), dtype, rng)
    got = gpu.to_numpy(gpu.add(gpu.asarray(a), gpu.asarray(b)))
    assert np.array_equal(got, (a.astype(np.float32) + b.astype(np.float32)).astype(dtype))  # fp32 math, one rounding
    da = gpu.asarray(a)
    gpu.add(da, gpu.asarray(b), out=da)  # in place, as AccumulateGrad does
    assert np.array_equal(gpu.to_numpy(da), got)
    for to in DTYPES:
        if np.dtype(to) != np.dtype(dtype):
            ref = a.astype(np.float32).astype(to)  # round to nearest even, as astype does
            assert np.array_equal(gpu.to_numpy(gpu.cast(gpu.asarray(a), to)), ref, equal_nan=True)
            out = gpu.asarray(rand((n,), to, rng))
            assert gpu.cast(gpu.asarray(a), to, out=out) is out  # into a kept buffer (KeptCopy.refresh)
            assert np.array_equal(gpu.to_numpy(out), ref, equal_nan=True)


@pytest.mark.cuda
def test_add_and_cast_of_unaligned_and_strided_views(gpu, rng):
    a, b = rand((2, 1001), np.float32, rng), rand((2, 1001), np.float32, rng)
    da, db = gpu.asarray(a), gpu.asarray(b)
    assert np.array_equal(gpu.to_numpy(gpu.add(da[:, 1:], db[:, 1:])), a[:, 1:] + b[:, 1:])  # strided: CuPy
    flat_a, flat_b = gpu.asarray(a.ravel()), gpu.asarray(b.ravel())
    assert np.array_equal(gpu.to_numpy(gpu.add(flat_a[1:], flat_b[1:])), a.ravel()[1:] + b.ravel()[1:])  # scalar loop
    assert np.array_equal(gpu.to_numpy(gpu.cast(flat_a[3:], BF16)), a.ravel()[3:].astype(BF16))
