"""functional (F): every op's value against a plain NumPy formula and its gradient against
central differences; the fused ops' hand-written backward included; float32 stays float32."""

import math

import numpy as np
import pytest

from minidist.autograd import Function, Tensor, gradcheck
from minidist.autograd import functional as F
from tests.helpers import assert_close


def _t(*shape, seed=0, scale=1.0):
    return Tensor(scale * np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


# --- matmul, concatenate, split ---

@pytest.mark.parametrize("sa,sb", [
    ((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4, 3)),
    ((2, 3, 4), (4,)), ((4,), (4,)), ((4,), (2, 4, 3)), ((3, 4), (2, 4, 2)),
])
def test_matmul_with_broadcast_batch_dims(sa, sb):
    a, b = _t(*sa), _t(*sb, seed=1)
    assert_close((a @ b).data, np.matmul(a.data, b.data), atol=1e-14, what=f"{sa} @ {sb}")
    assert gradcheck(F.matmul, [a, b])


def test_matmul_with_constant_operand():
    w = _t(4, 3)
    x = np.random.default_rng(2).standard_normal((2, 5, 4))
    assert gradcheck(lambda w: x @ w, [w])
    assert gradcheck(lambda w: w.T @ x.transpose(0, 2, 1), [w])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("xshape", [(2, 3, 5), (4, 5), (5,)])
def test_linear_is_matmul_then_add_bit_for_bit(dtype, xshape):
    """fused.Linear adds the bias in place: the same bits as x @ W + b, forward and grads."""
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s).astype(dtype) for s in (xshape, (5, 7), (7,))]
    g = rng.standard_normal(xshape[:-1] + (7,)).astype(dtype)
    runs = []
    for op in (lambda x, w, b: F.linear(x, w, b), lambda x, w, b: x @ w + b):
        x, w, b = (Tensor(a.copy(), requires_grad=True) for a in arrays)
        y = op(x, w, b)
        y.backward(Tensor(g))
        runs.append([y.data, x.grad, w.grad, b.grad])
    for got, want, what in zip(*runs, ("y", "dx", "dW", "db")):
        assert got.dtype == want.dtype == dtype and np.array_equal(got, want), what
    assert gradcheck(F.linear, [_t(2, 3, 4), _t(4, 5, seed=1), _t(5, seed=2)])


def test_linear_with_a_wider_bias_or_none_is_the_unfused_sum():
    x, w = (Tensor(np.ones(s, np.float32)) for s in ((2, 3), (3, 4)))
    b = Tensor(np.full(4, 0.1))                                         # float64
    assert F.linear(x, w, b).dtype == (x @ w + b).dtype == np.float64
    assert np.array_equal(F.linear(x, w, b).data, (x @ w + b).data)
    assert np.array_equal(F.linear(x, w).data, (x @ w).data)


def test_concatenate_and_split():
    a, b = _t(2, 3), _t(2, 2, seed=1)
    assert_close(F.concatenate([a, b], axis=1).data, np.concatenate([a.data, b.data], 1),
                 atol=0, what="concatenate")
    assert gradcheck(lambda a, b: F.concatenate([a, b], axis=-1), [a, b])
    assert gradcheck(lambda a: F.concatenate([a, a * 2.0], axis=0), [a])
    x = _t(2, 6, 3)
    for parts in (3, [1, 4]):
        pieces = F.split(x, parts, axis=1)
        for piece, ref in zip(pieces, np.split(x.data, parts, axis=1)):
            assert_close(piece.data, ref, atol=0, what=f"split {parts}")
    assert gradcheck(lambda x: F.split(x, 3, axis=-2)[0] * F.split(x, 3, axis=-2)[2], [x])
    with pytest.raises(ValueError, match="equal"):
        F.split(x, 4, axis=1)


# --- activations ---

def _gelu_tanh_np(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_exact_np(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("approximate,ref", [("tanh", _gelu_tanh_np), ("none", _gelu_exact_np)])
def test_gelu(approximate, ref):
    x = _t(3, 5, scale=2.0)
    assert_close(F.gelu(x, approximate).data, ref(x.data), atol=1e-14, what=approximate)
    assert gradcheck(lambda x: F.gelu(x, approximate), [x])
    with pytest.raises(ValueError, match="approximate"):
        F.gelu(x, "fast")


def test_relu():
    x = _t(4, 5)
    assert_close(F.relu(x).data, np.maximum(x.data, 0), atol=0, what="relu")
    assert gradcheck(F.relu, [x])


def test_exp_log_tanh_aliases():
    x = Tensor(np.abs(np.random.default_rng(0).standard_normal(5)) + 0.5, requires_grad=True)
    assert gradcheck(lambda x: F.tanh(F.log(F.exp(x) + x)), [x])


def _softmax_np(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax(axis):
    x = _t(3, 4, 5, scale=3.0)
    assert_close(F.softmax(x, axis).data, _softmax_np(x.data, axis), atol=1e-15, what="softmax")
    log_ref = x.data - np.log(np.exp(x.data).sum(axis=axis, keepdims=True))
    assert_close(F.log_softmax(x, axis).data, log_ref, atol=1e-14, what="log_softmax")
    assert gradcheck(lambda x: F.softmax(x, axis), [x])
    assert gradcheck(lambda x: F.log_softmax(x, axis), [x])


def test_softmax_is_stable_for_large_logits():
    x = Tensor(np.array([[1000.0, 1001.0, -1000.0]]))
    assert_close(F.softmax(x).data, _softmax_np(x.data, -1), atol=1e-15, what="shifted softmax")
    assert np.isfinite(F.log_softmax(x).data).all()


# --- layer_norm ---

def _layer_norm_np(x, w, b, eps):
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine):
    x, w, b = _t(2, 3, 6), _t(6, seed=1), _t(6, seed=2)
    w, b = (w, b) if affine else (None, None)
    out = F.layer_norm(x, w, b, eps=1e-5)
    ref = _layer_norm_np(x.data, w and w.data, b and b.data, 1e-5)
    assert_close(out.data, ref, atol=1e-14, what="layer_norm")
    args = [x, w, b] if affine else [x]
    assert gradcheck(lambda *a: F.layer_norm(a[0], *(a[1:] or (None, None))), args)


# --- embedding ---

def test_embedding_with_repeated_ids():
    w = _t(5, 3)
    ids = np.array([[1, 4, 1], [0, 1, 1]])
    assert_close(F.embedding(w, ids).data, w.data[ids], atol=0, what="rows")
    assert gradcheck(lambda w: F.embedding(w, ids), [w])
    w.zero_grad()
    F.embedding(w, ids).sum().backward()
    counts = np.bincount(ids.ravel(), minlength=5)[:, None] * np.ones((1, 3))
    assert_close(w.grad, counts, atol=0, what="dw rows = number of uses")


@pytest.mark.parametrize("V, N, C", [(64, 512, 256), (300, 2000, 64), (5, 40, 3), (1, 3000, 2)])
def test_add_rows_at_is_add_at_bit_for_bit(V, N, C):
    """Rounds of distinct ids give add.at's sums, in add.at's order: the same bits (float32,
    where the order of additions shows), also for -0.0 rows and for an empty batch. The
    first two sizes run in rounds, the last two call add.at (more rounds than rows' worth)."""
    rng = np.random.default_rng(V)
    ids = rng.integers(0, V, N)
    rows = rng.standard_normal((N, C)).astype(np.float32)
    rows[::5] = -0.0
    for idx, r in ((ids, rows), (ids[:0], rows[:0])):
        want = np.zeros((V, C), np.float32)
        np.add.at(want, idx, r)
        got = np.zeros((V, C), np.float32)
        F.add_rows_at(got, idx, r)
        assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))


def test_embedding_rejects_bad_ids():
    w = _t(5, 3)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        F.embedding(w, np.array([0, 5]))
    with pytest.raises(ValueError, match="integers"):
        F.embedding(w, np.array([0.0, 1.0]))


# --- cross_entropy ---

def _cross_entropy_np(z, t, ignore_index):
    """Row by row: -log softmax(z_n)[t_n], skipping ignored rows; returns (losses, kept)."""
    z2, t2 = z.reshape(-1, z.shape[-1]), t.reshape(-1)
    losses = np.zeros(len(t2))
    for n in range(len(t2)):
        if t2[n] != ignore_index:
            losses[n] = -math.log(math.exp(z2[n, t2[n]]) / np.exp(z2[n]).sum())
    return losses.reshape(t.shape), t != ignore_index


TARGETS = np.array([[0, 3, -100, 2], [1, -100, 1, 4]])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_ignored_targets(reduction):
    z = _t(2, 4, 5, scale=2.0)
    losses, kept = _cross_entropy_np(z.data, TARGETS, -100)
    ref = {"mean": losses.sum() / kept.sum(), "sum": losses.sum(), "none": losses}[reduction]
    out = F.cross_entropy(z, TARGETS, reduction=reduction)
    assert_close(out.data, ref, atol=1e-14, what=reduction)
    assert gradcheck(lambda z: F.cross_entropy(z, TARGETS, reduction=reduction), [z])
    z.zero_grad()
    F.cross_entropy(z, TARGETS, reduction=reduction).sum().backward()
    assert np.all(z.grad[~kept] == 0), "ignored rows must get exactly zero gradient"


def test_cross_entropy_2d_logits_and_custom_ignore_index():
    z = _t(6, 3)
    t = np.array([0, 2, 7, 1, 7, 0])
    losses, kept = _cross_entropy_np(z.data, t, 7)
    assert_close(F.cross_entropy(z, t, ignore_index=7).data, losses.sum() / 4, atol=1e-15,
                 what="ignore_index=7")
    assert gradcheck(lambda z: F.cross_entropy(z, t, ignore_index=7), [z])


def test_cross_entropy_all_ignored_is_zero_with_zero_grad():
    z = _t(2, 3)
    loss = F.cross_entropy(z, np.array([-100, -100]))
    loss.backward()
    assert loss.item() == 0.0 and np.all(z.grad == 0)


def test_cross_entropy_ignored_rows_stay_zero_when_logits_hold_minus_inf():
    """Masked columns (-inf, as a padded vocabulary's) in an ignored row: its loss was
    inf * 0 = NaN (the gathered column of an ignored row is column 0, here -inf)."""
    z = _t(3, 5)
    z.data[:, 0] = -np.inf
    t = np.array([2, -100, 4])
    out = F.cross_entropy(z, t, reduction="none")
    losses, _ = _cross_entropy_np(np.where(np.isinf(z.data), -1e300, z.data), t, -100)
    assert out.data[1] == 0.0 and np.isfinite(out.data).all(), out.data
    assert_close(out.data, losses, atol=1e-14, what="masked columns")
    F.cross_entropy(z, t).backward()
    assert np.all(z.grad[:, 0] == 0) and np.isfinite(z.grad).all()


def test_cross_entropy_rejects_bad_targets():
    z = _t(2, 3)
    with pytest.raises(ValueError, match="3 classes"):
        F.cross_entropy(z, np.array([0, 3]))
    with pytest.raises(ValueError, match="shape"):
        F.cross_entropy(z, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="reduction"):
        F.cross_entropy(z, np.array([0, 1]), reduction="max")


# --- dropout ---

def test_dropout_is_deterministic_given_the_generator():
    x = Tensor(np.ones((50, 40)), requires_grad=True)
    y1 = F.dropout(x, 0.25, np.random.default_rng(7))
    y2 = F.dropout(x, 0.25, np.random.default_rng(7))
    y3 = F.dropout(x, 0.25, np.random.default_rng(8))
    assert np.array_equal(y1.data, y2.data) and not np.array_equal(y1.data, y3.data)
    keep = np.random.default_rng(7).random((50, 40)) >= 0.25          # the documented mask
    assert_close(y1.data, keep / 0.75, atol=1e-15, what="inverted-dropout values")
    assert abs(keep.mean() - 0.75) < 0.05
    y1.backward(np.full((50, 40), 2.0))
    assert_close(x.grad, 2.0 * keep / 0.75, atol=1e-15, what="dx = g * mask / (1 - p)")
    x32 = Tensor(np.ones((50, 40), dtype=np.float32))
    y32 = F.dropout(x32, 0.25, np.random.default_rng(7))
    assert y32.dtype == np.float32 and np.array_equal(y32.data != 0, keep)


def test_dropout_identity_cases_and_gradcheck():
    x = _t(3, 4)
    assert F.dropout(x, 0.0, np.random.default_rng(0)) is x
    assert F.dropout(x, 0.5, np.random.default_rng(0), training=False) is x
    assert gradcheck(lambda x: F.dropout(x, 0.5, np.random.default_rng(3)), [x])
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        F.dropout(x, 1.0, np.random.default_rng(0))


# --- where, masked_fill ---

def test_where_and_masked_fill_broadcast():
    cond = np.array([[True, False, True, False]])                      # (1, 4)
    a, b = _t(3, 4), _t(4, seed=1)
    assert_close(F.where(cond, a, b).data, np.where(cond, a.data, b.data), atol=0, what="where")
    assert gradcheck(lambda a, b: F.where(cond, a, b), [a, b])
    assert gradcheck(lambda a: F.where(Tensor(cond), 0.5, a), [a])
    filled = F.masked_fill(a, cond, -3.0)
    assert_close(filled.data, np.where(cond, -3.0, a.data), atol=0, what="masked_fill")
    assert gradcheck(lambda a: F.masked_fill(a, cond, -3.0), [a])
    causal = np.triu(np.ones((3, 3), bool), 1)
    s = F.softmax(F.masked_fill(_t(2, 3, 3), causal, -np.inf))
    assert np.all(s.data[:, causal] == 0)


# --- float32 stays float32, forward and backward ---

class _Probe(Function):
    """Identity that records the dtype of each gradient reaching it."""
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        _Probe.seen.append(g.dtype)
        return (g,)


FLOAT32_CASES = {
    "matmul": lambda x: x @ np.ones((4, 2), np.float32),
    "linear": lambda x: F.linear(x, Tensor(np.ones((4, 2), np.float32)),
                                 Tensor(np.ones(2, np.float32))),
    "gelu_tanh": lambda x: F.gelu(x),
    "gelu_exact": lambda x: F.gelu(x, "none"),
    "relu": F.relu,
    "softmax": F.softmax,
    "log_softmax": F.log_softmax,
    "layer_norm": lambda x: F.layer_norm(x, Tensor(np.ones(4, np.float32)), None),
    "cross_entropy": lambda x: F.cross_entropy(x, np.array([[0, -100, 3], [1, 1, 2]])),
    "embedding": lambda x: F.embedding(x[0], np.array([0, 2, 2])),
    "concatenate": lambda x: F.concatenate([x, x], axis=-1),
    "split": lambda x: F.split(x, 2, axis=-1)[1],
    "dropout": lambda x: F.dropout(x, 0.3, np.random.default_rng(0)),
    "where": lambda x: F.where(x.data > 0, x, 0.0),
    "masked_fill": lambda x: F.masked_fill(x, x.data > 0, -np.inf),
}


@pytest.mark.parametrize("name", sorted(FLOAT32_CASES))
def test_float32_in_float32_out(name):
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32),
               requires_grad=True)
    _Probe.seen = []
    out = FLOAT32_CASES[name](_Probe.apply(x))
    assert out.dtype == np.float32, f"{name} forward gave {out.dtype}"
    (out * 1.0).sum().backward()
    assert _Probe.seen == [np.float32], f"{name} backward gave {_Probe.seen}"
