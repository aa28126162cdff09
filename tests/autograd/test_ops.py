"""Elementwise, reduction, shape and indexing ops: values against plain NumPy, gradients
against central differences (gradcheck), broadcasting included."""

import numpy as np
import pytest

from minidist.autograd import Function, Tensor, gradcheck
from minidist.autograd.tensor import unbroadcast
from tests.helpers import assert_close


def _t(*shape, seed=0, low=None):
    a = np.random.default_rng(seed).standard_normal(shape)
    if low is not None:                                  # keep away from 0 (log, 1/x, x**0.5)
        a = np.abs(a) + low
    return Tensor(a, requires_grad=True)


BINARY_SHAPES = [((3, 4), (3, 4)), ((3, 1, 4), (4,)), ((4,), (3, 1, 4)), ((2, 3, 1), (1, 1, 5)),
                 ((3, 4), ())]


@pytest.mark.parametrize("sa,sb", BINARY_SHAPES)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_ops_broadcast(op, sa, sb):
    fn = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
          "mul": lambda a, b: a * b, "div": lambda a, b: a / b}[op]
    a, b = _t(*sa), _t(*sb, seed=1, low=0.5)
    assert_close(fn(a, b).data, fn(a.data, b.data), atol=0, what=f"{op} value")
    assert gradcheck(fn, [a, b])


@pytest.mark.parametrize("op", ["radd", "rsub", "rmul", "rdiv", "array_left", "neg"])
def test_constants_and_reflected_operators(op):
    c = np.random.default_rng(2).standard_normal((1, 4))
    fn = {"radd": lambda x: 2.0 + x, "rsub": lambda x: 1 - x, "rmul": lambda x: 3 * x,
          "rdiv": lambda x: 2.0 / x, "array_left": lambda x: c * x - c / x + (x - c),
          "neg": lambda x: -x}[op]
    x = _t(3, 4, low=0.5)
    assert_close(fn(x).data, fn(x.data), atol=1e-15, what=op)
    assert gradcheck(fn, [x])


@pytest.mark.parametrize("p", [2, 3, 0.5, -1.5])
def test_pow_scalar(p):
    x = _t(3, 4, low=0.5)
    assert_close((x ** p).data, x.data ** p, atol=1e-15, what=f"x**{p}")
    assert gradcheck(lambda x: x ** p, [x])


def test_pow_rejects_tensor_exponent():
    with pytest.raises(ValueError, match="constant number"):
        _t(3) ** _t(3)


@pytest.mark.parametrize("name", ["exp", "log", "tanh"])
def test_unary(name):
    x = _t(3, 4, low=0.2)
    assert_close(getattr(x, name)().data, getattr(np, name)(x.data), atol=0, what=name)
    assert gradcheck(lambda x: getattr(x, name)(), [x])


@pytest.mark.parametrize("axis", [None, 0, -1, (0, 2), (1,)])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("name", ["sum", "mean", "max"])
def test_reductions(name, axis, keepdims):
    x = _t(2, 3, 4)
    y = getattr(x, name)(axis=axis, keepdims=keepdims)
    expected = getattr(np, name)(x.data, axis=axis, keepdims=keepdims)
    assert_close(y.data, expected, atol=1e-15, what=f"{name} axis={axis}")
    assert gradcheck(lambda x: getattr(x, name)(axis=axis, keepdims=keepdims), [x])


def test_max_splits_gradient_evenly_among_ties():
    # Rows: [1, 5, 5] -> the two 5s share the gradient; [7, 2, 7] likewise; no ties in col max.
    x = Tensor(np.array([[1.0, 5.0, 5.0], [7.0, 2.0, 7.0]]), requires_grad=True)
    x.max(axis=1).backward(np.array([1.0, 4.0]))
    assert_close(x.grad, [[0, 0.5, 0.5], [2.0, 0, 2.0]], atol=0, what="ties along axis 1")
    x.zero_grad()
    x.max().backward()
    assert_close(x.grad, [[0, 0, 0], [0.5, 0, 0.5]], atol=0, what="ties, full reduction")


def test_reshape_transpose_permute():
    x = _t(2, 3, 4)
    assert x.reshape(6, 4).shape == (6, 4) and x.reshape((4, -1)).shape == (4, 6)
    assert_close(x.transpose().data, x.data.T, atol=0, what="reverse")
    assert_close(x.permute(1, 0, 2).data, x.data.transpose(1, 0, 2), atol=0, what="permute")
    assert_close(x.T.data, x.data.T, atol=0, what=".T")
    assert gradcheck(lambda x: x.reshape(4, 6) * np.arange(6.0), [x])
    assert gradcheck(lambda x: x.transpose(2, 0, 1) * np.arange(3.0), [x])
    assert gradcheck(lambda x: x.transpose((1, -1, 0)), [x])
    with pytest.raises(ValueError, match="permutation"):
        x.transpose(0, 0, 1)


@pytest.mark.parametrize("index", [
    1, -1, (slice(None), 2), (Ellipsis, slice(1, None, 2)), (None, 0, slice(None, 2)),
    np.array([2, 0, 2, 2]),                              # repeated integer indices
    (np.array([0, 1, 0]), np.array([3, 3, 3])),           # repeated pairs
    (slice(None), [0, 0, 1]),                             # mixed slice and list
    np.array([True, False, True]),                        # boolean mask
])
def test_getitem(index):
    x = _t(3, 4)
    assert_close(x[index].data, x.data[index], atol=0, what=f"x[{index!r}]")
    assert gradcheck(lambda x: x[index], [x])


def test_getitem_repeated_index_accumulates():
    x = Tensor(np.zeros(3), requires_grad=True)
    x[np.array([0, 0, 2, 0])].backward(np.array([1.0, 2.0, 3.0, 4.0]))
    assert_close(x.grad, [7.0, 0.0, 3.0], atol=0, what="scatter-add of repeated indices")
    y = Tensor(np.zeros(3), requires_grad=True)
    y[Tensor(np.array([1, 1]))].sum().backward()          # a Tensor as the index
    assert_close(y.grad, [0.0, 2.0, 0.0], atol=0, what="Tensor index")


def test_unbroadcast_sums_stretched_axes():
    g = np.arange(24.0).reshape(2, 3, 4)
    assert_close(unbroadcast(g, (4,)), g.sum(axis=(0, 1)), atol=0, what="(4,)")
    assert_close(unbroadcast(g, (3, 1)), g.sum(axis=(0, 2))[:, None], atol=0, what="(3, 1)")
    assert_close(unbroadcast(g, ()), g.sum(), atol=0, what="()")
    assert unbroadcast(g, (2, 3, 4)) is g


class _Probe(Function):
    """Identity that records the dtype of the gradient reaching it."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        _Probe.seen = []
        return x

    @staticmethod
    def backward(ctx, g):
        _Probe.seen.append(g.dtype)
        return (g,)


@pytest.mark.parametrize("fn", [
    lambda x, c: (x + c) * 2.0 - 1.0 / (x * x + 1.0),
    lambda x, c: (x * c).sum(axis=0).exp().mean(),
    lambda x, c: x.max(axis=-1, keepdims=True).tanh() / 3 + x[0].log(),
    lambda x, c: (x ** 2).transpose(1, 0).reshape(-1)[::2],
])
def test_float32_in_float32_out(fn):
    x = Tensor(np.abs(np.random.default_rng(0).standard_normal((3, 4))).astype(np.float32) + 1,
               requires_grad=True)
    c = np.ones(4, dtype=np.float32)
    y = _Probe.apply(x)
    out = fn(y, c)
    assert out.dtype == np.float32
    out.sum().backward()
    assert _Probe.seen == [np.float32]                    # the gradient arriving, before any cast
