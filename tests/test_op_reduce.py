import numpy as np
import pytest

import kiln
from kiln.errors import ShapeError
from tests.gradcheck import gradcheck, randn


@pytest.mark.parametrize("dim", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_and_mean(dim, keepdim):
    a = randn(3, 4, 2)
    np.testing.assert_allclose(kiln.tensor(a).sum(dim, keepdim).numpy(),
                               a.sum(axis=dim, keepdims=keepdim), rtol=1e-13)
    np.testing.assert_allclose(kiln.tensor(a).mean(dim, keepdim).numpy(),
                               a.mean(axis=dim, keepdims=keepdim), rtol=1e-13)
    gradcheck(lambda x: x.sum(dim, keepdim), a)
    gradcheck(lambda x: x.mean(dim, keepdim), a)


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_max_along_a_dim(dim, keepdim):
    a = randn(4, 5)
    np.testing.assert_array_equal(kiln.tensor(a).max(dim, keepdim).numpy(), a.max(axis=dim, keepdims=keepdim))
    gradcheck(lambda x: x.max(dim, keepdim), a)
    assert kiln.tensor(a).argmax(dim).tolist() == a.argmax(axis=dim).tolist()


def test_max_of_everything_splits_the_gradient_among_ties():
    x = kiln.tensor([1.0, 3.0, 3.0, 2.0], requires_grad=True)
    x.max().backward()
    assert x.grad.tolist() == [0.0, 0.5, 0.5, 0.0]
    gradcheck(lambda t: t.max(), randn(3, 3))


def test_bad_dim_raises():
    with pytest.raises(ShapeError, match="dim 2 is out of range"):
        kiln.randn(3, 4).sum(2)
