"""Canonical attention (deterministic/attention.py): query runs over the whole sequence compute
causal attention and its gradients (equal to the plain attention core to rounding), and
the sequence is refused when a rank's positions are not whole runs."""

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.deterministic.attention import canonical_attention
from minidist.deterministic.matmul import Tokens
from minidist.nn.attention import attention_core
from minidist.nn.layers import Dropout


def _qkv(seed=0, shape=(2, 3, 8, 4)):
    rng = np.random.default_rng(seed)
    return [Tensor(rng.standard_normal(shape), requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("runs", [1, 2, 4, 8])
def test_query_runs_compute_causal_attention_and_its_gradients(runs):
    q, k, v = _qkv()
    y = canonical_attention(q, k, v, Tokens(per_sequence=runs), Dropout(0.0), None, 0, 3)
    g = np.random.default_rng(1).standard_normal(y.shape)
    y.backward(g)
    q2, k2, v2 = _qkv()
    pos = np.arange(8)
    ref = attention_core(q2, k2, v2, pos, pos, Dropout(0.0), None, 0, 3, 8)
    ref.backward(g)
    np.testing.assert_allclose(y.data, ref.data, rtol=0, atol=1e-13)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        np.testing.assert_allclose(a.grad, b.grad, rtol=0, atol=1e-13)


def test_positions_that_are_not_whole_runs_are_refused():
    q, k, v = _qkv()
    zigzag = Tokens(positions=lambda rows: (np.array([0, 7]), 8), per_sequence=4)
    q, k, v = (Tensor(t.data[:, :, :2]) for t in (q, k, v))
    with pytest.raises(ValueError, match="not whole runs of 2"):
        canonical_attention(q, k, v, zigzag, Dropout(0.0), None, 0, 3)
