"""Deterministic mode (minidist/deterministic/, its step in step.py): every dp size, ZeRO stage, pipeline
schedule, tensor-parallel size (with and without SP), expert and context parallelism and
micro-batch count, float64 and float32, trains the same bits as the deterministic single
process: losses, gradient norms and every parameter, compared with ==, not a tolerance.

By default one case per axis runs: ZeRO-1 and ZeRO-2 under dp; plain dp=2, dp=4 with ZeRO-3
and the composition dp=2 x pp=2 (zb-h1) in the grain-3 test; tp=2; cp=2 (ring, zig-zag);
dp=2 x ep=2; and the cheap refusals (sequence parallelism: test_tensor.py). Every other
case of the lists below (both dtypes), the pipeline schedules, the MoE pipelines, full
recomputation, two runs of one layout, token tiles of 2 positions, and the sweeps over every
factorisation of W <= 8 run under -m slow."""

import functools

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan
from minidist.runtime import spawn
from minidist.train import OptimizerConfig, RunConfig, train_on_rank

pytestmark = pytest.mark.multiproc
DATA = DataConfig("sort", length=4)
B, STEPS, LR, CLIP = 12, 3, 1e-2, 0.5


def _cfg(dtype: str) -> GPTConfig:
    return GPTConfig(vocab_size=11, block_size=9, n_layer=2, n_head=2, n_embd=16,
                     dropout=0.1, dtype=dtype)


def _rank(ctx, cfg, plan):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=B, deterministic=True),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


def _dtype_cases(cases, ids, default):
    """Every case in float64 and float32, with the ids two stacked parametrizes give them
    ('<case id>-<dtype>'); the (case, dtype) ids in `default` run by default, the rest only
    under -m slow."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), dtype,
                         id=f"{name}-{dtype}",
                         marks=() if f"{name}-{dtype}" in default else pytest.mark.slow)
            for case, name in zip(cases, ids) for dtype in ("float64", "float32")]


def _same(run, ref, what):
    assert run.losses == ref.losses, (what, run.losses, ref.losses)
    assert run.grad_norms == ref.grad_norms, (what, run.grad_norms, ref.grad_norms)
    for name, p in ref.params.items():
        assert np.array_equal(run.params[name], p), f"{what}: {name} differs"


DP_CASES = [(1, 0, 1), (2, 0, 1), (3, 0, 2), (4, 0, 1), (2, 1, 2), (3, 2, 1), (2, 3, 2), (4, 3, 1)]


# default: ZeRO-1 (with 2 micro-batches) and ZeRO-2, the cheapest; plain dp and ZeRO-3 run
# by default in test_a_larger_grain_is_bitwise_across_layouts_that_hold_whole_grains
@pytest.mark.parametrize("dp, zero, M, dtype", _dtype_cases(
    DP_CASES, ["-".join(map(str, c)) for c in DP_CASES],
    default={"2-1-2-float32", "3-2-1-float32"}))
def test_every_dp_and_zero_layout_equals_the_single_process_bit_for_bit(dtype, dp, zero, M):
    cfg = _cfg(dtype)
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR, clip_grad=CLIP,
                               deterministic=True)
    plan = Plan(dp=dp, zero=zero, micro_batches=M)
    runs = spawn(dp, _rank, cfg, plan)
    for r, run in enumerate(runs):
        _same(run, ref, f"{plan.describe()} ZeRO-{zero} M={M} rank {r}")


def test_the_layouts_it_does_not_cover_are_refused_by_name():
    from minidist.deterministic.step import check
    cfg = _cfg("float64")
    with pytest.raises(ValueError, match="use --fp8-recipe rowwise, blockwise or mxfp8"):
        check(Plan(dp=2, precision="fp8"), cfg)             # per-tensor scales: cut by rows
    with pytest.raises(Exception, match="cp=2 needs --token-tiles N"):
        spawn(2, _rank, cfg, Plan(cp=2))
    with pytest.raises(Exception, match="not yet cp=2 with MoE blocks"):
        moe = cfg.__class__(**{**cfg.__dict__, "moe_every": 1, "n_experts": 2,
                                "moe_group_size": 2})
        spawn(2, _rank_tt, moe, Plan(cp=2), 8)


@pytest.mark.slow      # pp runs by default in the grain-3 test (dp=2 x pp=2, zb-h1)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("dp, pp, zero, schedule", [(1, 2, 0, "1f1b"), (1, 2, 0, "gpipe"),
                                                    (2, 2, 1, "1f1b"), (1, 3, 0, "1f1b"),
                                                    (2, 2, 2, "gpipe"),
                                                    (1, 2, 0, "interleaved"),
                                                    (1, 2, 2, "interleaved"),
                                                    (1, 2, 0, "zb-h1"), (2, 2, 1, "zb-h1"),
                                                    (1, 4, 0, "zb-h1")])
def test_pipeline_layouts_equal_the_single_process_bit_for_bit(dtype, dp, pp, zero, schedule):
    """Each schedule's gradient of a sample on a stage is complete after its last backward
    action there: B, or W under zero bubble; interleaving adds the chunks' disjoint parts."""
    cfg = _cfg(dtype).__class__(**{**_cfg(dtype).__dict__, "n_layer": 4})
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR, clip_grad=CLIP,
                               deterministic=True)
    plan = Plan(dp=dp, pp=pp, zero=zero, micro_batches=2, schedule=schedule)
    for r, run in enumerate(spawn(dp * pp, _rank, cfg, plan)):
        _same(run, ref, f"{plan.describe()} ZeRO-{zero} {schedule} rank {r}")


FAMILY_CASES = [(1, 2, 0, 4, "dualpipe"), (1, 2, 0, 4, "zbv"), (2, 2, 1, 6, "dualpipe"),
                (1, 4, 0, 12, "dualpipe"), (1, 2, 0, 4, "dualpipev"), (1, 4, 0, 12, "dualpipev"),
                (2, 2, 2, 6, "zbv"), (1, 4, 0, 4, "zbv"), (1, 2, 0, 3, "zb-2p"),
                (1, 3, 0, 3, "zb-1p"), (1, 2, 0, 3, "zb-h2"), (1, 2, 0, 4, "v-half"),
                (2, 3, 0, 6, "v-min")]


# default: DualPipe (two directions, mirrored copies, FB actions) and ZBV (the V's turn)
@pytest.mark.parametrize("dp, pp, zero, M, schedule, dtype", _dtype_cases(
    FAMILY_CASES, ["-".join(map(str, c)) for c in FAMILY_CASES],
    default={"1-2-0-4-dualpipe-float32", "1-2-0-4-zbv-float64"}))
def test_the_schedule_family_equals_the_single_process_bit_for_bit(dtype, dp, pp, zero, M,
                                                                  schedule):
    """A V turns inside a stage; DualPipe's mirrors each hold one direction's share of a
    sample's gradient (x + 0 = x: exact) and its loss: every layout gives the same bits."""
    cfg = _cfg(dtype).__class__(**{**_cfg(dtype).__dict__, "n_layer": 2 * pp})
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR, clip_grad=CLIP,
                               deterministic=True)
    plan = Plan(dp=dp, pp=pp, zero=zero, micro_batches=M, schedule=schedule)
    for r, run in enumerate(spawn(dp * pp, _rank, cfg, plan)):
        _same(run, ref, f"{plan.describe()} ZeRO-{zero} rank {r}")


def _grain_rank(ctx, cfg, plan, grain):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=B, deterministic=True, grain=grain),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


# float32 by default: plain dp, ZeRO-3 and the composition dp x pp (zb-h1) in one test
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.slow), "float32"])
def test_a_larger_grain_is_bitwise_across_layouts_that_hold_whole_grains(dtype):
    """grain=3: four leaves of three rows; dp=2, dp=4 with ZeRO-3 and dp=2 x pp=2 (zb-h1)
    each equal the single process with the same grain."""
    cfg = _cfg(dtype).__class__(**{**_cfg(dtype).__dict__, "n_layer": 4})
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR, clip_grad=CLIP,
                               deterministic=True, grain=3)
    for plan in (Plan(dp=2), Plan(dp=4, zero=3), Plan(dp=2, pp=2, schedule="zb-h1")):
        for r, run in enumerate(spawn(plan.world_size, _grain_rank, cfg, plan, 3)):
            _same(run, ref, f"{plan.describe()} grain 3 rank {r}")


def test_a_grain_that_does_not_divide_a_ranks_rows_is_refused():
    with pytest.raises(Exception, match="not a whole number of grains"):
        spawn(2, _grain_rank, _cfg("float64"), Plan(dp=2), 4)
    with pytest.raises(ValueError, match="divides global_batch"):
        train_single_process(_cfg("float64"), DATA, steps=1, global_batch=B, lr=LR,
                             deterministic=True, grain=5)


def _cfg4(dtype: str) -> GPTConfig:
    """4 heads (tp 1, 2, 4) and 4 layers (pp 1, 2, 4)."""
    return GPTConfig(vocab_size=11, block_size=9, n_layer=4, n_head=4, n_embd=16,
                     dropout=0.1, dtype=dtype)


@functools.lru_cache(maxsize=16)
def _reference(dtype: str, batch: int):
    return train_single_process(_cfg4(dtype), DATA, steps=STEPS, global_batch=batch, lr=LR,
                                clip_grad=CLIP, deterministic=True)


def _rank_b(ctx, cfg, plan, batch):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=batch, deterministic=True),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


TP_PLANS = [Plan(tp=2), Plan(tp=4), Plan(dp=2, tp=2, zero=3),
            Plan(pp=2, tp=2, micro_batches=2, schedule="zb-h1"), Plan(dp=2, tp=4, zero=1)]


# default: tp=2 alone (float64), the cheapest tp layout
@pytest.mark.parametrize("plan, dtype", _dtype_cases(
    TP_PLANS, [p.describe() for p in TP_PLANS], default={"dp=1 x tp=2-float64"}))
def test_tensor_parallel_layouts_equal_the_single_process_bit_for_bit(dtype, plan):
    """Column and row shards are whole tiles of deterministic/matmul.py; the vocabulary-parallel
    loss sums over V in the single process's tree; the norm is over whole gradients."""
    for r, run in enumerate(spawn(plan.world_size, _rank_b, _cfg4(dtype), plan, B)):
        _same(run, _reference(dtype, B), f"{plan.describe()} rank {r}")


@pytest.mark.slow      # implied by the layouts' equality with the single process
def test_two_runs_of_one_layout_are_bitwise_equal():
    plan = Plan(dp=2, tp=2, zero=1)
    first, second = (spawn(4, _rank_b, _cfg4("float32"), plan, B) for _ in range(2))
    for a, b in zip(first, second):
        _same(a, b, "a second run")


def factorisations(limit: int = 8) -> list[Plan]:
    """Every dp x pp x tp = W <= limit with tp | 4 heads and pp | 4 layers; ZeRO stages,
    pipeline schedules and sequence parallelism (every other tp > 1) rotate over the list."""
    plans, schedules = [], ["1f1b", "gpipe", "zb-h1", "interleaved"]
    for W in range(1, limit + 1):
        for pp in (1, 2, 4):
            for tp in (1, 2, 4):
                if W % (pp * tp):
                    continue
                dp, i = W // (pp * tp), len(plans)
                kw = {} if pp == 1 else {"schedule": schedules[i % (3 if pp == 4 else 4)],
                                         "micro_batches": 2}
                plans.append(Plan(dp=dp, pp=pp, tp=tp, zero=i % (4 if pp == 1 else 3),
                                  sequence_parallel=tp > 1 and i % 2 == 1, **kw))
    return plans


def _batch(plan: Plan) -> int:
    """A global batch the plan's dp divides (the single process trains the same one)."""
    return {5: 10, 7: 14}.get(plan.dp, 24)


SWEEP = factorisations()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("plan", SWEEP, ids=[f"{p.describe()}-zero{p.zero}" for p in SWEEP])
def test_every_factorisation_of_w_up_to_8_equals_the_single_process(dtype, plan):
    batch = _batch(plan)
    for r, run in enumerate(spawn(plan.world_size, _rank_b, _cfg4(dtype), plan, batch)):
        _same(run, _reference(dtype, batch), f"{plan.describe()} ZeRO-{plan.zero} rank {r}")


def _moe(dtype: str) -> GPTConfig:
    """Every block a MoE of 4 experts (top-2), routing groups of one sample (T = 8)."""
    return GPTConfig(vocab_size=11, block_size=9, n_layer=2, n_head=4, n_embd=16,
                     dropout=0.1, dtype=dtype, moe_every=1, n_experts=4, moe_group_size=8)


@functools.lru_cache(maxsize=16)
def _moe_reference(dtype: str, batch: int):
    return train_single_process(_moe(dtype), DATA, steps=STEPS, global_batch=batch, lr=LR,
                                clip_grad=CLIP, deterministic=True)


EP_PLANS = [Plan(dp=2, ep=2), Plan(dp=4, ep=2, zero=1), Plan(dp=4, ep=4, zero=2),
            Plan(dp=2, ep=2, tp=2), Plan(dp=2, ep=2, zero=3)]


# default: dp=2 x ep=2 (float32), the cheapest ep layout
@pytest.mark.parametrize("plan, dtype", _dtype_cases(
    EP_PLANS, [f"{p.describe()}-zero{p.zero}" for p in EP_PLANS],
    default={"dp=2 (ep=2) x tp=1-zero0-float32"}))
def test_expert_parallel_layouts_equal_the_single_process_bit_for_bit(dtype, plan):
    """Each expert runs each source grain's tokens in a call of their own, on an alias
    whose gradient is that grain's; the grains are added in the tree over edp."""
    for r, run in enumerate(spawn(plan.world_size, _rank_b, _moe(dtype), plan, B)):
        _same(run, _moe_reference(dtype, B), f"{plan.describe()} rank {r}")


PP_MOE_PLANS = [Plan(pp=2, micro_batches=2), Plan(dp=2, pp=2, zero=1, schedule="zb-h1"),
                Plan(dp=2, ep=2, pp=2, micro_batches=2),
                Plan(dp=2, ep=2, pp=2, micro_batches=2, schedule="interleaved")]


@pytest.mark.slow
@pytest.mark.parametrize("plan", PP_MOE_PLANS, ids=[p.describe() for p in PP_MOE_PLANS])
def test_pipelines_of_moe_blocks_equal_the_single_process_bit_for_bit(plan):
    """Each stage's aux terms are gathered to the last stage and added as GPT.loss adds
    them; under ep the expert aliases are kept per micro-batch in flight (an interleaved
    stage may hold no MoE block at all: 4 layers, every second one a MoE)."""
    cfg = _moe("float32").__class__(**{**_moe("float32").__dict__, "n_layer": 4,
                                       "moe_every": 2})
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR,
                               clip_grad=CLIP, deterministic=True)
    for r, run in enumerate(spawn(plan.world_size, _rank_b, cfg, plan, B)):
        _same(run, ref, f"{plan.describe()} rank {r}")


@pytest.mark.slow
def test_full_recomputation_under_zero_bubble_takes_each_action_s_gradient():
    """With full recomputation a block's weight gradients arrive in B (its whole backward
    runs there), not in W: each action's part is taken after it."""
    cfg = _cfg4("float32").__class__(**{**_cfg4("float32").__dict__, "recompute": "full"})
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR,
                               clip_grad=CLIP, deterministic=True)
    plan = Plan(pp=2, micro_batches=2, schedule="zb-h1")
    for r, run in enumerate(spawn(2, _rank_b, cfg, plan, B)):
        _same(run, ref, f"zb-h1 with full recomputation rank {r}")


def moe_factorisations(limit: int = 8) -> list[Plan]:
    """Every dp x tp x pp = W <= limit with ep | dp, ep | 4 experts, tp | 4 heads, pp | 2
    layers (ZeRO 0-3; 0-2 with pp)."""
    plans = []
    for W in range(1, limit + 1):
        for pp in (1, 2):
            for tp in (1, 2, 4):
                for ep in (1, 2, 4):
                    dp, i = W // (tp * pp), len(plans)
                    if W % (tp * pp) or dp % ep:
                        continue
                    kw = {} if pp == 1 else {"pp": 2, "micro_batches": 2,
                                             "schedule": ("1f1b", "zb-h1")[i % 2]}
                    plans.append(Plan(dp=dp, tp=tp, ep=ep, zero=i % (4 if pp == 1 else 3),
                                      **kw))
    return plans


MOE_SWEEP = moe_factorisations()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("plan", MOE_SWEEP,
                         ids=[f"{p.describe()}-zero{p.zero}" for p in MOE_SWEEP])
def test_every_moe_factorisation_of_w_up_to_8_equals_the_single_process(dtype, plan):
    batch = _batch(plan)
    for r, run in enumerate(spawn(plan.world_size, _rank_b, _moe(dtype), plan, batch)):
        _same(run, _moe_reference(dtype, batch), f"{plan.describe()} ZeRO-{plan.zero} rank {r}")


def _rank_tt(ctx, cfg, plan, token_tiles, batch=B, grain=1):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=batch, deterministic=True,
                                   token_tiles=token_tiles, grain=grain),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


@functools.lru_cache(maxsize=16)
def _tiled_reference(dtype: str, batch: int, token_tiles: int, grain: int = 1):
    return train_single_process(_cfg4(dtype), DATA, steps=STEPS, global_batch=batch, lr=LR,
                                clip_grad=CLIP, deterministic=True, token_tiles=token_tiles,
                                grain=grain)


CP_PLANS = [Plan(cp=2), Plan(cp=2, cp_layout="contiguous"), Plan(cp=4, cp_algo="ulysses"),
            Plan(dp=2, cp=2, zero=1), Plan(cp=2, zero=3), Plan(cp=2, tp=2),
            Plan(dp=2, cp=2, tp=2, sequence_parallel=True, cp_layout="contiguous"),
            Plan(cp=2, pp=2, micro_batches=2, schedule="zb-h1")]


# default: cp=2, ring, zig-zag (float32), the cheapest cp layout
@pytest.mark.parametrize("plan, dtype", _dtype_cases(
    CP_PLANS, [f"{p.describe()}-{p.cp_layout}-zero{p.zero}" for p in CP_PLANS],
    default={"dp=1 x cp=2 (ring) x tp=1-zigzag-zero0-float32"}))
def test_context_parallel_layouts_equal_the_single_process_bit_for_bit(dtype, plan):
    """--token-tiles 8 (one position per run here, T = 8): every sum over positions is a
    tree over the runs, exchanged over cp; attention over all-gathered K and V."""
    for r, run in enumerate(spawn(plan.world_size, _rank_tt, _cfg4(dtype), plan, 8)):
        _same(run, _tiled_reference(dtype, B, 8), f"{plan.describe()} rank {r}")


GRAIN_CP_PLANS = [Plan(cp=2), Plan(dp=2, cp=2, zero=1), Plan(tp=2, sequence_parallel=True),
                  Plan(cp=2, tp=2, cp_layout="contiguous")]


@pytest.mark.parametrize("plan", [GRAIN_CP_PLANS[0]] + [pytest.param(p, marks=pytest.mark.slow)
                                                        for p in GRAIN_CP_PLANS[1:]],
                         ids=[f"{p.describe()}-{p.cp_layout}" for p in GRAIN_CP_PLANS])
def test_token_runs_of_a_larger_grain_are_bitwise_across_layouts(plan):
    """grain=2, token_tiles=4: a leaf is a run of 2 positions of both rows of the grain
    (one BLAS call, one table), whichever rank holds it."""
    ref = _tiled_reference("float32", B, 4, 2)
    for r, run in enumerate(spawn(plan.world_size, _rank_tt, _cfg4("float32"), plan, 4,
                                  B, 2)):
        _same(run, ref, f"{plan.describe()} grain 2 token_tiles=4 rank {r}")


@pytest.mark.slow      # its refusal also runs by default in test_attention.py
def test_token_tiles_change_no_layout_s_agreement_and_runs_must_be_whole():
    """token_tiles=4 (runs of 2 positions): dp, tp (+SP) and the contiguous cp=2 layout
    hold whole runs and agree; zig-zag cp=4 (one position per chunk) is refused."""
    ref = _tiled_reference("float64", B, 4)
    for plan in (Plan(dp=2), Plan(tp=2, sequence_parallel=True),
                 Plan(cp=2, cp_layout="contiguous")):
        for r, run in enumerate(spawn(plan.world_size, _rank_tt, _cfg4("float64"), plan, 4)):
            _same(run, ref, f"{plan.describe()} token_tiles=4 rank {r}")
    with pytest.raises(Exception, match=r"not whole runs of T / 4 = 2; use --token-tiles 8"):
        spawn(4, _rank_tt, _cfg4("float64"), Plan(cp=4), 4)


def cp_factorisations(limit: int = 8) -> list[Plan]:
    """Every dp x cp x tp x pp = W <= limit with cp > 1 (cp | 4: zig-zag runs of one
    position; tp | 4 heads, pp | 4 layers); layouts, algorithms, SP and ZeRO rotate."""
    plans = []
    for W in range(2, limit + 1):
        for cp in (2, 4):
            for tp in (1, 2, 4):
                for pp in (1, 2, 4):
                    if W % (cp * tp * pp):
                        continue
                    i = len(plans)
                    kw = {} if pp == 1 else {"micro_batches": 2, "schedule": "1f1b"}
                    plans.append(Plan(dp=W // (cp * tp * pp), cp=cp, tp=tp, pp=pp,
                                      zero=i % (4 if pp == 1 else 3),
                                      cp_algo="ulysses" if i % 3 == 2 and 4 % (cp * tp) == 0
                                      else "ring",
                                      cp_layout="contiguous" if i % 2 else "zigzag",
                                      sequence_parallel=tp > 1 and i % 2 == 0, **kw))
    return plans


CP_SWEEP = cp_factorisations()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("plan", CP_SWEEP, ids=[f"{p.describe()}-{p.cp_layout}-zero{p.zero}"
                                                for p in CP_SWEEP])
def test_every_context_parallel_factorisation_of_w_up_to_8_equals_the_single_process(dtype,
                                                                                    plan):
    batch = _batch(plan)
    for r, run in enumerate(spawn(plan.world_size, _rank_tt, _cfg4(dtype), plan, 8, batch)):
        _same(run, _tiled_reference(dtype, batch, 8),
              f"{plan.describe()} {plan.cp_layout} ZeRO-{plan.zero} rank {r}")


def test_the_fewest_token_tiles_formula_is_the_smallest_whole_count():
    """fewest_token_tiles = lcm(cut, cp tp) against a search with whole_token_runs."""
    from minidist.deterministic.step import fewest_token_tiles, whole_token_runs
    for cp in (2, 3, 4):
        for tp in (1, 2, 3, 4):
            for sp in ((False, True) if tp > 1 else (False,)):
                for layout in ("zigzag", "contiguous"):
                    plan = Plan(cp=cp, tp=tp, sequence_parallel=sp, cp_layout=layout)
                    for T in range(2, 50):
                        cuts = T % (2 * cp if layout == "zigzag" else cp) == 0 and not (
                            sp and (T // cp) % tp)
                        if not cuts:                     # the layout cannot cut T at all
                            assert fewest_token_tiles(plan, T) is None, (plan, T)
                            continue
                        searched = next(n for n in range(1, T + 1) if T % n == 0 and
                                        whole_token_runs(plan, T, n) is None)
                        assert fewest_token_tiles(plan, T) == searched, (cp, tp, sp, layout, T)
