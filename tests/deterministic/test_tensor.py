"""Deterministic mode under sequence parallelism (parallel/tensor/sequence.py): tp with SP, alone
and with dp (ZeRO-1) or pp, float64 and float32, trains the same bits as the deterministic
single process: losses, gradient norms and every parameter, compared with ==.

What SP changes: the LayerNorm gains and shifts and the row-parallel biases see this rank's
positions only; their gradients are sums over the global token index in one fixed tree,
exchanged over tp (deterministic/matmul.Tokens), in place of Megatron's f. The helpers are
those of test_step.py, repeated so that each file stands alone.

By default SP runs once, in the grain-3 test (tp=2 with SP); the layouts of SP_PLANS, in
both dtypes, run under -m slow."""

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
DATA = DataConfig("sort", length=4)              # T = 8 positions: tp = 2 and 4 split them
B, STEPS, LR, CLIP = 12, 3, 1e-2, 0.5


def _cfg(dtype: str) -> GPTConfig:
    """4 heads (tp 2, 4) and 4 layers (pp 2)."""
    return GPTConfig(vocab_size=11, block_size=9, n_layer=4, n_head=4, n_embd=16,
                     dropout=0.1, dtype=dtype)


@functools.lru_cache(maxsize=8)
def _reference(dtype: str, grain: int = 1):
    return train_single_process(_cfg(dtype), DATA, steps=STEPS, global_batch=B, lr=LR,
                                clip_grad=CLIP, deterministic=True, grain=grain)


def _rank(ctx, cfg, plan, grain):
    return train_on_rank(ctx, cfg, DATA, plan,
                         RunConfig(steps=STEPS, global_batch=B, deterministic=True, grain=grain),
                         OptimizerConfig(lr=LR, clip_grad=CLIP))


def _same(run, ref, what):
    assert run.losses == ref.losses, (what, run.losses, ref.losses)
    assert run.grad_norms == ref.grad_norms, (what, run.grad_norms, ref.grad_norms)
    for name, p in ref.params.items():
        assert np.array_equal(run.params[name], p), f"{what}: {name} differs"


SP_PLANS = [Plan(tp=2, sequence_parallel=True), Plan(tp=4, sequence_parallel=True),
            Plan(dp=2, tp=2, zero=1, sequence_parallel=True),
            Plan(pp=2, tp=2, micro_batches=2, schedule="1f1b", sequence_parallel=True)]


@pytest.mark.slow      # SP's default case: test_a_larger_grain_under_sequence_parallelism...
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("plan", SP_PLANS, ids=[p.describe() for p in SP_PLANS])
def test_sequence_parallel_layouts_equal_the_single_process_bit_for_bit(dtype, plan):
    """The edges of the tp regions only move data; the sums over positions are the single
    process's trees over tokens, whichever rank holds which positions."""
    for r, run in enumerate(spawn(plan.world_size, _rank, _cfg(dtype), plan, 1)):
        _same(run, _reference(dtype), f"{plan.describe()} SP rank {r}")


def test_a_larger_grain_under_sequence_parallelism_equals_the_single_process():
    """grain=3: three rows per leaf, so the tree over tokens runs over several runs of
    positions per rank (3 rows x 4 positions under tp=2)."""
    plan = Plan(tp=2, sequence_parallel=True)
    for r, run in enumerate(spawn(2, _rank, _cfg("float64"), plan, 3)):
        _same(run, _reference("float64", 3), f"{plan.describe()} SP grain 3 rank {r}")
