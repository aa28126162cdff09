"""Estimated bytes against bytes counted in one real training step, per rank and category.

The issue asks for parameters, gradients, optimizer state and buffers exactly, activations
within 5%. The formulas of memory/budget.py account for every array the autograd keeps, so
every category, activations and the recomputation's rebuilt arrays included, is asserted
to the byte here: a change in what a layer saves shows up as a failing test, not a drift.

The default run takes one MATRIX case per axis and policy (DEFAULT); `-m slow` runs all."""

import pytest

from minidist.data import DataConfig, model_config_for
from minidist.memory.budget import MemoryPlan, estimate_stages
from minidist.memory.budget_measure import MEASURED, compare, measure

pytestmark = pytest.mark.multiproc

DATA = DataConfig(task="sort", length=6)                              # T = 12, V = 11
TINY = dict(n_layer=2, n_head=4, n_embd=32)
BATCH = 12                                                             # splits over 1..4 x M

MATRIX = [                                                             # (model, plan), W <= 4
    ({}, dict()),
    ({}, dict(dp=2)), ({}, dict(dp=3, micro_batches=2)),
    ({}, dict(dp=2, zero=1)), ({}, dict(dp=2, zero=2)), ({}, dict(dp=4, zero=3)),
    ({}, dict(dp=3, zero=2, micro_batches=2)), ({}, dict(dp=2, zero=3, micro_batches=2)),
    ({}, dict(tp=2)), ({}, dict(tp=2, sp=True)), ({}, dict(tp=4)),
    ({}, dict(dp=2, tp=2, zero=1)), ({}, dict(dp=2, tp=2, sp=True, zero=3)),
    ({}, dict(pp=2, micro_batches=4)), ({}, dict(pp=2, micro_batches=3, schedule="gpipe")),
    ({}, dict(pp=2, tp=2, micro_batches=2)), ({}, dict(pp=2, dp=2, zero=2, micro_batches=2)),
    ({"n_layer": 4}, dict(pp=4, micro_batches=6)),
    ({}, dict(cp=2)), ({}, dict(cp=2, cp_algo="ulysses")), ({}, dict(cp=2, dp=2, zero=1)),
    ({}, dict(recompute="full")), ({}, dict(recompute="selective", tp=2, sp=True)),
    ({}, dict(recompute="full", pp=2, micro_batches=2)), ({}, dict(recompute="full", cp=2)),
    ({"dropout": 0.1}, dict(tp=2)), ({"dropout": 0.1}, dict(recompute="selective")),
    ({"bias": False, "tie_weights": False}, dict(dp=2, tp=2, zero=2)),
    ({"dtype": "float32"}, dict(dp=2, zero=1, precision="fp32")),
    ({}, dict(dp=2, zero=2, optimizer="sgd_momentum")),
]


def _name(case) -> str:
    model, plan = case
    return ",".join(f"{k}={v}" for k, v in {**model, **plan}.items()) or "single"


# one case per axis / policy: dp + ZeRO-2, ZeRO-3 with accumulation, tp + SP, pp (1F1B),
# cp ring and Ulysses, full and selective recomputation, SGD momentum, fp32 precision
DEFAULT = {"dp=2,zero=2", "dp=2,zero=3,micro_batches=2", "tp=2,sp=True", "pp=2,micro_batches=4",
           "cp=2", "cp=2,cp_algo=ulysses", "recompute=full", "dropout=0.1,recompute=selective",
           "dp=2,zero=2,optimizer=sgd_momentum", "dtype=float32,dp=2,zero=1,precision=fp32"}


@pytest.mark.parametrize("model, plan", [c if _name(c) in DEFAULT else
                                         pytest.param(*c, marks=pytest.mark.slow)
                                         for c in MATRIX], ids=[_name(c) for c in MATRIX])
def test_estimate_equals_measured_bytes(model, plan):
    cfg = model_config_for(DATA, **{**TINY, **model})
    plan = MemoryPlan(**plan)
    stages = estimate_stages(cfg, plan, BATCH)
    runs = measure(cfg, DATA, plan, BATCH)
    assert sorted({m.stage for m in runs}) == list(range(plan.pp))
    for m in runs:
        est = stages[m.stage]
        for c in MEASURED:
            assert getattr(est, c) == m.bytes[c], \
                f"rank {m.rank} (stage {m.stage}) {c}: estimated {getattr(est, c):,}, " \
                f"measured {m.bytes[c]:,}"
    if plan.recompute != "none":                        # the recomputation did happen
        assert all(m.bytes["recompute"] > 0 for m in runs)


def test_compare_reports_every_stage_and_category():
    cfg = model_config_for(DATA, **TINY)
    rows = compare(cfg, DATA, MemoryPlan(pp=2, micro_batches=2), BATCH)
    assert sorted(rows) == [0, 1]
    for stage, cats in rows.items():
        assert list(cats) == list(MEASURED)
        assert all(est == got for est, got in cats.values()), (stage, cats)
    assert rows[0]["activations"][0] > rows[1]["activations"][0]    # 2 micro-batches held


@pytest.mark.parametrize("plan", [dict(dp=2, zero=2, micro_batches=2),
                                  pytest.param(dict(pp=2, dp=2, zero=1, micro_batches=2),
                                               marks=pytest.mark.slow)])
def test_the_measured_step_holds_what_train_on_rank_holds(plan):
    """The step measured here is train.py's: its model states equal RankResult.memory."""
    from minidist.runtime.launch import spawn
    from minidist.train import OptimizerConfig, RunConfig, train_on_rank
    cfg, plan = model_config_for(DATA, **TINY), MemoryPlan(**plan)
    runs = spawn(plan.world_size, train_on_rank, cfg, DATA, plan.to_plan(),
                 RunConfig(steps=1, global_batch=BATCH), OptimizerConfig(lr=1e-3))
    for m, run in zip(measure(cfg, DATA, plan, BATCH), runs):
        peaks = sum(v for k, v in run.memory.items() if k.startswith("peak_"))
        assert {c: m.bytes[c] for c in ("params", "grads", "optimizer", "buffers")} == \
            {**{c: run.memory[c] for c in ("params", "grads", "optimizer")}, "buffers": peaks}


def test_measure_refuses_what_the_step_cannot_run():
    cfg = model_config_for(DATA, **TINY)                              # float64
    with pytest.raises(ValueError, match="precision=fp64"):
        measure(cfg, DATA, MemoryPlan(precision="bf16"), BATCH)
    with pytest.raises(ValueError, match="multiple of 5"):
        measure(cfg, DATA, MemoryPlan(dp=5), BATCH)
