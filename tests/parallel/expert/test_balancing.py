"""Routers and aux-loss-free balancing under every layout (parallel/expert/balancing.py):

    1. deterministic mode: each router and balancing rule gives the single process's
       parameters and losses bit for bit in MoE layouts (dp x ep, ZeRO 1-3, tp, pp with ep
       and zero-bubble), and the routing biases are bitwise the single process's at every
       step;
    2. float64 with gradient accumulation (M micro-batches per step): the bias update
       reads the global batch's load, so M = 1 and M = 2 and every layout make the same
       bias moves;
    3. the bias rule balances a skewed router (DualPipe's mirrored stages, each routing
       one direction's micro-batches, sum their loads: in the sweep of 1.); a run killed
       and resumed from its checkpoint (which keeps the biases) ends with the
       uninterrupted run's digest.
By default one case per router and a few layouts run; the sweep is slow."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from minidist import train_cli
from minidist.baseline import train_single_process
from minidist.data import DataConfig
from minidist.nn import GPTConfig
from minidist.nn.routing import RoutingRule, route, update_bias
from minidist.runtime import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from minidist.train import max_violation
from tests.deterministic.test_step import MOE_SWEEP, _batch
from tests.helpers import assert_runs_match

DATA = DataConfig("sort", length=4)
B, STEPS, LR, CLIP = 8, 3, 1e-2, 0.5

RULES = {
    "sigmoid-bias-shared-dropless": dict(router="sigmoid", bias_rate=0.01, shared_experts=1,
                                         capacity_factor=0, expert_hidden=8),
    "softmax-bias-capacity": dict(bias_rate=0.01, capacity_factor=1.0, z_loss_coef=0.01),
    "expert-choice": dict(router="expert-choice", capacity_factor=1.0),
    "group-limited-sigmoid-bias": dict(router="sigmoid", route_groups=2, route_limit=1,
                                       bias_rate=0.01),
}


def _cfg(rule: str, dtype: str = "float32") -> GPTConfig:
    """Every block a MoE of 4 experts, top-2, routing groups of one sample (T = 8)."""
    return GPTConfig(vocab_size=11, block_size=9, n_layer=2, n_head=4, n_embd=16, dropout=0.1,
                     dtype=dtype, moe_every=1, n_experts=4, top_k=2, moe_group_size=8,
                     **RULES[rule])


@functools.lru_cache(maxsize=None)
def _reference(rule: str, deterministic: bool = True, grad_accum: int = 1, batch: int = B):
    return train_single_process(_cfg(rule, "float32" if deterministic else "float64"), DATA,
                                steps=STEPS, global_batch=batch, lr=LR, clip_grad=CLIP,
                                deterministic=deterministic, grad_accum=grad_accum)


def _rank(ctx, cfg, plan, deterministic=True, batch=B):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=batch,
                                   deterministic=deterministic),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


PLANS = [Plan(dp=2, ep=2), Plan(dp=2, ep=2, zero=1), Plan(pp=2, micro_batches=2),
         Plan(dp=2, ep=2, pp=2, micro_batches=2, schedule="zb-h1"), Plan(dp=2, ep=2, zero=3),
         Plan(dp=2, ep=2, tp=2), Plan(dp=4, ep=2, zero=2),
         Plan(pp=2, micro_batches=4, schedule="dualpipe"),
         Plan(pp=2, dp=2, ep=2, micro_batches=4, schedule="dualpipe", zero=1)]
CASES = [(rule, plan) for rule in RULES for plan in PLANS]
KEPT = {("sigmoid-bias-shared-dropless", 0), ("sigmoid-bias-shared-dropless", 3),
        ("softmax-bias-capacity", 1), ("expert-choice", 2),
        ("group-limited-sigmoid-bias", 4), ("sigmoid-bias-shared-dropless", 7)}


@pytest.mark.parametrize("rule, plan", [
    pytest.param(rule, plan, marks=() if (rule, PLANS.index(plan)) in KEPT
                 else pytest.mark.slow) for rule, plan in CASES],
    ids=[f"{rule}-{plan.describe()}-zero{plan.zero}" for rule, plan in CASES])
def test_each_router_and_rule_is_bitwise_the_single_process_with_its_biases(rule, plan,
                                                                           batch=B):
    ref = _reference(rule, batch=batch)
    for r, run in enumerate(spawn(plan.world_size, _rank, _cfg(rule), plan, True, batch)):
        what = f"{rule} {plan.describe()} ZeRO-{plan.zero} rank {r}"
        assert run.losses == ref.losses, f"{what}: losses"
        for name, p in ref.params.items():
            assert np.array_equal(run.params[name], p), f"{what}: {name}"
        assert len(run.routing_biases) == len(ref.routing_biases) == \
            (STEPS if RULES[rule].get("bias_rate") else 0), what
        for step, (mine, want) in enumerate(zip(run.routing_biases, ref.routing_biases)):
            assert mine.keys() == want.keys() == {"blocks.0.moe", "blocks.1.moe"}, what
            for name in want:
                assert np.array_equal(mine[name], want[name]), f"{what}: {name} step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("rule", [r for r in RULES if r != "softmax-bias-capacity"])
@pytest.mark.parametrize("plan", MOE_SWEEP, ids=[f"{p.describe()}-zero{p.zero}"
                                                 for p in MOE_SWEEP])
def test_every_moe_factorisation_of_up_to_8_ranks_for_each_rule(rule, plan):
    """tests/deterministic/test_step.py's MoE sweep (dp x tp x pp x ep <= 8 ranks, ZeRO
    0-3), once per router and balancing rule."""
    test_each_router_and_rule_is_bitwise_the_single_process_with_its_biases(
        rule, plan, _batch(plan))


def test_the_biases_move_and_change_the_routing():
    """The test model's biases are not all zero after a step, and the biased choice
    differs from the unbiased one (so the bitwise checks above check something)."""
    ref = _reference("sigmoid-bias-shared-dropless")
    assert any(np.any(b[n] != 0) for b in ref.routing_biases for n in b)
    plan = Plan(dp=2, ep=2)
    run = spawn(2, _rank, _cfg("sigmoid-bias-shared-dropless"), plan)[0]
    stats = [s["blocks.0.moe"] for s in run.moe[1:]]
    assert any(s["load"] != s["unbiased_load"] for s in stats), stats


@pytest.mark.parametrize("plan", [
    Plan(dp=2, ep=2, micro_batches=2),
    pytest.param(Plan(pp=2, dp=2, ep=2, micro_batches=4), marks=pytest.mark.slow),
    pytest.param(Plan(dp=2, ep=2, tp=2, zero=2, micro_batches=2), marks=pytest.mark.slow)],
    ids=lambda p: p.describe())
def test_gradient_accumulation_updates_the_bias_from_the_global_batch(plan):
    """float64, M micro-batches: the same bias moves as the single process with M = 1 and
    with M (the load is counted over the whole step, never per micro-batch)."""
    rule = "sigmoid-bias-shared-dropless"
    ref = _reference(rule, deterministic=False, grad_accum=plan.micro_batches)
    one = _reference(rule, deterministic=False, grad_accum=1)
    runs = spawn(plan.world_size, _rank, _cfg(rule, "float64"), plan, False)
    assert_runs_match(runs, ref, f"{rule} {plan.describe()}")
    for run in runs:
        for mine, want, whole in zip(run.routing_biases, ref.routing_biases,
                                     one.routing_biases):
            for name in want:
                assert np.array_equal(mine[name], want[name])
                assert np.array_equal(mine[name], whole[name])


def test_the_bias_rule_balances_a_skewed_router():
    """A router that prefers expert 0 (scores fixed): 300 updates of gamma = 0.002 bring
    the max violation from 0.72 to below 0.1."""
    rng = np.random.default_rng(0)
    s = 1 / (1 + np.exp(-(rng.normal(size=(256, 8)) + np.linspace(1.0, 0.0, 8))))
    bias = np.zeros(8)
    first = max_violation(route(s, 2, 256).load)
    for _ in range(300):
        r = route(s, 2, 256, RoutingRule("sigmoid", bias_rate=0.002), bias)
        update_bias(bias, r.load, 0.002)
    last = max_violation(route(s, 2, 256, RoutingRule("sigmoid"), bias).load)
    assert first > 0.7 and last < 0.1, (first, last)


def test_max_violation():
    assert max_violation(np.array([2, 2, 2, 2])) == 0.0
    assert max_violation(np.array([4, 2, 1, 1])) == 1.0
    assert max_violation(np.zeros(4)) == 0.0


TINY = ["--steps", "8", "--every", "100", "--n-layer", "2", "--n-embd", "16", "--n-head", "2",
        "--batch", "8", "--dtype", "float64", "--seed", "3", "--moe-every", "1",
        "--n-experts", "4", "--top-k", "2", "--router", "sigmoid", "--balance", "bias",
        "--bias-rate", "0.05", "--capacity-factor", "0", "--dp", "2", "--ep", "2"]


def _digest(argv, capsys) -> tuple[str, str]:
    code = train_cli.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    return re.findall(r"^params sha256: ([0-9a-f]{64})$", out.out, re.M)[-1], out.out


@pytest.mark.multiproc
def test_a_resumed_run_restores_the_biases_and_ends_with_the_uninterrupted_digest(
        tmp_path, capsys, monkeypatch):
    ref, _ = _digest(TINY + ["--run-dir", "none"], capsys)
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3",
          "--run-dir", "none"]
    got, out = _digest(TINY + ck + ["--inject", "sigkill:rank=1:step=5",
                                    "--max-restarts", "1"], capsys)
    assert "resuming from" in out and got == ref
    # without the biases the resumed run routes differently: the digest tells
    from minidist.reliability import recovery
    real = recovery.on_rank

    def forget(*args, **kw):
        resume, saver = real(*args, **kw)
        if resume["initial_state"] is not None:
            resume["initial_state"] = resume["initial_state"][:2]
        return resume, saver
    monkeypatch.setattr(recovery, "on_rank", forget)
    lost, out = _digest(TINY + ["--checkpoint-dir", str(tmp_path / "ck2"),
                                "--checkpoint-every", "3", "--run-dir", "none", "--inject",
                                "sigkill:rank=1:step=5", "--max-restarts", "1"], capsys)
    assert "resuming from" in out and lost != ref
