"""Expert tensor parallelism (parallel/expert/expert_tensor.py) equals the unsharded MoE:
outputs and input gradients on every rank, each expert's gradient the sum over the ranks'
tokens, cut into the etp pieces; the uneven gather and reduce-scatter pass finite
differences; the etp and ep bytes equal their formulas; training layouts equal the single
process (float64), checkpoints move between etp and plain layouts."""

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.baseline import train_single_process
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.nn import MoE, RoutingRule
from minidist.parallel import micro_batching
from minidist.parallel import placement as pl
from minidist.parallel.compose import build
from minidist.parallel.expert.expert_tensor import AllGatherRows, ExpertTensorParallelMoE, \
    ReduceScatterRows
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_close, assert_runs_match, dist_gradcheck
from tests.parallel.expert.test_expert_parallel import _grads, _x

pytestmark = pytest.mark.multiproc


def _moe(top_k=2, cf=0.8, **kw):
    moe = MoE(6, 4, n_experts=4, top_k=top_k, capacity_factor=cf, group_size=4,
              aux_loss_coef=0.3, z_loss_coef=0.1, **kw)
    seeding.init_parameters(moe, seed=1)
    return moe


def _groups(ctx, ep: int, etp: int):
    """(ep group, etp group) of a world of ep x etp ranks, etp the faster."""
    job, r = ctx.job, ctx.rank
    ep_g = etp_g = None
    for j in range(etp):
        g = job.new_group(tuple(j + etp * i for i in range(ep)), name=f"ep{j}")
        ep_g = g if g is not None else ep_g
    for i in range(ep):
        g = job.new_group(tuple(etp * i + j for j in range(etp)), name=f"etp{i}")
        etp_g = g if g is not None else etp_g
    assert ep_g.rank == r // etp and etp_g.rank == r % etp
    return ep_g, etp_g


def _compare(ctx, ep, etp, top_k, cf, rows, kw):
    ep_g, etp_g = _groups(ctx, ep, etp)
    layer = ExpertTensorParallelMoE(_moe(top_k, cf, **kw), ep_g, etp_g)
    out, aux, dx, grads = _grads(layer, _x(ctx.rank, rows[ctx.rank]))
    W = ep * etp
    ref = [_grads(_moe(top_k, cf, **kw), _x(s, rows[s])) for s in range(W)]
    assert_close(out, ref[ctx.rank][0], atol=1e-13, what="output")
    assert aux == pytest.approx(ref[ctx.rank][1], abs=1e-14)
    assert_close(dx, ref[ctx.rank][2], atol=1e-13, what="input gradient")
    mine = dict(layer.named_parameters())
    for name, g in grads.items():
        if "experts" not in name:
            assert_close(g, ref[ctx.rank][3][name], atol=1e-13, what=name)
            continue
        want = sum(ref[s][3][name] for s in range(W))       # every rank's tokens
        place = pl.placement_of(mine[name], "etp")
        assert_close(g, pl.shard(want, place, etp, etp_g.rank), atol=1e-13, what=name)
    return int(layer.last_routing.n_dropped)


@pytest.mark.parametrize("ep, etp, top_k, cf, rows, kw", [
    (1, 2, 2, 0.8, (2, 1), {}),
    (2, 2, 2, 0.6, (1, 2, 1, 3), {}),
    (2, 2, 1, 0, (2, 2, 1, 1), dict(rule=RoutingRule("sigmoid"), shared_experts=1))])
def test_expert_tensor_parallel_equals_the_unsharded_layer(ep, etp, top_k, cf, rows, kw):
    dropped = spawn(ep * etp, _compare, ep, etp, top_k, cf, rows, kw)
    assert cf == 0 or any(d > 0 for d in dropped)             # drops were exercised


def _rows_gradcheck(ctx):
    g = ctx.world
    sizes = [1, 3, 2]                # uneven; every rank passes 3 rows (dist_gradcheck's
    x = np.random.default_rng(g.rank).standard_normal((3, 2))    # loops must agree)
    gather = dist_gradcheck(lambda t: AllGatherRows.apply(t[:sizes[g.rank]], group=g,
                                                          sizes=sizes), x, g,
                            x_placement="shard", loss_placement="partial",
                            what="all-gather of rows")
    y = np.random.default_rng(5 + g.rank).standard_normal((sum(sizes), 2))
    scatter = dist_gradcheck(lambda t: ReduceScatterRows.apply(t, group=g, sizes=sizes), y, g,
                             x_placement="shard", loss_placement="partial",
                             what="reduce-scatter of rows")
    return gather and scatter


def test_the_uneven_gather_and_reduce_scatter_pass_finite_differences():
    assert all(spawn(3, _rows_gradcheck))


def _layer_gradcheck(ctx):
    ep_g, etp_g = _groups(ctx, 1, 2)
    layer = ExpertTensorParallelMoE(_moe(top_k=2, cf=0.6), ep_g, etp_g)
    return dist_gradcheck(lambda t: layer(t)[0], _x(ctx.rank, 1), ctx.world,
                          x_placement="shard", loss_placement="partial",
                          what="expert-tensor-parallel MoE", atol=1e-6)


def test_the_layer_passes_finite_differences():
    assert all(spawn(2, _layer_gradcheck))


def test_an_expert_width_that_does_not_split_is_refused():
    class G:
        size, rank = 3, 0

    class One:
        size, rank = 1, 0
    with pytest.raises(ValueError, match="hidden width 4 does not split over expert_tp=3"):
        ExpertTensorParallelMoE(_moe(), One(), G())


DATA = DataConfig(task="sort", length=6, seed=2)


def _bytes(ctx, ep, etp):
    """One step of a MoE GPT on dp=4: the etp and ep groups' bytes against the formulas."""
    cfg = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4,
                           top_k=2, capacity_factor=0.8)
    plan = Plan(dp=4, ep=ep, expert_tp=etp, micro_batches=2)
    lay = build(ctx, plan, cfg, 0, optimizer="adamw", lr=1e-3, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=0.0)
    batches, n = micro_batching.micro_batches(SyntheticData(DATA), 0, 16, 4,
                                              lay.dp_group.rank, 2, 0)
    before = {a: g.stats["bytes_sent"] for a, g in (("ep", lay.ep_group),
                                                     ("etp", lay.etp_group))}
    micro_batching.grad_accumulation(lay.engine, batches, n)
    layers = [m for _, m in lay.model.named_modules() if hasattr(m, "take_etp_traffic")]
    return ({a: lay.ep_group.stats["bytes_sent"] - before["ep"] if a == "ep" else
             lay.etp_group.stats["bytes_sent"] - before["etp"] for a in before},
            {"ep": sum(m.take_traffic(8) for m in layers),
             "etp": sum(m.take_etp_traffic(8) for m in layers)})


@pytest.mark.parametrize("ep, etp", [(2, 2), (1, 4)])
def test_etp_and_ep_bytes_equal_the_formulas(ep, etp):
    for measured, formula in spawn(4, _bytes, ep, etp):
        assert measured["etp"] == formula["etp"] > 0
        assert measured["ep"] == formula["ep"]
        assert (formula["ep"] > 0) == (ep > 1)


STEPS, LR, CLIP = 3, 1e-2, 0.5


def _cfg(**kw):
    return model_config_for(DATA, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4,
                            top_k=2, capacity_factor=0.8, z_loss_coef=0.01, dropout=0.1, **kw)


def _rank(ctx, cfg, plan, batch, initial=None):
    return train_on_rank(ctx, cfg, DATA, plan, RunConfig(steps=STEPS, global_batch=batch),
                         OptimizerConfig(lr=LR, clip_grad=CLIP), initial_state=initial)


@pytest.mark.parametrize("plan, kw", [
    (Plan(dp=4, ep=2, expert_tp=2, micro_batches=2), {}),
    pytest.param(Plan(dp=2, expert_tp=2, pp=2, micro_batches=2, schedule="zb-h1"),
                 dict(router="sigmoid", bias_rate=0.01, shared_experts=1),
                 marks=pytest.mark.slow),
    pytest.param(Plan(dp=4, ep=2, expert_tp=2, zero=3), {}, marks=pytest.mark.slow),
    pytest.param(Plan(dp=4, expert_tp=4, zero=1), dict(capacity_factor=0),
                 marks=pytest.mark.slow),
    pytest.param(Plan(dp=2, expert_tp=2, tp=2, zero=2), {}, marks=pytest.mark.slow)],
    ids=lambda v: v.describe() + f"-zero{v.zero}" if isinstance(v, Plan) else str(v))
def test_training_layouts_with_expert_tp_equal_the_single_process(plan, kw):
    cfg = _cfg(**kw) if "capacity_factor" not in kw else model_config_for(
        DATA, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4, top_k=2,
        dropout=0.1, **kw)
    batch = 8
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=batch, lr=LR,
                               clip_grad=CLIP, grad_accum=plan.micro_batches)
    runs = spawn(plan.world_size, _rank, cfg, plan, batch)
    assert_runs_match(runs, ref, plan.describe())


def test_a_state_saved_under_expert_tp_loads_under_a_plain_layout():
    cfg, batch = _cfg(), 8
    saved = spawn(4, _rank, cfg, Plan(dp=4, ep=2, expert_tp=2), batch)[0]
    state = (saved.params, saved.optimizer_state)
    plain = spawn(2, _rank, cfg, Plan(dp=2), batch, state)[0]
    back = spawn(4, _rank, cfg, Plan(dp=4, expert_tp=4), batch, state)[0]
    for name in plain.params:
        assert_close(back.params[name], plain.params[name], atol=1e-12, what=name)


def test_an_expert_width_the_plan_cannot_split_is_refused_before_any_rank_starts():
    cfg = _cfg(expert_hidden=8)
    with pytest.raises(ValueError, match="expert_tp=3 splits each expert's hidden width 8"):
        Plan(dp=3, expert_tp=3).validate(cfg, 6, 12)
