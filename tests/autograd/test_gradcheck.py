"""gradcheck itself: it must pass correct rules and catch wrong ones, naming the input and
the element; it works in float64 on copies and leaves the caller's tensors alone."""

import numpy as np
import pytest

from minidist.autograd import Function, Tensor, gradcheck
from minidist.autograd.tensor import unbroadcast


def _t(*shape, seed=0, dtype=np.float64):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype),
                  requires_grad=True)


class _Cube(Function):
    """y = x^3 with a backward that is right, or off by `bug` at one element."""
    bug = 0.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        dx = 3 * x * x * g
        dx.reshape(-1)[4] += _Cube.bug                   # one wrong element, index (1, 0)
        return (dx,)


def test_passes_a_correct_backward():
    _Cube.bug = 0.0
    assert gradcheck(_Cube.apply, [_t(3, 4)]) is True


def test_catches_a_wrong_element_and_names_it():
    _Cube.bug = 1e-3
    try:
        with pytest.raises(AssertionError, match=r"input 0 .*1 of 12 .*index \(1, 0\)"):
            gradcheck(_Cube.apply, [_t(3, 4)])
    finally:
        _Cube.bug = 0.0


class _MulForgetsBroadcast(Function):
    """y = a * b (b broadcast over axis 0) whose backward for b keeps only row 0's share."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return unbroadcast(g * b, a.shape), (g * a)[0]    # should be the sum over axis 0


def test_catches_a_missing_broadcast_reduction():
    with pytest.raises(AssertionError, match="input 1"):
        gradcheck(_MulForgetsBroadcast.apply, [_t(3, 4), _t(4, seed=1)])


class _SwappedGrads(Function):
    """y = a * b^2 with the two gradients swapped: right shapes, wrong values."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return 2 * a * b * g, b * b * g


def test_catches_swapped_gradients():
    with pytest.raises(AssertionError, match="input 0"):
        gradcheck(_SwappedGrads.apply, [_t(2, 3), _t(2, 3, seed=1)])


def test_catches_a_wrong_gradient_shape():
    class _Sum(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.shape = x.shape
            return x.sum(axis=0)

        @staticmethod
        def backward(ctx, g):
            return (np.broadcast_to(g, ctx.shape)[:1],)     # one row short

    with pytest.raises((AssertionError, RuntimeError), match="shape"):
        gradcheck(_Sum.apply, [_t(3, 2)])


def test_works_on_float64_copies_and_skips_constants():
    x32 = _t(2, 3, dtype=np.float32)
    before = x32.data.copy()
    const = Tensor(np.ones((2, 3)))                            # requires_grad=False: constant
    seen = []

    def fn(x, c, ids):
        seen.append(x.dtype)
        return (x * c)[ids]

    assert gradcheck(fn, [x32, const, np.array([0, 1, 1])])
    assert set(seen) == {np.dtype(np.float64)}
    assert np.array_equal(x32.data, before) and x32.grad is None and x32.dtype == np.float32


def test_tolerances_are_honoured():
    _Cube.bug = 1e-4
    try:
        assert gradcheck(_Cube.apply, [_t(3, 4)], atol=1e-3)   # a loose check lets it through
        with pytest.raises(AssertionError):
            gradcheck(_Cube.apply, [_t(3, 4)], atol=1e-6)
    finally:
        _Cube.bug = 0.0
