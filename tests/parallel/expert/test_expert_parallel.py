"""Expert parallelism equals the unsharded MoE: the same outputs and input gradients on
every rank, each expert's gradient the sum of what the ranks' tokens give it; dispatch and
combine pass finite differences; uneven splits and experts without tokens included."""

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import Tensor
from minidist.nn import MoE
from minidist.parallel.expert.expert_parallel import AllToAll, ExpertParallelMoE
from minidist.runtime.launch import spawn
from tests.helpers import assert_close, dist_gradcheck


def _moe(top_k=2, cf=0.8, E=4):
    moe = MoE(6, 5, n_experts=E, top_k=top_k, capacity_factor=cf, group_size=4,
              aux_loss_coef=0.3, z_loss_coef=0.1)
    seeding.init_parameters(moe, seed=1)
    return moe


def _x(rank, rows=2):
    return np.random.default_rng(10 + rank).standard_normal((rows, 4, 6))


def _grads(moe, x):
    xt = Tensor(x, requires_grad=True)
    out, aux = moe(xt)
    ((out * np.linspace(0.5, 1.5, out.size).reshape(out.shape)).sum() + aux).backward()
    return out.data, float(aux.item()), xt.grad, {n: p.grad for n, p in moe.named_parameters()}


def _compare(ctx, top_k, cf, E, rows):
    from minidist import collectives as C
    g = ctx.world
    ep = ExpertParallelMoE(_moe(top_k, cf, E), g)
    out, aux, dx, grads = _grads(ep, _x(g.rank, rows[g.rank]))
    # the reference: the unsharded layer on every rank's tokens, expert grads summed
    ref = [_grads(_moe(top_k, cf, E), _x(s, rows[s])) for s in range(g.size)]
    r_out, r_aux, r_dx, _ = ref[g.rank]
    assert_close(out, r_out, atol=1e-13, what="output")
    assert aux == pytest.approx(r_aux, abs=1e-14)
    assert_close(dx, r_dx, atol=1e-13, what="input gradient")
    for name, gr in grads.items():
        want = ref[g.rank][3][name] if "experts" not in name else sum(
            ref[s][3][name] for s in range(g.size))
        assert_close(gr, want, atol=1e-13, what=name)
    assert sorted(n for n in grads if "experts" in n) == sorted(
        f"experts.{e}.{p}" for e in range(g.rank * E // g.size, (g.rank + 1) * E // g.size)
        for p in ("fc.weight", "fc.bias", "proj.weight", "proj.bias"))
    load = C.all_gather(ep.last_routing.load, group=g)
    return int(ep.last_routing.n_dropped), load.tolist()


@pytest.mark.multiproc
@pytest.mark.parametrize("W, top_k, cf, E, rows", [
    (2, 1, 0.8, 4, (2, 2)), (2, 2, 0.6, 4, (2, 1)), (4, 2, 1.0, 4, (1, 2, 1, 3)),
    (3, 1, 0.5, 6, (1, 1, 2))])
def test_expert_parallel_equals_the_unsharded_layer(W, top_k, cf, E, rows):
    results = spawn(W, _compare, top_k, cf, E, rows)
    assert any(dropped > 0 for dropped, _ in results)         # drops were exercised


def _lonely(ctx):
    """One expert receives no token on any rank: it still runs, its gradient is zeros."""
    moe = _moe(top_k=1, cf=2.0)
    moe.router.weight.data[:, 3] = moe.router.weight.data[:, 0]  # ties go to expert 0:
    #                                                               nobody picks expert 3
    ep = ExpertParallelMoE(moe, ctx.world)
    _, _, _, grads = _grads(ep, _x(ctx.world.rank))
    return {n: float(np.abs(g).sum()) for n, g in grads.items() if "experts.3." in n}


@pytest.mark.multiproc
def test_an_expert_without_tokens_gets_a_zero_gradient():
    owner = spawn(2, _lonely)[1]
    assert owner and all(v == 0.0 for v in owner.values())


def _all_to_all_gradcheck(ctx):
    g = ctx.world
    send = [[1, 2, 0], [0, 1, 2], [2, 0, 1]][g.rank]    # uneven, some empty (3 rows each:
    recv = [[1, 0, 2], [2, 1, 0], [0, 2, 1]][g.rank]    # dist_gradcheck's loops must agree)
    x = np.random.default_rng(g.rank).standard_normal((sum(send), 2))
    return dist_gradcheck(lambda t: AllToAll.apply(t, group=g, send=send, recv=recv), x, g,
                          x_placement="shard", loss_placement="partial", what="all_to_all")


@pytest.mark.multiproc
def test_all_to_all_backward_is_the_transposed_all_to_all():
    assert all(spawn(3, _all_to_all_gradcheck))


def _dispatch_combine_gradcheck(ctx):
    g = ctx.world
    ep = ExpertParallelMoE(_moe(top_k=2, cf=0.6), g)
    return dist_gradcheck(lambda t: ep(t)[0], _x(g.rank, 1), g, x_placement="shard",
                          loss_placement="partial", what="expert-parallel MoE", atol=1e-6)


@pytest.mark.multiproc
def test_dispatch_and_combine_pass_finite_differences():
    assert all(spawn(2, _dispatch_combine_gradcheck))


def test_experts_must_split_over_ep():
    class G:
        size, rank = 3, 0
    with pytest.raises(ValueError, match="n_experts=4 does not split over ep=3"):
        ExpertParallelMoE(_moe(), G())


def _bytes(ctx, ep, top_k):
    """One step of a MoE GPT on dp=4: the ep group's bytes against take_traffic."""
    from minidist.data import DataConfig, SyntheticData, model_config_for
    from minidist.parallel import micro_batching
    from minidist.parallel.compose import build
    from minidist.train import Plan
    data = DataConfig(task="sort", length=6, seed=2)
    cfg = model_config_for(data, n_layer=2, n_head=2, n_embd=16, moe_every=1, n_experts=4,
                           top_k=top_k, capacity_factor=0.8)
    plan = Plan(dp=4, ep=ep, micro_batches=2)
    lay = build(ctx, plan, cfg, 0, optimizer="adamw", lr=1e-3, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=0.0)
    batches, n = micro_batching.micro_batches(SyntheticData(data), 0, 16, 4, lay.dp_group.rank,
                                              2, 0)
    before = lay.ep_group.stats["bytes_sent"]
    micro_batching.grad_accumulation(lay.engine, batches, n)
    measured = lay.ep_group.stats["bytes_sent"] - before
    formula = sum(m.take_traffic(8) for _, m in lay.model.named_modules()
                  if hasattr(m, "take_traffic"))
    return measured, formula


@pytest.mark.multiproc
@pytest.mark.parametrize("ep, top_k", [(2, 1), (4, 2)])
def test_all_to_all_bytes_equal_the_formula(ep, top_k):
    for measured, formula in spawn(4, _bytes, ep, top_k):
        assert measured == formula > 0
