"""The deterministic mode under mixed precision: the casts are elementwise and the fp8
scales are per row or per tile (what no layout cuts), so the mode's guarantee carries over:
bf16, fp16 and fp8 (rowwise, blockwise, mxfp8) each train ONE set of bits under dp, ZeRO-3,
tp with and without SP, pp, equal to the deterministic single process under the same
policy (losses, gradient norms, every parameter, compared with ==)."""

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
CFG = GPTConfig(vocab_size=11, block_size=9, n_layer=2, n_head=2, n_embd=16, dropout=0.1,
                dtype="float32")
B, STEPS, LR, CLIP = 8, 3, 1e-2, 0.5
LAYOUTS = {"dp2": dict(dp=2), "dp2-zero3": dict(dp=2, zero=3), "tp2": dict(tp=2),
           "tp2-sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2, micro_batches=2)}
POLICIES = [("bf16", "delayed"), ("fp16", "delayed"), ("fp8", "rowwise"),
            ("fp8", "blockwise"), ("fp8", "mxfp8")]
DEFAULT = {("bf16", "delayed"): ("tp2-sp", "pp2"), ("fp8", "blockwise"): ("dp2-zero3", "tp2")}


def _rank(ctx, plan):
    return train_on_rank(ctx, CFG, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=B, deterministic=True),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


def _cases():
    for precision, recipe in POLICIES:
        for name in LAYOUTS:
            slow = name not in DEFAULT.get((precision, recipe), ())
            yield pytest.param(precision, recipe, name, id=f"{precision}-{recipe}-{name}",
                               marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("precision, recipe, layout", list(_cases()))
def test_each_precision_trains_one_set_of_bits_across_layouts(precision, recipe, layout):
    ref = train_single_process(CFG, DATA, steps=STEPS, global_batch=B, lr=LR, clip_grad=CLIP,
                               deterministic=True, precision=precision, fp8_recipe=recipe)
    plan = Plan(**LAYOUTS[layout], precision=precision, fp8_recipe=recipe)
    for r, run in enumerate(spawn(plan.world_size, _rank, plan)):
        assert run.losses == ref.losses, (layout, r, run.losses, ref.losses)
        assert run.grad_norms == ref.grad_norms, (layout, r)
        for name, p in ref.params.items():
            assert np.array_equal(run.params[name], p), f"{layout} rank {r}: {name}"


def _rank_with(ctx, plan, cfg, token_tiles):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=B, deterministic=True,
                                   token_tiles=token_tiles),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


@pytest.mark.slow
@pytest.mark.parametrize("precision, recipe", [("bf16", "delayed"), ("fp8", "rowwise")])
@pytest.mark.parametrize("layout", ["cp2", "ep2"])
def test_context_and_expert_parallelism_too(precision, recipe, layout):
    """cp = 2 sums over runs of positions (token tiles 4: the single process too); ep = 2
    trains a MoE (top-2 of 4 experts) whose experts' grains add in their own tree."""
    cfg, tiles, fields = CFG, None, dict(cp=2)
    if layout == "cp2":
        tiles = 4
        cfg = GPTConfig(**{**CFG.__dict__, "block_size": 8})        # T = 8: 4 runs of 2
    else:
        cfg = GPTConfig(**{**CFG.__dict__, "moe_every": 1, "n_experts": 4, "top_k": 2,
                           "moe_group_size": 8})
        fields = dict(dp=2, ep=2)
    ref = train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR, clip_grad=CLIP,
                               deterministic=True, token_tiles=tiles, precision=precision,
                               fp8_recipe=recipe)
    plan = Plan(**fields, precision=precision, fp8_recipe=recipe)
    for r, run in enumerate(spawn(plan.world_size, _rank_with, plan, cfg, tiles)):
        assert run.losses == ref.losses and run.grad_norms == ref.grad_norms, (layout, r)
        for name, p in ref.params.items():
            assert np.array_equal(run.params[name], p), f"{layout} rank {r}: {name}"
