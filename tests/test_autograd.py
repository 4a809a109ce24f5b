import numpy as np
import pytest

import kiln
from kiln.errors import AutogradError
from kiln.nn import functional as F


def test_gradients_accumulate_across_uses_and_backward_calls():
    x = kiln.randn(3, dtype="float64", requires_grad=True)
    (x * x + x).sum().backward()
    first = x.grad.numpy().copy()
    np.testing.assert_allclose(first, 2 * x.numpy() + 1)
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), first + 3)


def test_no_grad_records_nothing():
    x = kiln.randn(3, requires_grad=True)
    with kiln.no_grad():
        y = x * 2
    assert not y.requires_grad and y.grad_fn is None
    assert (x * 2).requires_grad


def test_second_backward_through_a_freed_graph_raises_unless_retained():
    x = kiln.randn(4, dtype="float64", requires_grad=True)
    y = (x.exp() * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * (x.numpy() + 1) * np.exp(x.numpy()))
    with pytest.raises(AutogradError, match="second time"):
        y.backward()


def test_in_place_change_of_a_saved_tensor_is_an_error():
    w = kiln.randn(3, 3, requires_grad=True)
    a = kiln.randn(3)
    y = (w * a).sum()
    a.mul_(2.0)
    with pytest.raises(AutogradError, match="modified in place.*version 1.*version 0"):
        y.backward()
    x = kiln.randn(2, 3, requires_grad=True)
    h = x.tanh()  # tanh saves its output
    z = (h * 2.0).sum()
    with kiln.no_grad():
        h.detach()[0].add_(1.0)  # a view of that output, changed in place
    with pytest.raises(AutogradError, match="Tanh was modified in place"):
        z.backward()


def test_in_place_on_a_leaf_that_requires_grad_needs_no_grad():
    w = kiln.randn(3, requires_grad=True)
    with pytest.raises(AutogradError, match="no_grad"):
        w.add_(1.0)
    with kiln.no_grad():
        w.add_(1.0)


def test_hooks_fire_once_per_backward_when_the_gradient_is_final():
    a = kiln.randn(3, dtype="float64", requires_grad=True)
    b = kiln.randn(3, dtype="float64", requires_grad=True)
    seen = []
    a.register_post_accumulate_grad_hook(lambda t: seen.append(("a", t.grad.numpy().copy())))
    b.register_post_accumulate_grad_hook(lambda t: seen.append(("b", t.grad.numpy().copy())))
    h = a * 2.0          # a is used twice: its hook must wait for both uses
    y = (h * b).sum() + (a * a).sum()
    y.backward()
    assert sorted(name for name, _ in seen) == ["a", "b"]
    final_a = dict(seen)["a"]
    np.testing.assert_allclose(final_a, 2 * b.numpy() + 2 * a.numpy())


def test_hooks_fire_in_reverse_order_of_use():
    x = kiln.randn(2, 4)
    layers = [kiln.randn(4, 4, requires_grad=True) for _ in range(3)]
    order = []
    for i, w in enumerate(layers):
        w.register_post_accumulate_grad_hook(lambda t, i=i: order.append(i))
    h = x
    for w in layers:
        h = F.matmul(h, w).tanh()
    h.sum().backward()
    assert order == [2, 1, 0]


def test_a_branch_without_gradient_does_not_stall_the_rest():
    x = kiln.randn(3, dtype="float64", requires_grad=True)
    q, k = (x * 1.0).split(1)[0], (x * 2.0).split(1)[2]  # two outputs of split never used
    (q * k).sum().backward()
    g = np.zeros(3)
    g[0] = 2 * x.numpy()[2]
    g[2] = 2 * x.numpy()[0]
    np.testing.assert_allclose(x.grad.numpy(), g)


def test_detach_shares_storage_and_leaves_the_graph():
    x = kiln.randn(3, requires_grad=True)
    d = (x * 2).detach()
    assert not d.requires_grad and d.grad_fn is None


def test_backward_needs_a_gradient_for_non_scalars():
    x = kiln.randn(3, requires_grad=True)
    with pytest.raises(AutogradError, match="non-scalar"):
        (x * 2).backward()


def test_leaves_never_share_a_gradient_array():
    """Add's backward hands the same array to both inputs; AccumulateGrad copies what it does not own
    (a Linear's or a cast's fresh gradient it keeps as it is), so one leaf's .grad never aliases
    another's, and a second backward accumulates into each separately."""
    a, b = (kiln.tensor(np.ones(3, dtype=np.float32), requires_grad=True) for _ in range(2))
    w = kiln.tensor(np.ones((2, 3)), requires_grad=True)
    x = kiln.tensor(np.ones((4, 3), dtype=np.float32))
    for _ in range(2):
        loss = (a + b).sum() + (F.linear(x, w.to(kiln.float32)) * 2).sum()
        loss.backward()
    assert not np.shares_memory(a.grad.numpy(), b.grad.numpy())
    a.grad.data[...] = 0
    assert np.array_equal(b.grad.numpy(), [2.0, 2.0, 2.0])
    assert np.array_equal(w.grad.numpy(), np.full((2, 3), 16.0))


@pytest.mark.parametrize("materialize", [True, False])
def test_a_missing_output_gradient_is_zeros_or_none(materialize):
    """A multi-output Function gets zeros for an output no gradient reached, or None when it sets
    materialize_grads = False (as add_layer_norm does: no zero array to allocate and read)."""
    from kiln.autograd import Function
    seen = []

    class TwoOut(Function):
        materialize_grads = materialize

        @staticmethod
        def forward(ctx, x):
            return x.data * 2, x.data * 3

        @staticmethod
        def backward(ctx, ga, gb):
            seen.append((ga, gb))
            return (0 if ga is None else 2 * ga) + (0 if gb is None else 3 * gb)

    x = kiln.tensor(np.ones(3), requires_grad=True)
    _, b = TwoOut.apply(x)
    b.sum().backward()
    ga, gb = seen[0]
    np.testing.assert_array_equal(gb, np.ones(3))
    if materialize:
        np.testing.assert_array_equal(ga, np.zeros(3))
    else:
        assert ga is None
    np.testing.assert_array_equal(x.grad.numpy(), np.full(3, 3.0))


def test_two_fresh_gradients_of_one_tensor_are_summed_in_place():
    """A tensor used twice gets the sum of two gradients; when the first is a fresh array nothing else
    holds (an op with fresh_grads), the second is added into it: no third array (a tied embedding's
    gradient at the LM head's size)."""
    from kiln.autograd import Function

    made = []

    class Twice(Function):
        fresh_grads = True

        @staticmethod
        def forward(ctx, x):
            return x.data * 2.0

        @staticmethod
        def backward(ctx, g):
            made.append(g * 2.0)
            return made[-1]

    x = kiln.randn(4, dtype="float64", requires_grad=True)
    (Twice.apply(x) + Twice.apply(x) * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 8.0))
    assert len(made) == 2 and (x.grad.data is made[0] or x.grad.data is made[1])


def test_fresh_grads_per_input_keeps_the_fresh_ones_and_copies_the_shared_one():
    """fresh_grads as a tuple: an op whose backward returns one array for two inputs (not fresh) and a new
    array for a third (fresh, AddLayerNorm's dweight): the leaves get the fresh one as it is, the shared
    one copied (each leaf its own)."""
    from kiln.autograd import Function

    made = {}

    class SharedAndFresh(Function):
        fresh_grads = (False, False, True)

        @staticmethod
        def forward(ctx, x, y, w):
            return x.data + y.data + w.data

        @staticmethod
        def backward(ctx, g):
            made["shared"], made["fresh"] = g * 1.0, g * 2.0
            return made["shared"], made["shared"], made["fresh"]

    x, y, w = (kiln.randn(3, dtype="float64", requires_grad=True) for _ in range(3))
    SharedAndFresh.apply(x, y, w).sum().backward()
    assert w.grad.data is made["fresh"]
    assert x.grad.data is not made["shared"] and y.grad.data is not made["shared"]
    assert x.grad.data is not y.grad.data
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(3))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(3, 2.0))
