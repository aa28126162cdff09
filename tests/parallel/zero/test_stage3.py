"""ZeRO-3 from module-level hook points: the wrappers go on and come off the instances, a unit
lives exactly from its first use to its last one in each pass, and the gathered model,
tensor-parallel or not, trains like the single process."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.nn.gpt import Block
from minidist.parallel.zero import stage3
from minidist.parallel.zero.engine import ZeroEngine
from minidist.parallel.zero.flat import split_units, unit_of
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_close

DATA = DataConfig(task="sort", length=4, seed=1)                        # T = 8
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)           # float64
STEPS, GLOBAL_BATCH, LR = 3, 8, 1e-2


def test_unit_of_names_the_block_or_the_root():
    units = split_units(GPT(TINY, seed=None), 2)
    assert [unit_of(units, n) for n in ("", "wte", "ln_f", "blocks.0", "blocks.1.attn.qkv",
                                         "blocks")] == [0, 0, 0, 1, 2, 0]


def _wrap_and_unwrap(ctx):
    model = GPT(TINY)
    engine = ZeroEngine(model, ctx.world, 3)
    hooks = engine.stage3
    wrapped = (sorted(k for k in vars(model) if k in ("embed", "head", "forward")),
               ["forward" in vars(b) for b in model.blocks])
    points = [(p.name, p.method, p.unit) for p in hooks.points]
    placeholders = all(np.isnan(p.data).all() for p in model.parameters())
    try:
        stage3.Zero3Hooks(engine)
        second = "no error"
    except ValueError as e:
        second = str(e)
    hooks.unwrap()
    unwrapped = (sorted(k for k in vars(model) if k in ("embed", "head", "forward")),
                 ["forward" in vars(b) for b in model.blocks],
                 model.embed.__func__ is GPT.embed, model.blocks[0].forward.__func__ is
                 Block.forward)
    return wrapped, points, placeholders, second, unwrapped


@pytest.mark.multiproc
def test_hook_points_wrap_the_instances_and_unwrap_restores_them():
    wrapped, points, placeholders, second, unwrapped = spawn(1, _wrap_and_unwrap)[0]
    assert wrapped == (["embed", "head"], [True, True])          # instance attributes
    assert points == [("embed", "embed", 0), ("blocks.0.forward", "forward", 1),
                      ("blocks.1.forward", "forward", 2), ("head", "head", 0)]
    assert placeholders, "stage 3 must leave only NaN placeholders in the Parameters"
    assert "already wrapped" in second
    assert unwrapped == ([], [False, False], True, True)


def _trace_one_step(ctx, M):
    """Run one training step of ZeRO-3 on W ranks; log gathers, waits, frees, reductions."""
    model = GPT(TINY)
    engine = ZeroEngine(model, ctx.world, 3, algo="ring")
    h, log = engine.stage3, []
    prefetch, acquire, release = h._prefetch, h._acquire, h._release

    def logged_prefetch(i, backward):
        log.append(f"+{i}") if i not in h.work else None
        prefetch(i, backward)

    def logged_acquire(i, backward):
        if i not in h.gathered:
            h._prefetch(i, backward)
            log.append(f"={i}")
        acquire(i, backward)

    def logged_release(i):
        log.append(f"-{i}")
        release(i)

    def logged_reduce(i, reduce=engine._reduce_unit):
        log.append(f"RS{i}")
        reduce(i)

    h._prefetch, h._acquire, h._release = logged_prefetch, logged_acquire, logged_release
    engine._reduce_unit = logged_reduce
    idx = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 8))
    phases = []
    for m in range(M):
        with engine.no_sync() if m < M - 1 else contextlib.nullcontext():
            _, loss = engine.forward(idx, idx, n_tokens=16 * M)
            phases.append(("forward", list(log)))
            log.clear()
            loss.backward()
            phases.append(("backward", list(log)))
            log.clear()
    return phases, engine.memory()


FORWARD = ["+0", "=0", "+1", "=1", "+2", "-1", "=2", "-2", "-0"]          # root: embed..head
BACKWARD = ["+0", "=0", "+2", "=2", "+1", "RS2", "-2", "=1", "RS1", "-1", "RS0", "-0"]


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [1, 2])
def test_units_are_freed_after_their_last_use_in_each_pass(W):
    phases, _ = spawn(W, _trace_one_step, 1)[0]
    assert phases == [("forward", FORWARD), ("backward", BACKWARD)]


@pytest.mark.multiproc
def test_accumulation_reduces_only_on_the_last_micro_batch():
    phases, memory = spawn(2, _trace_one_step, 2)[0]
    no_rs = [e for e in BACKWARD if not e.startswith("RS")]
    assert phases == [("forward", FORWARD), ("backward", no_rs),
                      ("forward", FORWARD), ("backward", BACKWARD)]
    assert memory["peak_gathered_params"] > 0


def _buffers_alive_after_forward(ctx):
    """(gathered buffers alive after the forward, gathers in it; the same for the
    backward, while the loss and its graph are still held): unpin and the backward must
    let every gather go."""
    import gc
    import weakref
    model = GPT(TINY)
    engine = ZeroEngine(model, ctx.world, 3, algo="ring")
    h, refs = engine.stage3, []
    acquire = h._acquire

    def watched_acquire(i, backward):
        new = i not in h.gathered
        acquire(i, backward)
        if new:
            refs.append(weakref.ref(h.buffers[i]))

    h._acquire = watched_acquire
    idx = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 8))
    _, loss = engine.forward(idx, idx, n_tokens=16)
    gc.collect()
    alive, gathers = sum(r() is not None for r in refs), len(refs)
    loss.backward()                           # gathers again, and lets go of those too
    gc.collect()
    return alive, gathers, sum(r() is not None for r in refs[gathers:]), len(refs) - gathers


@pytest.mark.multiproc
def test_no_gathered_parameters_stay_alive_after_forward_or_backward():
    """Each call's graph is kept for the backward, yet once its unit is freed nothing holds
    the gathered buffer: the views its nodes saved (W of each matmul, LayerNorm's w, the
    tied head's W^T) were cut out (unpin). Without it, all 3 gathers would still be alive.
    The backward's gathers go too once each call's backward is done, though the loss (and
    the calls' nodes) are still held."""
    alive, gathers, alive_b, gathers_b = spawn(2, _buffers_alive_after_forward)[0]
    assert (gathers, alive) == (3, 0) and (gathers_b, alive_b) == (3, 0)


def _two_aux_are_refused(ctx):
    engine = ZeroEngine(GPT(TINY), ctx.world, 3)
    one = Tensor(np.array(1.0))
    engine.stage3.points[1].original = lambda x, key=None: (x, one, one)
    try:
        engine.forward(np.zeros((1, 8), np.int64), np.zeros((1, 8), np.int64))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiproc
def test_a_block_returning_more_than_one_auxiliary_output_is_refused():
    # one scalar aux (a MoE block's losses) travels packed with y; two cannot
    assert "more than a Tensor and one scalar auxiliary" in spawn(1, _two_aux_are_refused)[0]


def test_every_unit_needs_a_hook_point():
    model = GPT(TINY)
    group = SimpleNamespace(rank=0, size=2, supports_shared=True, name="dp")
    points = [(model, "embed"), (model.blocks[0], "forward"), (model, "head")]
    with pytest.raises(ValueError, match=r"no hook point reads unit\(s\) \['blocks.1'\]"):
        ZeroEngine(model, group, 3, hook_points=points)


def test_hook_points_need_embed_blocks_head():
    class NoBlocks:
        pass

    with pytest.raises(ValueError, match="no embed / blocks / head"):
        stage3.gpt_hook_points(NoBlocks())


@pytest.mark.multiproc
# default: with sequence parallelism (ZeRO-3 x tp x sp, the larger composition)
@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True])
def test_zero3_with_tensor_parallelism_matches_single_process(sp):
    """dp=2 x tp=2: the blocks' tp collectives inside a ZeRO-3 call, forward and backward."""
    ref = train_single_process(TINY, DATA, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                               seed=0)
    plan = Plan(dp=2, tp=2, zero=3, sequence_parallel=sp, check_placements=True)
    runs = spawn(4, train_on_rank, TINY, DATA, plan,
                 RunConfig(steps=STEPS, global_batch=GLOBAL_BATCH, seed=0), OptimizerConfig(lr=LR))
    for rank, run in enumerate(runs):
        what = f"tp=2 sp={sp} rank {rank}"
        assert_close(run.losses, ref.losses, atol=1e-12, what=f"{what}: losses")
        assert_close(run.grad_norms, ref.grad_norms, atol=1e-12, what=f"{what}: norms")
        for name, p in ref.params.items():
            assert_close(run.params[name], p, atol=1e-12, what=f"{what}: {name}")
        for key, value in ref.optimizer_state.items():
            assert_close(run.optimizer_state[key], value, atol=1e-12, what=f"{what}: {key}")
