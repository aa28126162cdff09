"""A mixture-of-experts GPT is exact under every layout: routing groups of G tokens decide
capacity and drops the same way whatever dp, tp, cp, pp, ZeRO stage or micro-batch count
(float64, 3 AdamW steps, top-1 and top-2 with drops, load-balancing and z-losses).

By default a few cheap representatives of DEFAULT and EXPERT_DEFAULT run (DEFAULT_KEPT,
EXPERT_DEFAULT_KEPT: dp, tp, a pp x cp composition and an ep x cp composition); the other
cases and the ZeRO sweeps are marked slow (run them with -m slow)."""

import functools
from dataclasses import replace

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor, gradcheck
from minidist.baseline import train_single_process
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.nn import GPT, MoE
from minidist.nn.routing import route_groups
from minidist.parallel.pipeline import family
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_runs_match
from tests.helpers import slow_unless_kept
from tests.parallel.test_compose import FACTORISATIONS, PIPELINED, _data

DATA = DataConfig(task="sort", length=6, seed=2)            # T = 12 (T = 2 cp if 12 cannot)
STEPS, LR, CLIP = 3, 1e-2, 0.05

# the hand case of tests/nn/test_moe.py, now in two routing groups of 2 tokens
PROBS = np.array([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.2, 0.7, 0.1], [0.4, 0.2, 0.4]])


def test_routing_groups_hand_computed_case_with_drops():
    # capacity per group = ceil(0.75 * K=2 * G=2 / E=3) = 1. Group 0 (t0, t1): first
    # choices t0->e0, t1->e0 FULL; second t0->e1, t1->e2. Group 1 (t2, t3): first t2->e1,
    # t3->e0; second t2->e0 FULL, t3->e2. Slots continue from group to group.
    r, loads = route_groups(PROBS, top_k=2, group=2, capacity_factor=0.75)
    assert r.capacity == 1 and r.n_dropped == 2
    assert r.kept.tolist() == [[True, True], [False, True], [True, False], [True, True]]
    assert r.slot.tolist() == [[0, 0], [-1, 0], [1, -1], [1, 1]]
    assert loads.tolist() == [[2, 1, 1], [2, 1, 1]]
    assert r.tokens_of(0).tolist() == [0, 3] and r.tokens_of(1).tolist() == [0, 2]


def _hand_moe(**kw):
    moe = MoE(3, 5, n_experts=3, top_k=2, capacity_factor=0.75, group_size=2, **kw)
    seeding.init_parameters(moe, seed=0)
    moe.router.weight.data[...] = np.eye(3)
    return moe, np.log(PROBS).reshape(2, 2, 3)


def test_aux_and_z_loss_are_means_over_groups():
    moe, x = _hand_moe(aux_loss_coef=0.5, z_loss_coef=0.25)
    _, total = moe(Tensor(x))
    # aux_g = E sum_e f_ge P_ge: group 0 P = (0.55, 0.2, 0.25), group 1 P = (0.3, 0.45, 0.25)
    aux = (3 * (0.5 * 0.55 + 0.25 * 0.2 + 0.25 * 0.25) + 3 * (0.5 * 0.3 + 0.25 * 0.45
                                                                + 0.25 * 0.25)) / 2
    z = np.mean(np.log(np.exp(np.log(PROBS)).sum(-1)) ** 2)       # logsumexp(log p) = 0
    assert moe.last_stats["aux"] == pytest.approx(aux, abs=1e-15)
    assert moe.last_stats["z"] == pytest.approx(z, abs=1e-15)
    assert total.item() == pytest.approx(0.5 * aux + 0.25 * z, abs=1e-15)


def test_gradcheck_with_groups_and_z_loss():
    moe = MoE(4, 3, n_experts=3, top_k=2, capacity_factor=0.5, group_size=3, z_loss_coef=0.3)
    seeding.init_parameters(moe, seed=3)
    names, ps = zip(*moe.named_parameters())
    x = Tensor(np.random.default_rng(3).standard_normal((2, 3, 4)), requires_grad=True)

    def fn(x, *params):
        for name, t in zip(names, params):
            *path, attr = name.split(".")
            owner = moe
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, attr, t)
        out, aux = moe(x)
        return out.sum(axis=-1) + aux * 0.7

    assert gradcheck(fn, [x, *ps], atol=1e-8, rtol=1e-6)
    fn(x, *ps)
    assert moe.last_routing.n_dropped > 0


def _cfg(n_layer: int, top_k: int, group: int = 0, aux: float = 0.1, tp: int = 1,
         cp: int = 1):
    heads = tp if tp > 2 else 2                             # n_head a multiple of tp
    return model_config_for(_data(cp), n_layer=n_layer, n_head=heads,
                            n_embd=4 * heads if heads > 2 else 16, dropout=0.1, moe_every=1,
                            n_experts=4, top_k=top_k, capacity_factor=0.8, aux_loss_coef=aux,
                            z_loss_coef=0.01, moe_group_size=group)


def test_the_test_model_drops_tokens():
    cfg = _cfg(2, 1)
    model = GPT(cfg, seed=0).eval()
    x, y = SyntheticData(DATA).batch(np.arange(4))
    model(x, y)
    assert model.blocks[0].moe.last_routing.n_dropped > 0


@functools.lru_cache(maxsize=None)
def _reference(n_layer, top_k, group, M, batch, aux, tp, cp):
    return train_single_process(_cfg(n_layer, top_k, group, aux, tp, cp), _data(cp),
                                steps=STEPS, global_batch=batch, lr=LR, grad_accum=M,
                                clip_grad=CLIP, weight_decay=0.01)


def _run(pp, dp, cp, tp, zero, top_k, M, schedule="1f1b", aux=0.1, ep=1):
    T = _data(cp).block_size
    group = T // (2 * cp) if cp > 1 else 0                # whole groups in each zig-zag chunk
    n_layer = 2 * pp if schedule == "interleaved" else max(2, pp)
    plan = Plan(pp=pp, dp=dp, cp=cp, tp=tp, zero=zero, micro_batches=M, schedule=schedule,
                ep=ep)
    batch = dp * M * 2
    cfg = _cfg(n_layer, top_k, group, aux, tp, cp)
    runs = spawn(plan.world_size, train_on_rank, cfg, _data(cp), plan,
                 RunConfig(steps=STEPS, global_batch=batch),
                 OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=CLIP))
    assert_runs_match(runs, _reference(n_layer, top_k, group, M, batch, aux, tp, cp),
                      f"MoE top-{top_k} {plan.describe()} zero={zero} M={M}")


LAYOUTS = [(1, *f) for f in FACTORISATIONS] + list(PIPELINED)


def _case(i, pp, dp, cp, tp):
    zero = i % 4 if pp == 1 else i % 3                     # ZeRO-3 with pp is refused
    name = family.SCHEDULES[i % 4] if pp <= 4 or i % 4 != 2 else "zb-h1"
    return pp, dp, cp, tp, zero, 1 + i % 2, 1 + (i // 2) % 2, name


DEFAULT = [_case(i, *f) for i, f in enumerate(LAYOUTS)]
# run by default: cheap MoE cases for dp (ZeRO-3), tp and a pp x cp composition; the rest of
# DEFAULT is slow
DEFAULT_KEPT = [
    (1, 2, 1, 1, 3, 2, 2, "zb-h1"),          # dp=2 ZeRO-3, top-2, M=2
    (1, 1, 1, 2, 1, 2, 1, "1f1b"),           # tp=2 ZeRO-1, top-2
    (2, 1, 2, 1, 2, 2, 1, "1f1b"),           # pp=2 x cp=2 ZeRO-2, top-2
]
assert all(c in DEFAULT for c in DEFAULT_KEPT)


@pytest.mark.multiproc
@pytest.mark.parametrize("pp, dp, cp, tp, zero, top_k, M, schedule",
                         slow_unless_kept(DEFAULT, DEFAULT_KEPT))
def test_every_layout_of_up_to_8_ranks_matches_single_process(pp, dp, cp, tp, zero, top_k, M,
                                                              schedule):
    _run(pp, dp, cp, tp, zero, top_k, M, schedule)


# every supported ZeRO stage of the layouts of up to 4 ranks (larger ones: one stage each
# above, every stage for the dense model in test_compose.py and, with ep, below)
SWEEP = [(pp, dp, cp, tp, zero, 1 + (zero + i) % 2, 1 + zero // 2, name)
         for i, (pp, dp, cp, tp, _, _, _, name) in enumerate(DEFAULT) if pp * dp * cp * tp <= 4
         for zero in range(4 if pp == 1 else 3)]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("pp, dp, cp, tp, zero, top_k, M, schedule",
                         [c for c in SWEEP if c not in DEFAULT])
def test_every_layout_with_every_zero_stage(pp, dp, cp, tp, zero, top_k, M, schedule):
    _run(pp, dp, cp, tp, zero, top_k, M, schedule)


# --- expert parallelism: ep | dp, the experts split over ep, their grads over edp x cp ---

EXPERT_LAYOUTS = [(pp, dp, ep, cp, tp) for pp, dp, cp, tp, *_ in DEFAULT
                  for ep in range(2, dp + 1) if dp % ep == 0 and 4 % ep == 0]


def _ep_case(i, pp, dp, ep, cp, tp):
    name = family.SCHEDULES[(i + 1) % 4] if pp <= 4 else "1f1b"
    return pp, dp, ep, cp, tp, i % 4 if pp == 1 else i % 3, 1 + (i + 1) % 2, 1 + i % 2, name


EXPERT_DEFAULT = [_ep_case(i, *f) for i, f in enumerate(EXPERT_LAYOUTS)]
# run by default: one cheap ep composition (dp=2 ep=2 x cp=2, ZeRO-2); the rest is slow
EXPERT_DEFAULT_KEPT = [(1, 2, 2, 2, 1, 2, 2, 1, "zb-h1")]
assert all(c in EXPERT_DEFAULT for c in EXPERT_DEFAULT_KEPT)


@pytest.mark.multiproc
@pytest.mark.parametrize("pp, dp, ep, cp, tp, zero, top_k, M, schedule",
                         slow_unless_kept(EXPERT_DEFAULT, EXPERT_DEFAULT_KEPT))
def test_expert_parallel_layouts_match_single_process(pp, dp, ep, cp, tp, zero, top_k, M,
                                                      schedule):
    _run(pp, dp, cp, tp, zero, top_k, M, schedule, ep=ep)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("pp, dp, ep, cp, tp, zero, top_k, M, schedule",
                         [(pp, dp, ep, cp, tp, z, k, M, name)
                          for pp, dp, ep, cp, tp, zero, k, M, name in EXPERT_DEFAULT
                          for z in range(4 if pp == 1 else 3) if z != zero])
def test_expert_parallel_layouts_with_every_zero_stage(pp, dp, ep, cp, tp, zero, top_k, M,
                                                       schedule):
    _run(pp, dp, cp, tp, zero, top_k, M, schedule, ep=ep)


@pytest.mark.multiproc
def test_expert_buckets_give_the_bits_of_one_all_reduce_per_parameter():
    """Under ep, DDP keeps the experts' gradients in buckets of their own, summed over the
    experts' replicas (parallel/data/buckets.py): the same bits and optimizer state as the
    plain engine's all-reduce per parameter."""
    cfg, data = _cfg(2, 2), _data(1)
    runs = {}
    for buckets in (False, True):
        plan = Plan(dp=4, ep=2, micro_batches=2, buckets=buckets)
        assert ("buckets" in plan.algorithms(shared_memory=True)) is buckets
        runs[buckets] = spawn(4, train_on_rank, cfg, data, plan,
                              RunConfig(steps=STEPS, global_batch=8),
                              OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=CLIP))
    for plain, fast in zip(runs[False], runs[True]):
        assert plain.losses == fast.losses and plain.grad_norms == fast.grad_norms
        for name, p in plain.params.items():
            assert p.tobytes() == fast.params[name].tobytes(), name
        for key, v in plain.optimizer_state.items():
            assert np.asarray(v).tobytes() == np.asarray(fast.optimizer_state[key]).tobytes()


def test_expert_parallel_plans_that_cannot_split_are_refused():
    cfg = _cfg(2, 1)
    with pytest.raises(ValueError, match="ep=4 must divide dp=2"):
        Plan(dp=2, ep=4)
    with pytest.raises(ValueError, match="n_experts=4 does not divide; use n_experts=6"):
        Plan(dp=3, ep=3).validate(cfg, 12, DATA.block_size)
    dense = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ValueError, match="none \\(moe_every=0\\); use moe_every=1"):
        Plan(dp=2, ep=2).validate(dense, 8, DATA.block_size)


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [0, pytest.param(3, marks=pytest.mark.slow)])  # default: 0
def test_aux_loss_gradient_is_not_divided_by_dp(zero):
    # Megatron-LM PR #3769: the load-balancing loss's gradient came out 1/dp too small.
    # With a big coefficient the router's update is dominated by it: equal to one process.
    _run(1, 4, 1, 1, zero, 2, 1, aux=5.0)
    _run(1, 4, 1, 1, zero, 2, 1, aux=5.0, ep=2)


@pytest.mark.parametrize("plan, match", [
    (Plan(cp=2), "routing groups of moe_group_size=12 tokens would be cut"),
    (Plan(tp=2, sequence_parallel=True), "sequence parallelism of MoE blocks"),
])
def test_layouts_that_would_cut_a_routing_group_are_refused(plan, match):
    with pytest.raises(ValueError, match=match):
        plan.validate(_cfg(2, 1), 8, DATA.block_size)
    plan.validate(_cfg(2, 1, group=3), 8, DATA.block_size) if plan.cp > 1 else None


@pytest.mark.multiproc
def test_routing_stats_are_counted_once_with_recomputation():
    # Megatron-LM #1478: the aux loss counted twice with activation recomputation. Full
    # recomputation (here under ZeRO-3) runs every block's forward again in the backward:
    # the per-step routing statistics equal those of a run without recomputation.
    cfg, plan = _cfg(2, 2), dict(dp=2, ep=2, micro_batches=2)
    runs = [spawn(2, train_on_rank, replace(cfg, recompute=rc), DATA, Plan(zero=z, **plan),
                  RunConfig(steps=2, global_batch=8), OptimizerConfig(lr=LR))[0]
            for z, rc in ((0, "none"), (3, "full"))]
    for a, b in zip(runs[0].moe, runs[1].moe):
        assert a.keys() == b.keys()
        for layer in a:
            assert a[layer]["load"] == b[layer]["load"] and a[layer]["kept"] == b[layer]["kept"]
            assert a[layer]["aux"] == pytest.approx(b[layer]["aux"], abs=1e-12)
            assert a[layer]["z"] == pytest.approx(b[layer]["z"], abs=1e-12)
    assert sum(runs[0].moe[0]["blocks.0.moe"]["load"]) == 8 * 12 * 2     # B T K assignments
