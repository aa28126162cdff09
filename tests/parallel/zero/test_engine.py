"""ZeRO must be invisible in the numbers: sharding the optimizer state, the gradients and the
parameters over W ranks trains exactly like one process, and holds exactly the predicted
bytes.

The default run takes each stage once per property (W = 2 or 3, one case with M = 2); the
W x stage x M sweeps, the eight-rank runs and the other ZeRO-3 variants are `-m slow`."""

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.optim import SGD, AdamW
from minidist.parallel.zero.engine import ZeroEngine, algorithms
from minidist.parallel.zero.flat import FlatShard, split_units
from minidist.parallel.zero.memory import comm_elements, exact_bytes
from minidist.runtime.launch import spawn
from minidist.train import Plan, train_on_rank
from tests.helpers import assert_close, assert_runs_match, configs

DATA = DataConfig(task="sort", length=4, seed=1)
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)                 # float64
STEPS, GLOBAL_BATCH, LR = 3, 24, 1e-2       # 24 rows split over W in 1..4 x M in 1, 2


@functools.lru_cache(maxsize=None)
def _reference(cfg=TINY, M=1, B=GLOBAL_BATCH, **kw):
    return train_single_process(cfg, DATA, steps=STEPS, global_batch=B, lr=LR, seed=0,
                                grad_accum=M, **kw)


def _run(W, stage, M=1, cfg=TINY, B=GLOBAL_BATCH, algo="auto", **kw):
    plan = Plan(dp=W, zero=stage, micro_batches=M, algo=algo)
    return spawn(W, train_on_rank, cfg, DATA, plan,
                 *configs(steps=STEPS, global_batch=B, lr=LR, seed=0, **kw))


def _sweep(grid, default):
    """The cases of grid; those not in default are marked slow (ids unchanged)."""
    return [c if c in default else pytest.param(*c, marks=pytest.mark.slow) for c in grid]


# (W, stage, M): the cases, and ids W-stage-M, of the stacked parametrize this replaced
GRID = [(W, stage, M) for M in (1, 2) for stage in (1, 2, 3) for W in (1, 2, 3, 4)]


def _numels(cfg, W):
    return [u.numel for u in split_units(GPT(cfg, seed=None), W)]


@pytest.mark.multiproc
# default: every stage once; W = 3 shards unevenly, stage 3 with accumulation (M = 2)
@pytest.mark.parametrize("W, stage, M", _sweep(GRID, {(2, 1, 1), (3, 2, 1), (3, 3, 2)}))
def test_zero_matches_single_process_and_memory_formula(W, stage, M):
    runs = _run(W, stage, M)
    assert_runs_match(runs, _reference(M=M), f"W={W} stage={stage} M={M}")
    expected = exact_bytes(stage, _numels(TINY, W), W, itemsize=8, micro_batches=M)
    for rank, run in enumerate(runs):                        # measured == formula, exactly
        assert run.memory == expected, f"rank {rank}: memory {run.memory} != {expected}"


@pytest.mark.slow       # W = 8 adds no code path; the W sweeps above cover 1-4
@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [2, 3])
def test_eight_ranks(stage):
    runs = _run(8, stage, M=2, B=16)
    assert_runs_match(runs, _reference(M=2, B=16), f"W=8 stage={stage}")
    assert runs[0].memory == exact_bytes(stage, _numels(TINY, 8), 8, 8, micro_batches=2)


@pytest.mark.multiproc
# default: one case (it trains all four stages); the other W x M are slow
@pytest.mark.parametrize("W, M", _sweep([(W, M) for M in (1, 2) for W in (2, 3, 4)],
                                        {(2, 1)}))
def test_stages_0_to_3_bitwise_identical_with_direct(W, M):
    """Canonical-order sums and elementwise updates: sharding changes no bit."""
    runs = {s: _run(W, s, M, algo="direct")[0] for s in range(4)}
    for s in (1, 2, 3):
        assert runs[s].losses == runs[0].losses, f"stage {s}: losses differ from stage 0"
        for name, p in runs[0].params.items():
            assert np.array_equal(runs[s].params[name], p), f"stage {s} vs 0 differ in {name}"


@pytest.mark.multiproc
# default: ZeRO-2 (stage 1 moves the same bytes) and stage 3 with M = 2 (its gathers)
@pytest.mark.parametrize("W, stage, M", _sweep([c for c in GRID if c[0] > 1],
                                               {(2, 2, 1), (2, 3, 2)}))
def test_bytes_sent_equal_formula(W, stage, M):
    runs = _run(W, stage, M, algo="ring")
    expected = 8 * comm_elements(stage, _numels(TINY, W), W, micro_batches=M)
    for rank, run in enumerate(runs):
        for step, traffic in enumerate(run.bytes_per_step):
            assert traffic == {"sent": expected, "recv": expected}, \
                f"rank {rank} step {step}: {traffic}, formula {expected} B"


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2,   # 2: shards
                                   pytest.param(3, marks=pytest.mark.slow)])     # the grads
def test_gradient_clipping_uses_the_global_norm(stage):
    kw = dict(clip_grad=0.05, weight_decay=0.1)           # 0.05 is below every step's norm
    ref = _reference(M=2, **kw)
    assert min(ref.grad_norms) > 0.05
    assert_runs_match(_run(3, stage, 2, **kw), ref, f"clip stage={stage}")


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2,
                                   pytest.param(3, marks=pytest.mark.slow)])
def test_sgd_with_momentum(stage):
    kw = dict(optimizer="sgd", momentum=0.9, weight_decay=0.01)
    runs = _run(3, stage, 1, **kw)
    assert_runs_match(runs, _reference(**kw), f"sgd stage={stage}")
    expected = exact_bytes(stage, _numels(TINY, 3), 3, 8, state_arrays=1)
    assert runs[0].memory == expected


@pytest.mark.multiproc
# default: dropout (masks drawn once, kept in the call's graph); untied head and float32 slow
@pytest.mark.parametrize("extra", [pytest.param(dict(tie_weights=False), marks=pytest.mark.slow),
                                   dict(dropout=0.1),
                                   pytest.param(dict(dtype="float32"), marks=pytest.mark.slow)])
def test_stage3_variants(extra):
    """Untied head, dropout (its masks kept in the call's graph), float32."""
    cfg = model_config_for(DATA, n_layer=3, n_head=2, n_embd=16, **extra)
    runs = _run(3, 3, 1, cfg=cfg)
    ref = _reference(cfg=cfg)
    tol = 1e-5 if extra.get("dtype") == "float32" else 1e-12
    for name, p in ref.params.items():
        assert_close(runs[1].params[name], p, atol=tol, what=f"{extra}: {name}")
    assert_close(runs[1].losses, ref.losses, atol=tol, what=f"{extra}: losses")
    b = 4 if extra.get("dtype") == "float32" else 8
    assert runs[0].memory == exact_bytes(3, _numels(cfg, 3), 3, b)


@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "2", None])
def test_stage_outside_0_to_3_is_a_value_error(stage):
    with pytest.raises(ValueError, match="stage=.* must be 1 .* 2 .* 3"):
        ZeroEngine(GPT(TINY), None, stage)


def test_stage_0_and_bad_algo_and_optimizer_are_value_errors():
    with pytest.raises(ValueError, match="DataParallel"):
        ZeroEngine(GPT(TINY), None, 0)
    with pytest.raises(ValueError, match="algo='tree' has no reduce_scatter"):
        ZeroEngine(GPT(TINY), None, 2, algo="tree")
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        ZeroEngine(GPT(TINY), None, 1, optimizer="lamb")


def _group(rank=0, size=3, shared=True):
    """Enough of a group to build an engine (the constructor communicates nothing)."""
    return SimpleNamespace(rank=rank, size=size, supports_shared=shared, name="dp")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_engine_steps_ddps_optimizer_over_flat_shards(stage, optimizer):
    """One optimizer code path: the AdamW / SGD object DDP uses, one FlatShard per unit."""
    e = ZeroEngine(GPT(TINY), _group(rank=1), stage, optimizer=optimizer, momentum=0.9)
    assert type(e.opt) is {"adamw": AdamW, "sgd": SGD}[optimizer]
    assert e.opt.params == e.shards and all(isinstance(s, FlatShard) for s in e.shards)
    state = e.opt.m + e.opt.v if optimizer == "adamw" else e.opt.buffers
    assert [a.shape for a in state] == [(u.shard,) for u in e.units] * (len(state) //
                                                                         len(e.units))


def test_zero_reduces_with_ring_where_the_group_has_no_shared_memory():
    assert algorithms("auto", _group(shared=True)) == ("direct", "ring")
    assert algorithms("auto", _group(shared=False)) == ("ring", "ring")      # MPI
    assert algorithms("halving", _group(shared=False)) == ("halving", "halving")
    assert ZeroEngine(GPT(TINY), _group(shared=False), 3).rs_algo == "ring"
    with pytest.raises(ValueError, match="algo='direct' sums through shared memory"):
        ZeroEngine(GPT(TINY), _group(shared=False), 1, algo="direct")
