"""Tensor and the backward walk: construction, accumulation, graph order, no_grad, detach,
Function as an extension hook. Expected gradients are worked out in closed form."""

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Function, Tensor, is_grad_enabled, no_grad
from tests.helpers import assert_close


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.fixture
def float32_default():
    backend.set_default_dtype("float32")
    yield
    backend.set_default_dtype("float64")


def test_construction_keeps_arrays_and_uses_default_dtype_for_numbers(float32_default):
    a = _rand(2, 3).astype(np.float32)
    t = Tensor(a)
    assert t.data is a and t.dtype == np.float32              # no copy, no conversion
    assert Tensor([1.0, 2.0]).dtype == np.float32              # Python floats: the default
    assert Tensor(2.5).dtype == np.float32 and Tensor(2.5).shape == ()
    assert Tensor([1, 2]).dtype.kind == "i"                   # integers stay integers
    assert Tensor(np.float64(1.0)).dtype == np.float64          # a NumPy scalar keeps its dtype
    backend.set_default_dtype("float64")
    assert Tensor([1.0]).dtype == np.float64
    with pytest.raises(ValueError, match="float"):
        Tensor([1, 2], requires_grad=True)


def test_array_like_attributes():
    t = Tensor(_rand(2, 3, 4))
    assert (t.shape, t.ndim, t.size, len(t)) == ((2, 3, 4), 3, 24, 2)
    assert t.dtype == np.float64 and t.requires_grad is False and t.grad is None
    assert isinstance(t.numpy(), np.ndarray)
    assert Tensor([[3.5]]).item() == 3.5
    assert "requires_grad=True" in repr(Tensor(1.0, requires_grad=True))


def test_scalar_backward_and_accumulation_across_calls():
    x_np = _rand(3, 4)
    x = Tensor(x_np, requires_grad=True)
    (x * x).sum().backward()
    assert_close(x.grad, 2 * x_np, atol=1e-15, what="d sum(x^2)/dx = 2x")
    (x * x).sum().backward()                                  # accumulates: += semantics
    assert_close(x.grad, 4 * x_np, atol=1e-15, what="after a second backward")
    x.zero_grad()
    assert x.grad is None


def test_diamond_graph_sums_both_paths():
    # y = x*x + 3x uses x on two paths: dy/dx = 2x + 3.
    x_np = _rand(5)
    x = Tensor(x_np, requires_grad=True)
    y = x * x + 3 * x
    y.backward(np.ones(5))
    assert_close(x.grad, 2 * x_np + 3, atol=1e-15, what="diamond")


def test_reverse_topological_order_on_shared_intermediate():
    # h is used twice, and one use is reached through a longer path; its gradient must be
    # complete (both contributions) before h's own backward runs: d/dx of (h + h*h), h = 2x.
    x_np = _rand(4)
    x = Tensor(x_np, requires_grad=True)
    h = x * 2.0
    ((h * h).exp().log() + h).sum().backward()
    assert_close(x.grad, 2 * (2 * (2 * x_np)) + 2, atol=1e-13, what="shared intermediate")


def test_deep_chain_needs_no_recursion():
    x = Tensor(np.zeros(2), requires_grad=True)
    y = x
    for _ in range(5000):                     # deeper than Python's recursion limit
        y = y + 1.0
    y.sum().backward()
    assert_close(x.grad, np.ones(2), atol=0, what="5000-deep chain")


def test_backward_argument_checks():
    x = Tensor(_rand(3), requires_grad=True)
    with pytest.raises(ValueError, match="one-element"):
        (x * 2).backward()
    with pytest.raises(ValueError, match="shape"):
        (x * 2).backward(np.ones(4))
    with pytest.raises(ValueError, match="does not require grad"):
        Tensor(_rand(3)).sum().backward()


def test_leaf_grads_never_alias():
    # z = a + b hands the same gradient array to a and b; in-place edits of one .grad
    # (as clipping does) must not change the other, nor the caller's grad.
    a, b = Tensor(_rand(3), requires_grad=True), Tensor(_rand(3, seed=1), requires_grad=True)
    g = np.ones(3)
    (a + b).backward(g)
    a.grad *= 10.0
    assert_close(b.grad, np.ones(3), atol=0, what="b.grad after editing a.grad")
    assert_close(g, np.ones(3), atol=0, what="caller's grad")
    c = Tensor(_rand(2, 3), requires_grad=True)
    c.reshape(6).backward(np.arange(6.0))              # the gradient arrives as a view
    c.grad += 1.0
    assert c.grad.base is None


def test_no_grad_records_nothing_and_restores_state():
    x = Tensor(_rand(3), requires_grad=True)
    assert is_grad_enabled()
    with no_grad():
        assert not is_grad_enabled()
        with no_grad():
            pass
        assert not is_grad_enabled()                   # nested exit keeps the outer state
        y = x * 2
    assert is_grad_enabled()
    assert not y.requires_grad and y._node is None


def test_detach_shares_data_and_cuts_the_graph():
    x_np = _rand(3)
    x = Tensor(x_np, requires_grad=True)
    d = x.detach()
    assert d.data is x.data and not d.requires_grad
    (d * x).sum().backward()                           # only the direct path counts
    assert_close(x.grad, x_np, atol=0, what="grad through detach")


def test_ndarray_on_the_left_gives_a_tensor():
    x = Tensor(_rand(3), requires_grad=True)
    y = np.ones(3) + x
    assert isinstance(y, Tensor) and y.requires_grad
    z = np.full(3, 2.0) * x
    z.sum().backward()
    assert_close(x.grad, np.full(3, 2.0), atol=0, what="d(2x)/dx")


def test_float32_leaf_meets_float64_constant():
    w = Tensor(_rand(3).astype(np.float32), requires_grad=True)
    (w * np.ones(3)).sum().backward()                  # the product is float64
    assert w.grad.dtype == np.float32


class _ScaleAndShift(Function):
    """y = a * x + b (x, b tensors, a a keyword): dx = a * g, db = g."""

    @staticmethod
    def forward(ctx, x, b, *, a):
        ctx.a = a
        ctx.save_for_backward(x)
        ctx.seen_needs = tuple(ctx.needs_input_grad)
        return a * x + b

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        assert x.shape == g.shape
        return ctx.a * g, g


def test_function_extension_hook():
    x = Tensor(_rand(4), requires_grad=True)
    b = Tensor(_rand(4, seed=1))                       # a constant tensor
    y = _ScaleAndShift.apply(x, b, a=3.0)
    assert y.requires_grad and y._node[1].seen_needs == (True, False)
    y.backward(np.arange(4.0))
    assert_close(x.grad, 3.0 * np.arange(4.0), atol=0, what="custom Function dx")
    assert b.grad is None
    with no_grad():
        assert not _ScaleAndShift.apply(x, b, a=1.0).requires_grad
    assert not _ScaleAndShift.apply(b, b, a=1.0).requires_grad


class _WrongShape(Function):
    @staticmethod
    def forward(ctx, x):
        return x.sum()

    @staticmethod
    def backward(ctx, g):
        return (g,)                                    # forgot to broadcast back


def test_wrong_gradient_shape_is_reported():
    x = Tensor(_rand(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="shape"):
        _WrongShape.apply(x).backward()


def test_grad_hook_fires_once_per_backward_after_every_use():
    from minidist.autograd import Tensor
    w = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    seen = []
    w.register_grad_hook(lambda t: seen.append(t.grad.copy()))
    x = Tensor(np.array([3.0, 4.0]))
    ((w * x).sum() + (w * w).sum()).backward()        # two uses of w: one final gradient
    assert len(seen) == 1 and np.array_equal(seen[0], x.data + 2 * w.data)
    (w * x).sum().backward()                          # accumulates, fires again
    assert len(seen) == 2 and np.array_equal(seen[1], 2 * x.data + 2 * w.data)


def test_grad_hook_only_on_leaves():
    from minidist.autograd import Tensor
    w = Tensor(np.array([1.0]), requires_grad=True)
    with pytest.raises(ValueError, match="only leaves"):
        (w * 2).register_grad_hook(lambda t: None)
