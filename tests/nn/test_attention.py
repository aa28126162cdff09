"""Causal self-attention against a plain NumPy loop over heads, and against finite differences."""

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor, gradcheck
from minidist.nn import CausalSelfAttention


def _numpy_attention(x, wqkv, bqkv, wo, bo, H):
    """One batch row and one head at a time, softmax written out: an independent reference."""
    B, T, C = x.shape
    D = C // H
    out = np.zeros_like(x)
    for b in range(B):
        qkv = x[b] @ wqkv + bqkv                           # (T, 3C)
        heads = []
        for h in range(H):
            q = qkv[:, h * D:(h + 1) * D]
            k = qkv[:, C + h * D:C + (h + 1) * D]
            v = qkv[:, 2 * C + h * D:2 * C + (h + 1) * D]
            y = np.zeros((T, D))
            for i in range(T):
                s = np.array([q[i] @ k[j] / np.sqrt(D) for j in range(i + 1)])   # past only
                w = np.exp(s - s.max())
                y[i] = (w / w.sum()) @ v[: i + 1]
            heads.append(y)
        out[b] = np.concatenate(heads, axis=1) @ wo + bo
    return out


@pytest.mark.parametrize("B,T,C,H", [(1, 1, 4, 1), (2, 5, 6, 3), (3, 4, 8, 2)])
def test_matches_numpy_reference(B, T, C, H):
    attn = CausalSelfAttention(C, H)
    seeding.init_parameters(attn, seed=B * 100 + T)
    for p in attn.parameters():                      # larger weights: sharper attention
        p.data[...] = seeding.draw(seeding.normal(0.5), p.shape, 9, str(p.shape))
    x = np.random.default_rng(0).standard_normal((B, T, C))
    want = _numpy_attention(x, attn.qkv.weight.data, attn.qkv.bias.data,
                            attn.proj.weight.data, attn.proj.bias.data, H)
    np.testing.assert_allclose(attn(Tensor(x)).data, want, rtol=0, atol=1e-13)


def test_future_tokens_do_not_change_the_past():
    attn = CausalSelfAttention(8, 2)
    seeding.init_parameters(attn, seed=1)
    x = np.random.default_rng(1).standard_normal((1, 6, 8))
    y = x.copy()
    y[0, 4:] += 10.0
    a, b = attn(Tensor(x)).data, attn(Tensor(y)).data
    assert np.array_equal(a[0, :4], b[0, :4]) and not np.allclose(a[0, 4:], b[0, 4:])


def test_gradcheck_input_and_weights():
    attn = CausalSelfAttention(4, 2)
    seeding.init_parameters(attn, seed=2)
    ps = attn.parameters()
    x = Tensor(np.random.default_rng(2).standard_normal((2, 3, 4)), requires_grad=True)

    def fn(x, wqkv, bqkv, wo, bo):
        attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias = wqkv, bqkv, wo, bo
        return attn(x)

    try:
        assert gradcheck(fn, [x, *ps], atol=1e-8, rtol=1e-6)
    finally:
        attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias = ps


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=4"):
        CausalSelfAttention(10, 4)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_added_causal_mask_gives_masked_fill_bit_for_bit(dtype):
    """scores + M (0 or -inf) equals masked_fill(scores, future, -inf) in the softmax and in
    the gradient of the scores, whose entries in the future are 0 either way."""
    from minidist.autograd import functional as F
    from minidist.nn.attention import causal_mask
    rng = np.random.default_rng(0)
    q_pos, k_pos = np.arange(3, 8), np.arange(0, 8)                 # a block of queries
    s0 = rng.standard_normal((2, 3, 5, 8)).astype(dtype)
    g = rng.standard_normal(s0.shape).astype(dtype)
    future = k_pos[None, :] > q_pos[:, None]
    runs = []
    for masked in (lambda s: s + causal_mask(q_pos, k_pos, s.dtype),
                   lambda s: F.masked_fill(s, future, -np.inf)):
        s = Tensor(s0.copy(), requires_grad=True)
        att = F.softmax(masked(s), axis=-1)
        att.backward(Tensor(g))
        runs.append((att.data, s.grad))
    (a1, d1), (a2, d2) = runs
    assert a1.dtype == dtype and np.array_equal(a1, a2) and np.array_equal(d1, d2)
    assert not d1[..., future].any() and (a1[..., future] == 0).all()
