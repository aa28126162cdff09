"""The memory estimator without running anything: the published worked examples, the model's
parameter list against the real GPT, and the formulas' closed forms.

Estimate vs measured on real ranks is tests/memory/test_budget_measure.py."""

import math

import numpy as np
import pytest

from minidist.memory import budget as mb
from minidist.memory import budget_models as bm
from minidist.nn import GPT, GPTConfig
from minidist.parallel import placement as pl
from minidist.parallel.tensor.tensor_parallel import expected_placement
from minidist.parallel.zero import memory as zm

SMALL = GPTConfig(vocab_size=11, block_size=12, n_layer=4, n_head=4, n_embd=32)


# --- the published examples ----------------------------------------------------------------

def test_zero_figure1_gives_the_papers_gigabytes():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, K = 12
    got = mb.zero_figure1()
    assert {s: round(v, 1) for s, v in got.items()} == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    assert got == zm.paper_example()       # 7.5e9 / 64 divides: padding changes nothing


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("s, b, h, a", [(2048, 1, 12288, 96), (512, 4, 1024, 16)])
def test_korthikanti_table2_rows(s, b, h, a, t):
    """Table 2 in the paper's own form, sbh (...): none, selective, full; with and without
    sequence parallelism."""
    sbh, core = s * b * h, 5 * a * s / (h * t)
    table = {("none", False): sbh * (10 + 24 / t + core), ("none", True): sbh * (34 / t + core),
             ("selective", False): sbh * (10 + 24 / t), ("selective", True): sbh * 34 / t,
             ("full", False): 2 * sbh, ("full", True): 2 * sbh}
    for (mode, sp), expected in table.items():
        if sp and t == 1:
            continue
        got = mb.korthikanti_layer_bytes(s, b, h, a, t, sp, recompute=mode)
        assert got == pytest.approx(expected, rel=1e-12), (mode, sp)


def test_korthikanti_selective_saves_70_percent_on_gpt3():
    """Sec. 5: for GPT-3 175B (a = 96, s = 2048, h = 12288) 5as/h = 80 against 34, so
    selective recomputation keeps 34/114 of the activations: a 70% saving."""
    s, h, a = 2048, 12288, 96
    assert 5 * a * s / h == 80
    none = mb.korthikanti_layer_bytes(s, 1, h, a)
    selective = mb.korthikanti_layer_bytes(s, 1, h, a, recompute="selective")
    assert round(1 - selective / none, 2) == 0.70


# --- the model's parameters ---------------------------------------------------------------

CONFIGS = [SMALL, GPTConfig(bias=False, tie_weights=False, vocab_size=13, n_head=4),
           GPTConfig(n_layer=3, n_embd=48, n_head=6, mlp_ratio=2)]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_parameter_shapes_are_the_gpts(cfg):
    got = [(n, tuple(p.shape)) for n, p in GPT(cfg, seed=None).named_parameters()]
    assert bm.parameter_shapes(cfg) == got
    assert bm.parameter_count(cfg) == sum(math.prod(s) for _, s in got)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_local_numel_is_the_size_of_placement_shard(cfg, tp):
    for name, shape in bm.parameter_shapes(cfg):
        placement = expected_placement(name) if tp > 1 else pl.Replicate()
        if isinstance(placement, pl.Shard) and shape[placement.dim % len(shape)] % \
                placement.blocks:
            continue
        for rank in range(tp):                # padding: every rank the same count
            piece = pl.shard(np.zeros(shape), placement, tp, rank)
            assert bm.local_numel(name, shape, tp) == piece.size, (name, tp, rank)


def test_unit_numels_cover_the_model_once_and_tie_wte_on_both_ends():
    psi = bm.parameter_count(SMALL)
    assert sum(bm.unit_numels(SMALL)) == psi
    stages = [bm.unit_numels(SMALL, pp=3, stage=s) for s in range(3)]
    wte = SMALL.vocab_size * SMALL.n_embd
    assert sum(map(sum, stages)) == psi + wte               # the last stage's tied copy
    assert len(stages[1]) == 1                              # a middle stage: no root unit


@pytest.mark.parametrize("name, nominal", [("gpt3-125m", 125e6), ("gpt3-350m", 350e6),
                                           ("gpt3-760m", 760e6), ("gpt3-1.3b", 1.3e9),
                                           ("gpt3-2.7b", 2.7e9), ("gpt3-6.7b", 6.7e9),
                                           ("gpt3-13b", 13.0e9), ("gpt3-175b", 175.0e9)])
def test_presets_have_the_sizes_of_brown_et_al_table_2_1(name, nominal):
    assert abs(bm.parameter_count(bm.preset(name)) / nominal - 1) < 0.03


# --- the estimator's closed forms ---------------------------------------------------------

def test_ddp_model_states_are_the_papers_16_psi_in_bf16():
    cfg = bm.preset("gpt3-125m")
    e = mb.estimate(cfg, mb.MemoryPlan(dp=8, precision="bf16"), batch=8)
    psi = bm.parameter_count(cfg)
    assert (e.params, e.grads, e.optimizer) == (2 * psi, 2 * psi, 12 * psi)
    smooth = zm.formula_bytes(3, psi, 8)["total"]
    e3 = mb.estimate(cfg, mb.MemoryPlan(dp=8, zero=3, precision="bf16"), batch=8)
    units = len(bm.unit_numels(cfg))          # padding: < 8 elements per unit
    assert 0 <= e3.params + e3.grads + e3.optimizer - smooth < 16 * 8 * units


def test_recomputation_keeps_less_by_the_attention_cores_terms():
    cfg, R, T = SMALL, 2, SMALL.block_size
    est = {m: mb.estimate(cfg, mb.MemoryPlan(recompute=m), batch=R) for m in mb.RECOMPUTE}
    L, H, b = cfg.n_layer, cfg.n_head, 8
    # selective drops scores and softmax (2 R H T^2 b), and keeps the query and key
    # positions to rebuild the mask (8 T)
    dropped = L * (2 * R * H * T * T * b - 8 * T)
    assert est["none"].activations - est["selective"].activations == dropped
    assert est["selective"].recompute == 2 * R * H * T * T * b
    none_layer = sum(mb.layer_terms(cfg, mb.MemoryPlan(), R, T).values())
    assert est["none"].activations - est["full"].activations == \
        L * (none_layer - R * T * cfg.n_embd * b)
    # full: the backward rebuilds all of a layer, and its output (R T C b) once more
    assert est["full"].recompute == none_layer + R * T * cfg.n_embd * b
    assert est["none"].recompute == 0


def test_zero3_keeps_what_recompute_says_as_every_stage_does():
    """Stage 3 keeps each call's graph (without the unit's parameters): its activations and
    recomputation are those of stage 0 under the same `recompute`; only the model states
    and the gathered-parameter buffers differ."""
    for m in mb.RECOMPUTE:
        z3, z0 = (mb.estimate(SMALL, mb.MemoryPlan(dp=2, zero=z, recompute=m), batch=4)
                  for z in (3, 0))
        assert z3.buffers > 0
        assert (z3.activations, z3.recompute, z3.per_micro_batch) == \
            (z0.activations, z0.recompute, z0.per_micro_batch)


@pytest.mark.parametrize("schedule, held", [("1f1b", [4, 3, 2, 1]), ("gpipe", [8] * 4)])
def test_pipeline_stages_hold_the_schedules_micro_batches(schedule, held):
    plan = mb.MemoryPlan(pp=4, micro_batches=8, schedule=schedule)
    stages = mb.estimate_stages(SMALL, plan, batch=8)
    assert [e.held for e in stages] == held
    for e in stages:
        assert e.activations == e.held * sum(e.per_micro_batch.values())
    assert mb.estimate(SMALL, plan, batch=8) == max(stages, key=lambda e: e.total)


@pytest.mark.parametrize("plan, batch, fix", [
    (dict(cp=2, tp=2), 4, "cp=2 with tp=2"),
    (dict(cp=2, recompute="selective"), 4, "recompute=full or none"),
    (dict(dp=3), 4, "multiple of 3"),
    (dict(tp=3), 4, "n_head"),
    (dict(pp=2, zero=3), 4, "ZeRO-3 with pipeline"),
])
def test_plans_that_cannot_run_say_why(plan, batch, fix):
    with pytest.raises(ValueError, match=fix):
        mb.estimate(SMALL, mb.MemoryPlan(**plan), batch=batch)


def test_bad_options_and_models_are_refused():
    for bad in (dict(precision="fp8"), dict(recompute="some"), dict(schedule="zb-h1"),
                dict(optimizer="lion"), dict(dp=0)):
        with pytest.raises(ValueError):
            mb.MemoryPlan(**bad)
    with pytest.raises(ValueError, match="block_size"):
        mb.estimate(SMALL, mb.MemoryPlan(), batch=1, seq_len=13)
    with pytest.raises(ValueError, match="MoE"):
        mb.estimate(GPTConfig(moe_every=2), mb.MemoryPlan(), batch=1)
    with pytest.raises(ValueError, match="presets"):
        bm.preset("llama-7b")
