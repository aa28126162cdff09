"""nn/moe.py: routing order, capacity drops and the aux loss on a case worked out by hand."""

import math

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor, gradcheck
from minidist.nn import MoE, expert_capacity, route

# Four tokens, three experts, top-2. Router probabilities chosen by hand:
PROBS = np.array([[0.5, 0.3, 0.2],      # token 0: choices (0, 1)
                  [0.6, 0.1, 0.3],      # token 1: choices (0, 2)
                  [0.2, 0.7, 0.1],      # token 2: choices (1, 0)
                  [0.4, 0.2, 0.4]])     # token 3: tie 0/2 -> lower index first: (0, 2)
# capacity_factor 0.75: capacity = ceil(0.75 * K=2 * N=4 / E=3) = ceil(2.0) = 2.
# Admission order: first choices t0..t3, then second choices t0..t3:
#   t0->e0 slot 0, t1->e0 slot 1, t2->e1 slot 0, t3->e0 FULL (dropped),
#   t0->e1 slot 1, t1->e2 slot 0, t2->e0 FULL (dropped), t3->e2 slot 1.
CHOICE = [[0, 1], [0, 2], [1, 0], [0, 2]]
KEPT = [[True, True], [True, True], [True, False], [False, True]]
SLOT = [[0, 1], [1, 0], [0, -1], [-1, 1]]
LOAD = [4, 2, 2]                        # assignments before dropping; sums to N*K = 8
# aux = E * sum_e f_e P_e with f = LOAD / 8 and P = column means of PROBS = (1.7, 1.3, 1.0)/4
AUX = 3 * (4 / 8 * 1.7 / 4 + 2 / 8 * 1.3 / 4 + 2 / 8 * 1.0 / 4)          # = 1.06875


def test_route_hand_computed_case():
    assert expert_capacity(4, 3, 2, 0.75) == 2
    r = route(PROBS, top_k=2, capacity=2)
    assert r.choice.tolist() == CHOICE and r.kept.tolist() == KEPT
    assert r.slot.tolist() == SLOT and r.load.tolist() == LOAD and r.n_dropped == 2
    assert r.tokens_of(0).tolist() == [0, 1] and r.tokens_of(2).tolist() == [1, 3]
    assert AUX == pytest.approx(1.06875, abs=1e-15)


def test_capacity_formula():
    assert expert_capacity(10, 1, 1, 1.1) == 10          # 1.1*10 = 11.000000000000002 -> N cap
    assert expert_capacity(8, 4, 1, 1.25) == 3           # ceil(2.5)
    assert expert_capacity(8, 4, 2, 1.0) == 4


def _gelu(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def _expert_np(moe, e, x):
    ex = moe.experts[e]
    return _gelu(x @ ex.fc.weight.data + ex.fc.bias.data) @ ex.proj.weight.data + ex.proj.bias.data


def _hand_moe():
    """Router weight = identity and x = log(probs), so softmax(x @ W) = PROBS exactly."""
    moe = MoE(3, 5, n_experts=3, top_k=2, capacity_factor=0.75)
    seeding.init_parameters(moe, seed=0)
    moe.router.weight.data[...] = np.eye(3)
    return moe, np.log(PROBS).reshape(2, 2, 3)            # (B=2, T=2, C=3)


def test_moe_output_and_aux_on_hand_case():
    moe, x = _hand_moe()
    out, aux = moe(Tensor(x))
    r = moe.last_routing
    assert r.kept.tolist() == KEPT
    tok = x.reshape(4, 3)
    y = [_expert_np(moe, e, tok) for e in range(3)]       # every expert on every token
    want = np.stack([
        0.5 * y[0][0] + 0.3 * y[1][0],                    # t0: both choices kept
        0.6 * y[0][1] + 0.3 * y[2][1],                    # t1: both kept
        0.7 * y[1][2],                                    # t2: second choice (e0) dropped
        0.4 * y[2][3],                                    # t3: first choice (e0) dropped
    ])
    np.testing.assert_allclose(out.data.reshape(4, 3), want, rtol=0, atol=1e-14)
    assert aux.item() == pytest.approx(AUX, abs=1e-14)


def test_fully_dropped_token_outputs_zero():
    moe = MoE(3, 4, n_experts=2, top_k=1, capacity_factor=0.5)   # capacity ceil(0.5*3/2) = 1
    seeding.init_parameters(moe, seed=0)
    moe.router.weight.data[...] = np.eye(3)[:, :2]
    x = np.log(np.array([[[0.9, 0.1, 1.0], [0.8, 0.2, 1.0], [0.3, 0.7, 1.0]]]))
    out, _ = moe(Tensor(x))
    assert moe.last_routing.kept[:, 0].tolist() == [True, False, True]
    assert np.all(out.data[0, 1] == 0.0)                    # the block's residual carries it


def test_gradcheck_through_gates_experts_and_aux():
    moe = MoE(4, 3, n_experts=3, top_k=2, capacity_factor=0.7)
    seeding.init_parameters(moe, seed=3)
    ps = moe.parameters()
    names = [n for n, _ in moe.named_parameters()]
    x = Tensor(np.random.default_rng(3).standard_normal((2, 3, 4)), requires_grad=True)

    def fn(x, *params):
        _swap(moe, names, params)
        out, aux = moe(x)
        return out.sum(axis=-1) + aux * 0.7                 # (B, T): both paths checked

    try:
        assert gradcheck(fn, [x, *ps], atol=1e-8, rtol=1e-6)
        assert moe.last_routing.n_dropped > 0              # the drop path was exercised
    finally:
        _swap(moe, names, ps)


def _swap(module, names, tensors):
    for name, t in zip(names, tensors):
        *path, attr = name.split(".")
        owner = module
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, t)


def test_bad_moe_arguments():
    with pytest.raises(ValueError, match="top_k=3"):
        MoE(4, 8, n_experts=2, top_k=3, capacity_factor=1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(4, 8, n_experts=2, top_k=1, capacity_factor=-1.0)   # 0: dropless
