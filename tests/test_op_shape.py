"""Shape ops: views, indexing, cat/split on the CPU; scatter_add (the index backward) on the GPU (`cuda`)."""

import numpy as np
import pytest

import kiln
from kiln.errors import ShapeError
from tests.conftest import close, f64, rand
from tests.gradcheck import gradcheck, randn


def test_reshape_transpose_permute():
    a = randn(2, 3, 4)
    gradcheck(lambda x: x.reshape(4, 6), a)
    gradcheck(lambda x: x.view(-1), a)
    gradcheck(lambda x: x.transpose(0, 2), a)
    gradcheck(lambda x: x.permute(1, 2, 0), a)
    np.testing.assert_array_equal(kiln.tensor(a).permute(2, 0, 1).numpy(), a.transpose(2, 0, 1))


@pytest.mark.parametrize("index", [1, (slice(None), 2), (Ellipsis, slice(1, 3)), (slice(None, None, 2), None)])
def test_basic_slicing(index):
    a = randn(4, 5)
    np.testing.assert_array_equal(kiln.tensor(a)[index].numpy(), a[index])
    gradcheck(lambda x: x[index], a)


def test_integer_array_indexing_adds_repeats():
    a = randn(5, 3)
    idx = np.array([0, 2, 2, 4, 0, 0])
    np.testing.assert_array_equal(kiln.tensor(a)[kiln.tensor(idx)].numpy(), a[idx])
    gradcheck(lambda x: x[kiln.tensor(idx)], a)
    rows, cols = np.array([1, 1, 3]), np.array([0, 2, 0])
    gradcheck(lambda x: x[kiln.tensor(rows), kiln.tensor(cols)], a)


def test_cat_and_split():
    a, b = randn(2, 3), randn(4, 3)
    gradcheck(lambda x, y: kiln.cat([x, y], dim=0), a, b)
    gradcheck(lambda x, y: kiln.cat([x.transpose(0, 1), y.transpose(0, 1)], dim=1), a, b)
    c = randn(7, 2)
    parts = kiln.tensor(c).split(3)
    assert [p.shape for p in parts] == [(3, 2), (3, 2), (1, 2)]
    gradcheck(lambda x: x.split([2, 5])[1] * 2.0, c)
    gradcheck(lambda x: x.split(3)[0] + x.split(3)[1], c)


def test_views_share_the_version_counter():
    x = kiln.randn(4, 4)
    v = x[1:3]
    x.add_(1.0)
    assert v.version == x.version == 1


def test_shape_errors():
    with pytest.raises(ShapeError, match=r"cannot reshape a tensor of shape \(2, 3\)"):
        kiln.randn(2, 3).reshape(4, 2)
    with pytest.raises(ShapeError, match="permute"):
        kiln.randn(2, 3).permute(0, 0)
    with pytest.raises(ShapeError, match="do not add up"):
        kiln.randn(5).split([2, 2])
    with pytest.raises(ShapeError, match="differ"):
        kiln.cat([kiln.randn(2, 3), kiln.randn(2, 4)])


# --- scatter_add (the backward of integer indexing) on the GPU ---------------------

@pytest.mark.cuda
def test_scatter_add_repeated_indices(gpu, rng):
    dst = rand((10, 4), np.float32, rng)
    idx = np.array([1, 3, 1, 1, 9])
    src = rand((5, 4), np.float32, rng)
    d = gpu.asarray(dst)
    gpu.scatter_add(d, gpu.asarray(idx), gpu.asarray(src))
    ref = f64(dst)
    np.add.at(ref, idx, f64(src))
    close(gpu, d, ref, np.float32)
