"""nn/routing.py and the MoE layer's routers: hand-worked cases, an independent float64
re-implementation (plain loops over groups, tokens and experts) for every router, shared
experts and dropless routing, finite differences, and the balancing bias's rule."""

import math

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor, gradcheck
from minidist.nn import MoE, RoutingRule
from minidist.nn.routing import choose, expert_choice, expert_capacity, route, \
    route_groups, update_bias
from tests.nn.test_moe import _swap


def test_sigmoid_gates_are_normalised_over_the_chosen_experts_and_the_bias_only_chooses():
    s = np.array([[0.9, 0.8, 0.1, 0.5]])
    bias = np.array([0.0, -0.5, 0.0, 0.0])          # expert 1 made unattractive
    r = route(s, top_k=2, capacity=1, bias=bias)
    assert r.choice.tolist() == [[0, 3]]             # keys 0.9, 0.3, 0.1, 0.5
    assert r.unbiased_load.tolist() == [1, 1, 0, 0] and r.load.tolist() == [1, 0, 0, 1]
    moe = MoE(4, 3, n_experts=4, top_k=2, capacity_factor=0,
              rule=RoutingRule("sigmoid", bias_rate=0.1))
    seeding.init_parameters(moe, seed=0)
    moe.router.weight.data[...] = np.eye(4)
    x = np.log(s / (1 - s)).reshape(1, 1, 4)          # sigmoid(x) = s exactly (to rounding)
    moe.score_bias[...] = bias
    moe(Tensor(x))
    from minidist.nn import routing
    g = routing.gates(Tensor(s), moe.last_routing, "sigmoid").data
    np.testing.assert_allclose(g, [[0.9 / 1.4, 0.5 / 1.4]], rtol=1e-15)


def test_group_limited_routing_keeps_each_token_in_its_best_groups():
    # 6 experts in 3 groups {0,1} {2,3} {4,5}; top-2 within at most 1 group: a group's
    # score is the sum of its ceil(2/1) = 2 best keys.
    key = np.array([[0.50, 0.00, 0.30, 0.30, 0.45, 0.05],     # groups 0.50 0.60 0.50
                    [0.10, 0.20, 0.05, 0.05, 0.60, 0.01]])    # groups 0.30 0.10 0.61
    rule = RoutingRule("softmax", groups=3, limit=1)
    assert choose(key, 2, rule).tolist() == [[2, 3], [4, 5]]
    assert choose(key, 2).tolist() == [[0, 4], [4, 1]]        # unlimited, for contrast
    two = RoutingRule("softmax", groups=3, limit=2)           # groups score their best key
    assert choose(key, 2, two).tolist() == [[0, 4], [4, 1]]


def test_expert_choice_hand_case():
    s = np.array([[0.6, 0.1, 0.3],
                  [0.5, 0.2, 0.3],
                  [0.1, 0.8, 0.1],
                  [0.2, 0.7, 0.1]])
    r = expert_choice(s, capacity=2)
    # e0 takes tokens 0, 1; e1 takes 2, 3; e2 ties 0.3/0.3 -> tokens 0, 1 (lower index)
    assert r.kept.tolist() == [[True, False, True], [True, False, True],
                               [False, True, False], [False, True, False]]
    assert r.slot.tolist() == [[0, -1, 0], [1, -1, 1], [-1, 0, -1], [-1, 1, -1]]
    assert r.load.tolist() == [2, 2, 2] and r.n_dropped == 0
    assert expert_choice(s, capacity=1).n_dropped == 2       # tokens 1 and 3: taken by none


def test_dropless_capacity_is_the_group_and_drops_nothing():
    assert expert_capacity(16, 4, 2, 0) == 16
    rng = np.random.default_rng(0)
    s = rng.dirichlet(np.ones(4) * 0.1, size=32)           # very uneven routers
    r, loads = route_groups(s, 2, 16, 0)
    assert r.n_dropped == 0 and r.kept.all() and loads.sum() == 64
    assert route_groups(s, 2, 16, 1.0)[0].n_dropped > 0     # the same with a capacity drops


def test_bias_update_is_the_sign_rule():
    b = np.zeros(4)
    update_bias(b, np.array([5, 1, 3, 3]), 0.01)           # mean 3
    assert b.tolist() == [-0.01, 0.01, 0.0, 0.0]
    update_bias(b, np.array([5, 1, 3, 3]), 0.01)
    assert b.tolist() == [-0.02, 0.02, 0.0, 0.0]


# --- an independent re-implementation: one token, one group, one expert at a time ---

def _gelu(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def _mlp(m, x):
    return _gelu(x @ m.fc.weight.data + m.fc.bias.data) @ m.proj.weight.data + m.proj.bias.data


def _reference(moe: MoE, x: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, float]:
    """(out (N, C), aux mean over groups) by loops, from the module's docstrings."""
    rule, E, K = moe.rule, moe.n_experts, moe.top_k
    tok = x.reshape(-1, x.shape[-1])
    N = len(tok)
    G = moe.group_size or N
    out, auxes = np.zeros_like(tok), []
    for lo in range(0, N, G):
        idx = list(range(lo, min(lo + G, N)))
        logits = tok[idx] @ moe.router.weight.data
        if rule.kind == "sigmoid":
            s = 1 / (1 + np.exp(-logits))
        else:
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            s = e / e.sum(axis=1, keepdims=True)
        cf = moe.capacity_factor
        cap = len(idx) if cf == 0 else min(len(idx), math.ceil(round(cf * K * len(idx) / E, 9)))
        taken = []                                          # (row in group, expert, gate)
        if rule.kind == "expert-choice":
            for e_ in range(E):
                order = sorted(range(len(idx)), key=lambda n: (-s[n, e_], n))[:cap]
                taken += [(n, e_, s[n, e_]) for n in order]
        else:
            per = E // rule.groups
            choices = []
            for n in range(len(idx)):
                key = [s[n, e_] + bias[e_] for e_ in range(E)]
                allowed = set(range(E))
                if 0 < rule.limit < rule.groups:
                    top = -(-K // rule.limit)
                    score = [sum(sorted(key[g * per:(g + 1) * per], reverse=True)[:top])
                             for g in range(rule.groups)]
                    best = sorted(range(rule.groups), key=lambda g: (-score[g], g))[:rule.limit]
                    allowed = {e_ for g in best for e_ in range(g * per, (g + 1) * per)}
                chosen = sorted(allowed, key=lambda e_: (-key[e_], e_))[:K]
                total = sum(s[n, e_] for e_ in chosen)
                choices.append([(e_, s[n, e_] / total if rule.kind == "sigmoid" else s[n, e_])
                                for e_ in chosen])
            held, load = [0] * E, [0] * E
            for k in range(K):
                for n in range(len(idx)):
                    e_, g = choices[n][k]
                    load[e_] += 1
                    if held[e_] < cap:
                        held[e_] += 1
                        taken.append((n, e_, g))
            p = s / s.sum(axis=1, keepdims=True)
            auxes.append(E * sum(load[e_] / (len(idx) * K) * p[:, e_].mean() for e_ in range(E)))
        for n, e_, g in taken:
            out[idx[n]] += g * _mlp(moe.experts[e_], tok[idx[n]][None])[0]
        if hasattr(moe, "shared"):                       # N_s experts: one wider MLP
            out[idx] += _mlp(moe.shared, tok[idx])
    return out, (float(np.mean(auxes)) if auxes else 0.0)


CASES = {
    "softmax top-2, capacity": dict(top_k=2, capacity_factor=0.75),
    "sigmoid top-2, dropless": dict(top_k=2, capacity_factor=0, rule=RoutingRule("sigmoid")),
    "sigmoid, bias, limited": dict(top_k=2, capacity_factor=1.0,
                                   rule=RoutingRule("sigmoid", groups=3, limit=1,
                                                    bias_rate=0.01)),
    "expert choice": dict(top_k=2, capacity_factor=1.0, rule=RoutingRule("expert-choice")),
    "two shared + softmax": dict(top_k=1, capacity_factor=1.0, shared_experts=2),
}


def _moe(**kw):
    moe = MoE(5, 3, n_experts=6, group_size=6, **kw)
    seeding.init_parameters(moe, seed=1)
    moe.router.weight.data *= 40                     # decided routers: distinct choices
    return moe


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_every_router_equals_the_loop_reference(kw):
    moe = _moe(**kw)
    rng = np.random.default_rng(2)
    moe.score_bias[...] = rng.normal(0, 0.05, 6) if moe.rule.bias_rate else 0.0
    x = rng.normal(size=(2, 9, 5))                   # 18 tokens: 3 groups of 6
    out, aux = moe(Tensor(x))
    want, want_aux = _reference(moe, x, moe.score_bias)
    np.testing.assert_allclose(out.data.reshape(18, 5), want, rtol=0, atol=1e-13)
    assert float(aux.item()) / moe.aux_loss_coef == pytest.approx(want_aux, abs=1e-13)


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_every_router_passes_finite_differences(kw):
    """Every parameter and the input, through gates, experts, shared experts and the aux
    loss (the sequence-wise balance loss for sigmoid scores)."""
    moe = _moe(**kw)
    moe.router.weight.data /= 10
    ps = moe.parameters()
    names = [n for n, _ in moe.named_parameters()]
    x = Tensor(np.random.default_rng(3).normal(size=(1, 6, 5)), requires_grad=True)

    def fn(x_, *params):
        _swap(moe, names, params)
        out, aux = moe(x_)
        return out.sum(axis=-1) + aux * 0.7

    try:
        assert gradcheck(fn, [x, *ps], atol=1e-8, rtol=1e-6)
    finally:
        _swap(moe, names, ps)
