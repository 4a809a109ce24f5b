import numpy as np
import pytest

import kiln
from kiln.errors import DeviceError, DTypeError, KilnError


@pytest.mark.parametrize("name", ["float64", "float32", "bfloat16", "float16", "int64", "int32", "uint16", "bool"])
def test_every_dtype_round_trips(name):
    dt = kiln.get_dtype(name)
    t = kiln.tensor([1, 0, 2], dtype=dt)
    assert t.dtype is dt and t.numpy().dtype == dt.np
    assert t.to(kiln.float64).tolist() == [1.0, 0.0, 2.0 if name != "bool" else 1.0]


def test_defaults_follow_pytorch():
    assert kiln.tensor([1.5, 2.0]).dtype is kiln.float32
    assert kiln.tensor([1, 2]).dtype is kiln.int64
    assert kiln.tensor(np.zeros(2)).dtype is kiln.float64


def test_constructor_copies_and_item_numpy():
    a = np.arange(4.0)
    t = kiln.tensor(a)
    a[0] = 99
    assert t.item() if False else t[0].item() == 0.0
    with pytest.raises(KilnError, match="one element"):
        t.item()


def test_to_keeps_the_graph_through_casts():
    x = kiln.randn(3, dtype="float64", requires_grad=True)
    y = x.to("float32") * 2.0
    y.to(kiln.float64).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 2.0, 2.0])
    assert x.grad.dtype is kiln.float64


def test_bfloat16_tensors_compute():
    x = kiln.tensor([1.0, 2.0, 3.0], dtype="bfloat16")
    assert (x * 2.0).to("float32").tolist() == [2.0, 4.0, 6.0]


def test_bad_devices_and_dtypes():
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        kiln.zeros(2, device="tpu")
    with pytest.raises(DTypeError, match="unknown dtype 'float8'"):
        kiln.zeros(2, dtype="float8")
    with pytest.raises(DTypeError, match="floating-point"):
        kiln.tensor([1, 2], requires_grad=True)


@pytest.mark.skipif(kiln.cuda_is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_what_is_missing():
    with pytest.raises(DeviceError, match="(?i)cuda|gpu|cupy"):
        kiln.zeros(2, device="cuda")
