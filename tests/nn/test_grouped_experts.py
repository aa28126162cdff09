"""nn/grouped_experts.py: the grouped path gives the plain loop's bits (outputs, the input's
gradient, every expert's gradient), unsharded and under expert parallelism, with drops,
dropless and experts without rows; it passes finite differences; its FLOP rule equals
NumPy's count; it equals a float64 re-implementation on uneven segments."""

import math

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor, gradcheck
from minidist.nn import MLP, MoE, RoutingRule
from minidist.nn.grouped_experts import GroupedMLP, grouped_mlp
from minidist.parallel.expert.expert_parallel import ExpertParallelMoE
from minidist.runtime.launch import spawn
from tests.observe.test_throughput_ledger import ledger_and_numpy, leaf


def _moe(grouped: bool, top_k=2, cf=0.8, E=8, dtype="float64", **kw):
    moe = MoE(6, 5, n_experts=E, top_k=top_k, capacity_factor=cf, group_size=8, dtype=dtype,
              aux_loss_coef=0.3, z_loss_coef=0.1, grouped=grouped, **kw)
    seeding.init_parameters(moe, seed=1)
    moe.router.weight.data *= 8                     # uneven loads: some experts get none
    return moe


def _run(moe, x):
    xt = Tensor(x, requires_grad=True)
    out, aux = moe(xt)
    ((out * np.linspace(0.5, 1.5, out.size).reshape(out.shape)).sum() + aux).backward()
    return out.data, xt.grad, {n: p.grad for n, p in moe.named_parameters()}


def _same(a, b, what):
    assert np.array_equal(a[0], b[0]), f"{what}: outputs"
    assert np.array_equal(a[1], b[1]), f"{what}: input gradient"
    for name in a[2]:
        assert np.array_equal(a[2][name], b[2][name]), f"{what}: {name}"


@pytest.mark.parametrize("top_k, cf, dtype, kw", [
    (1, 0.8, "float64", {}), (2, 0.8, "float32", {}), (3, 0, "float64", {}),
    (2, 0, "float32", dict(rule=RoutingRule("sigmoid"), shared_experts=1)),
    (2, 1.0, "float64", dict(rule=RoutingRule("expert-choice")))])
def test_the_grouped_path_gives_the_plain_loop_s_bits(top_k, cf, dtype, kw):
    x = np.random.default_rng(0).normal(size=(3, 8, 6)).astype(dtype)
    plain, fast = _moe(False, top_k, cf, dtype=dtype, **kw), _moe(True, top_k, cf,
                                                                   dtype=dtype, **kw)
    _same(_run(plain, x), _run(fast, x), f"top-{top_k} cf={cf} {dtype}")
    r = fast.last_routing
    kept = np.bincount(r.choice[r.kept], minlength=8)
    assert top_k > 1 or (kept == 0).any(), kept     # top-1: an expert without rows ran


def _ep(ctx, top_k, cf):
    x = np.random.default_rng(5 + ctx.rank).normal(size=(2, 8, 6))
    runs = [_run(ExpertParallelMoE(_moe(g, top_k, cf), ctx.world), x) for g in (False, True)]
    _same(*runs, f"ep rank {ctx.rank}")
    return True


@pytest.mark.multiproc
@pytest.mark.parametrize("top_k, cf", [(2, 0.8), (1, 0)])
def test_the_grouped_path_gives_the_plain_bits_under_expert_parallelism(top_k, cf):
    assert all(spawn(2, _ep, top_k, cf))


def _gelu(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def _experts(n, bias=True):
    ms = [MLP(4, 3, bias) for _ in range(n)]
    for i, m in enumerate(ms):
        seeding.init_parameters(m, seed=i)
    return ms


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_mlp_equals_a_float64_loop_and_passes_finite_differences(bias):
    experts, counts = _experts(4, bias), np.array([3, 0, 1, 2])
    x = Tensor(np.random.default_rng(1).normal(size=(6, 4)), requires_grad=True)
    y = grouped_mlp(x, experts, counts).data
    at = 0
    for m, n in zip(experts, counts):
        b1 = m.fc.bias.data if bias else 0.0
        b2 = m.proj.bias.data if bias else 0.0
        want = _gelu(x.data[at:at + n] @ m.fc.weight.data + b1) @ m.proj.weight.data + b2
        np.testing.assert_allclose(y[at:at + n], want, rtol=0, atol=1e-14)
        at += n
    params = [p for m in experts for p in m.parameters()]
    per = 4 if bias else 2

    def fn(x_, *ws):                       # GroupedMLP's inputs: W1, b1, W2, b2 per expert
        flat = []
        for e in range(len(experts)):
            w = ws[per * e:per * e + per]
            flat += list(w) if bias else [w[0], None, w[1], None]
        return GroupedMLP.apply(x_, *flat, counts=tuple(counts))

    assert gradcheck(fn, [x, *params], atol=1e-8, rtol=1e-6)


def test_an_expert_without_rows_gets_zero_gradients():
    experts = _experts(2)
    x = Tensor(np.ones((2, 4)), requires_grad=True)
    grouped_mlp(x, experts, np.array([0, 2])).sum().backward()
    assert all(np.array_equal(p.grad, np.zeros_like(p.data)) for p in experts[0].parameters())


@pytest.mark.parametrize("bias", [True, False])
def test_the_flop_rule_equals_numpy_s_count(bias):
    experts = _experts(3, bias)
    for m in experts:
        for p in m.parameters():
            p.data = p.data.view(type(leaf((1,)).data))
    ledger, numpy_, led = ledger_and_numpy(
        lambda: grouped_mlp(leaf((7, 4)), experts, np.array([4, 0, 3])))
    assert ledger == numpy_, f"ledger {ledger} != NumPy's count {numpy_}\n{led.table()}"
