"""nn/layers.py against plain NumPy, and gradients against finite differences."""

import math

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor, gradcheck
from minidist.nn import MLP, Dropout, DropoutKey, Embedding, LayerNorm, Linear


def _x(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def _gelu_tanh(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def test_linear_is_x_at_w_plus_b_with_w_in_out():
    lin = Linear(3, 5)
    seeding.init_parameters(lin, seed=0)
    assert lin.weight.shape == (3, 5)
    x = _x(2, 4, 3)
    want = x.data @ lin.weight.data + lin.bias.data
    np.testing.assert_allclose(lin(x).data, want, rtol=0, atol=1e-15)
    nob = Linear(3, 5, bias=False)
    assert nob.bias is None and len(nob.parameters()) == 1


def test_embedding_and_layer_norm_match_numpy():
    emb = Embedding(6, 4)
    seeding.init_parameters(emb, seed=0)
    ids = np.array([[0, 5, 5], [2, 1, 0]])
    assert np.array_equal(emb(ids).data, emb.weight.data[ids])
    ln = LayerNorm(4)
    seeding.init_parameters(ln, seed=0)
    ln.weight.data[...] = [1.0, 2.0, 0.5, -1.0]
    ln.bias.data[...] = [0.0, 0.1, 0.2, 0.3]
    x = _x(3, 4)
    mu, var = x.data.mean(-1, keepdims=True), x.data.var(-1, keepdims=True)
    want = (x.data - mu) / np.sqrt(var + 1e-5) * ln.weight.data + ln.bias.data
    np.testing.assert_allclose(ln(x).data, want, rtol=0, atol=1e-14)


def test_mlp_matches_numpy_and_gradchecks():
    mlp = MLP(3, 6)
    seeding.init_parameters(mlp, seed=5)
    x = _x(2, 3)
    h = _gelu_tanh(x.data @ mlp.fc.weight.data + mlp.fc.bias.data)
    want = h @ mlp.proj.weight.data + mlp.proj.bias.data
    np.testing.assert_allclose(mlp(x).data, want, rtol=0, atol=1e-15)

    ps = mlp.parameters()

    def fn(x, w1, b1, w2, b2):
        mlp.fc.weight, mlp.fc.bias, mlp.proj.weight, mlp.proj.bias = w1, b1, w2, b2
        return mlp(x)

    try:
        assert gradcheck(fn, [x, *ps], atol=1e-8, rtol=1e-6)
    finally:
        mlp.fc.weight, mlp.fc.bias, mlp.proj.weight, mlp.proj.bias = ps


def test_dropout_masks_are_addressed_by_global_row():
    drop = Dropout(0.25, name="blocks.0.mlp.drop")
    x = Tensor(np.ones((6, 50)))
    full = drop(x, DropoutKey(seed=0, step=3, sample_ids=tuple(range(10, 16)))).data
    kept = full != 0
    assert np.allclose(full[kept], 1 / 0.75) and 0.15 < 1 - kept.mean() < 0.35
    part = drop(Tensor(np.ones((2, 50))), DropoutKey(0, 3, (12, 13))).data   # rows 2..3
    assert np.array_equal(part, full[2:4])
    other_step = drop(x, DropoutKey(0, 4, tuple(range(10, 16)))).data
    assert not np.array_equal(other_step, full)
    drop.eval()
    assert drop(x, None) is x
    drop.train()
    with pytest.raises(ValueError, match="DropoutKey"):
        drop(x, None)
    with pytest.raises(ValueError, match="p=1.0"):
        Dropout(1.0)


def test_dropout_of_a_non_contiguous_slice_draws_the_single_process_mask():
    d = Dropout(0.5, name="d")
    key = DropoutKey(3, 1, (4, 9))
    full = d.scale((2, 6, 5), np.float64, key)                       # (B, T, C)
    picked = np.array([0, 5, 2])                                      # a zig-zag-like slice
    part = d.scale((2, 3, 5), np.float64, key, {1: (picked, 6)})
    assert np.array_equal(part, full[:, picked])
    assert np.array_equal(d.scale((2, 2, 5), np.float64, key, {1: (4, 6)}), full[:, 4:6])
    with pytest.raises(ValueError, match="axis 1 has 3 elements but 2 global indices"):
        d.scale((2, 3, 5), np.float64, key, {1: (np.array([0, 1]), 6)})
