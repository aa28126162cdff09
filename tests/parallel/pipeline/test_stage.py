"""Pipeline parallelism must be invisible in the numbers: every schedule (GPipe, 1F1B,
interleaved 1F1B, ZB-H1), every stage count and micro-batch count, uneven layer splits and
the tied embedding train exactly like one process (float64, 3 AdamW steps with clipping
and dropout); a dead or hung stage is named, and nothing leaks.

The default run trains each schedule once (2 stages) and the tied embedding on 3 stages;
`-m slow` runs the whole P x M x schedule sweep, the explicit / one-layer splits and the
hung-stage timeout (it waits out a 3 s timeout, so a loaded machine can trip it early)."""

import functools
import os

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.parallel import micro_batching
from minidist.parallel.pipeline import family, schedules
from minidist.parallel.pipeline.schedule_validate import ScheduleError
from minidist.parallel.pipeline.stage import PipelineCut, split_layers
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_runs_match

DATA = DataConfig(task="sort", length=6, seed=2)            # T = 12
STEPS, LR, CLIP = 3, 1e-2, 0.05


def _cfg(n_layer: int, tie: bool = True, n_head: int = 2, n_embd: int = 16):
    return model_config_for(DATA, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                            dropout=0.1, tie_weights=tie)


@functools.lru_cache(maxsize=None)
def _reference(n_layer: int, M: int, batch: int, tie: bool = True, n_head: int = 2):
    return train_single_process(_cfg(n_layer, tie, n_head), DATA, steps=STEPS,
                                global_batch=batch, lr=LR, grad_accum=M, clip_grad=CLIP,
                                weight_decay=0.01)


def _run(plan: Plan, n_layer: int, tie: bool = True, n_head: int = 2, what: str = ""):
    batch = plan.dp * plan.micro_batches * 2
    runs = spawn(plan.world_size, train_on_rank, _cfg(n_layer, tie, n_head), DATA, plan,
                 RunConfig(steps=STEPS, global_batch=batch),
                 OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=CLIP))
    ref = _reference(n_layer, plan.micro_batches, batch, tie, n_head)
    assert max(ref.grad_norms) > CLIP                         # clipping really happened
    assert_runs_match(runs, ref, what or plan.describe())
    return runs


SWEEP = [(P, M, name) for P in (2, 3, 4) for name in family.SCHEDULES
         for M in sorted({1, P, 2 * P, 2 * P + 1, 2 * P + 2})
         if family.runs_on(name, P, M) and (M != 2 * P + 2 or name.startswith("dualpipe"))
         and (M != 2 * P or name.startswith("dualpipe"))]
# Default run: each schedule once on 2 stages (the cheapest), 1F1B and ZB-H1 with M > P so
# they reach their steady state; 3 stages (a middle stage) run in
# test_tied_embedding_copies_stay_bitwise_equal[3]. The rest of the sweep is slow.
DEFAULT = {(2, 1, "gpipe"), (2, 5, "1f1b"), (2, 2, "interleaved"), (2, 5, "zb-h1"),
           (2, 5, "zb-2p"), (2, 5, "zbv"), (2, 4, "dualpipe"), (2, 4, "dualpipev"),
           (2, 5, "v-min")}
CASES = [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in SWEEP]


@pytest.mark.multiproc
@pytest.mark.parametrize("P, M, name", CASES)
def test_every_schedule_matches_the_single_process(P, M, name):
    # interleaved, zbv: 2 chunks of one layer per stage; else P + 1 layers, split unevenly
    n_layer = family.pieces(name, P) if family.chunks_of(name) == 2 else P + 1
    _run(Plan(pp=P, micro_batches=M, schedule=name), n_layer)


@pytest.mark.slow       # slow: untied head in test_tensor_parallel, splits in test_split_layers
@pytest.mark.multiproc
def test_untied_head_and_explicit_uneven_layers():
    _run(Plan(pp=2, micro_batches=3, layers_per_stage=(1, 4)), 5, tie=False)
    _run(Plan(pp=3, micro_batches=3, schedule="zb-h1", layers_per_stage=(2, 1, 2)), 5)


@pytest.mark.slow       # by default test_tied_embedding_copies_stay_bitwise_equal[3]: 3 on pp=3
@pytest.mark.multiproc
def test_one_layer_per_stage():
    # Megatron-LM #2418: num_layers == pp broke the all-reduce of the tied embedding
    _run(Plan(pp=4, micro_batches=4), 4)


def _tied_copies(ctx, plan, cfg):
    """Train, and return wte on the first and the last stage after every step."""
    from minidist.parallel.compose import build
    from minidist.parallel.micro_batching import micro_batches
    from minidist.data import SyntheticData
    lay = build(ctx, plan, cfg, 0, optimizer="adamw", lr=LR, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=0.0)
    data, out = SyntheticData(DATA), []
    for step in range(3):
        batches, n = micro_batches(data, step, 8, 1, 0, plan.micro_batches, 0)
        lay.pipeline.step(lay.engine, batches, n)
        lay.engine.step(LR, None)
        if hasattr(lay.model, "wte"):
            out.append(lay.model.wte.weight.data.copy())
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("P", [pytest.param(2, marks=pytest.mark.slow), 3])  # 3: a middle stage
def test_tied_embedding_copies_stay_bitwise_equal(P):
    got = spawn(P, _tied_copies, Plan(pp=P, micro_batches=4), _cfg(P))
    first, last = got[0], got[-1]
    assert len(first) == len(last) == 3 and all(got[s] == [] for s in range(1, P - 1))
    for step, (a, b) in enumerate(zip(first, last)):
        assert np.array_equal(a, b), f"step {step}: wte drifted between first and last stage"
    assert not np.array_equal(first[0], first[-1])             # it did train


def _mirrored_params(ctx, plan, cfg):
    """Train 3 steps; return this stage's parameters by name."""
    from minidist.parallel.compose import build
    from minidist.parallel.micro_batching import micro_batches
    from minidist.data import SyntheticData
    lay = build(ctx, plan, cfg, 0, optimizer="adamw", lr=LR, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=0.0)
    data = SyntheticData(DATA)
    for step in range(3):
        batches, n = micro_batches(data, step, 8, plan.dp, lay.dp_group.rank,
                                   plan.micro_batches, 0)
        lay.pipeline.step(lay.engine, batches, n)
        lay.engine.step(LR, None)
    return {name: p.data.copy() for name, p in lay.model.named_parameters()}


@pytest.mark.multiproc
@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dualpipe_s_mirrored_copies_stay_bitwise_equal(P):
    """Stage s and P-1-s hold the same pieces and see different micro-batches; their
    gradients are summed before the update, so the copies never drift apart."""
    got = spawn(P, _mirrored_params, Plan(pp=P, micro_batches=2 * P, schedule="dualpipe"),
                _cfg(P))
    for s in range(P // 2):
        a, b = got[s], got[P - 1 - s]
        assert sorted(a) == sorted(b) and "wte.weight" in got[0]
        for name in a:
            assert np.array_equal(a[name], b[name]), f"{name} differs between stage {s} " \
                f"and its mirror {P - 1 - s}"


COMPOSED = [(2, 2, 1, "dualpipe"), (2, 2, 2, "zbv"), (2, 1, 2, "dualpipev"),
            (4, 2, 1, "dualpipe"), (4, 1, 2, "zb-2p")]


@pytest.mark.multiproc
@pytest.mark.parametrize("P, dp, tp, name", [
    c if c == COMPOSED[0] else pytest.param(*c, marks=pytest.mark.slow) for c in COMPOSED])
def test_new_schedules_compose_with_dp_and_tp(P, dp, tp, name):
    """The smallest M each allows (DualPipe: 2P), with the dp and tp groups around it."""
    M = 2 * P if name.startswith("dualpipe") else P
    _run(Plan(pp=P, dp=dp, tp=tp, micro_batches=M, schedule=name),
         family.pieces(name, P), n_head=2 * tp if tp > 1 else 2)


def _launched_during_schedule(ctx, plan, cfg):
    """One step of pp x dp; at the schedule's end (before the tied wte's sum): how many of
    the engine's all-reduces had started, of how many, and whether wte's had."""
    from minidist.parallel.compose import build
    from minidist.parallel.micro_batching import micro_batches
    from minidist.data import SyntheticData
    lay = build(ctx, plan, cfg, 0, optimizer="adamw", lr=LR, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=0.0)
    engine, stage, seen = lay.engine, lay.pipeline, []
    finish = stage.finish

    def noted_finish():
        if plan.buckets:
            wte = engine._bucket_of[id(lay.model.wte.weight)].index
            seen.append((engine._next, len(engine.buckets), wte < engine._next))
        else:
            wte = engine._position[id(lay.model.wte.weight)]
            seen.append((len(engine._works), len(engine.order), wte < len(engine._works)))
        return finish()

    stage.finish = noted_finish
    batches, n = micro_batches(SyntheticData(DATA), 0, 8, plan.dp, lay.dp_group.rank,
                               plan.micro_batches, 0)
    stage.step(engine, batches, n)
    engine.step(LR, None)
    return seen[0]


@pytest.mark.multiproc
@pytest.mark.parametrize("buckets", [True, False], ids=["buckets", "per-parameter"])
def test_the_dp_reduction_starts_in_each_chunk_s_last_backward_and_wte_waits(buckets):
    """pp=2 x dp=2 under 1F1B, small buckets: when the schedule ends, every stage has
    started some of its dp all-reduces (its last backward's), but not the tied wte's, whose
    two shares are summed first."""
    plan = Plan(dp=2, pp=2, micro_batches=4, bucket_bytes=1024, buckets=buckets)
    for started, total, wte_started in spawn(4, _launched_during_schedule, plan, _cfg(2)):
        assert 0 < started < total and not wte_started, (started, total, wte_started)


def test_split_layers_even_uneven_and_explicit():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert split_layers(5, 2, (1, 4)) == [range(0, 1), range(1, 5)]
    for bad in [(2, 2), (5,), (0, 5)]:
        with pytest.raises(ValueError, match="layers_per_stage"):
            split_layers(5, 2, bad)
    with pytest.raises(ValueError, match="need at least 4 layers"):
        split_layers(3, 4)


def test_a_stage_holds_its_layers_and_the_tied_embedding():
    pieces = tuple(split_layers(4, 4))
    first, last = PipelineCut(0, 2, pieces), PipelineCut(1, 2, pieces)
    assert [list(first.layers(c)) for c in range(2)] == [[0], [2]]    # interleaved, V = 2
    assert first.holds("wte.weight", True) and last.holds("wte.weight", True)
    assert not last.holds("wte.weight", False) and not last.holds("wpe.weight", True)
    assert last.holds("ln_f.bias", True) and last.holds("blocks.3.mlp.fc.weight", True)


@pytest.mark.parametrize("plan, match", [
    (Plan(pp=2, micro_batches=2, zero=3), "ZeRO-3 with pipeline parallelism is refused"),
    (Plan(pp=4, micro_batches=2, schedule="interleaved"), "need at least 8 layers"),
    (Plan(pp=2, micro_batches=2, layers_per_stage=(3,)), "layers_per_stage"),
])
def test_pipeline_plans_that_cannot_run_fail_before_any_process_starts(plan, match):
    with pytest.raises(ValueError, match=match):
        plan.validate(_cfg(3), 8, DATA.block_size)


def test_a_schedule_for_other_sizes_is_refused():
    other = schedules.one_f_one_b(3, 2)
    with pytest.raises(ValueError, match="P=3 stages"):
        Plan(pp=2, micro_batches=2, schedule=other).validate(_cfg(3), 8, DATA.block_size)


def _swap_first_forwards(s):
    """1F1B for P=2 with stage 1 running F1 before F0: a channel-order mismatch."""
    a = list(s.actions)
    one = list(a[1])
    i, j = one.index(schedules.Action("F", 0)), one.index(schedules.Action("F", 1))
    one[i], one[j] = one[j], one[i]
    a[1] = tuple(one)
    return schedules.PipelineSchedule("swapped", s.stages, s.micro_batches, tuple(a))


def test_a_schedule_with_messages_out_of_order_is_refused_before_running():
    bad = _swap_first_forwards(schedules.gpipe(2, 2))
    with pytest.raises(ScheduleError):
        Plan(pp=2, micro_batches=2, schedule=bad).validate(_cfg(2), 8, DATA.block_size)


def _unvalidated(ctx, schedule):
    """Run a schedule on the ranks WITHOUT the validator: the transport must still catch
    a message of another micro-batch (DeepSpeed #5729)."""
    from minidist.parallel import compose
    plan = Plan(pp=2, micro_batches=2)
    lay = compose.build(ctx, plan, _cfg(2), 0, optimizer="adamw", lr=LR, weight_decay=0.0,
                        betas=(0.9, 0.999), momentum=0.0)
    lay.pipeline.schedule = schedule
    from minidist.data import SyntheticData
    batches, n = micro_batching.micro_batches(SyntheticData(DATA), 0, 4, 1, 0, 2, 0)
    lay.pipeline.step(lay.engine, batches, n)


@pytest.mark.multiproc
def test_a_message_of_another_micro_batch_is_a_named_mismatch():
    bad = _swap_first_forwards(schedules.gpipe(2, 2))
    with pytest.raises(RankFailure, match=r"recv #1 on 'pp0.act0>1'.*tag 1.*tag 0|"
                                          r"tag 0.*tag 1") as e:
        spawn(2, _unvalidated, bad)
    assert "CollectiveMismatch" in str(e.value)


def _stage_fails(ctx, how):
    plan = Plan(pp=2, micro_batches=2)
    if ctx.rank == 1:
        from minidist.parallel.pipeline import stage as pipeline
        original = pipeline.PipelineStage._forward

        def forward(self, a):
            if a.micro_batch == 1:
                if how == "die":
                    os._exit(3)
                import time
                time.sleep(60)
            return original(self, a)
        pipeline.PipelineStage._forward = forward
    train_on_rank(ctx, _cfg(2), DATA, plan, RunConfig(steps=1, global_batch=4),
                  OptimizerConfig(lr=LR))


@pytest.mark.multiproc
def test_a_stage_killed_mid_schedule_is_a_named_rank_failure():
    with pytest.raises(RankFailure, match=r"rank 1"):
        spawn(2, _stage_fails, "die")


@pytest.mark.slow       # timing: a 3 s MINIDIST_TIMEOUT that a loaded machine can trip early
@pytest.mark.multiproc
def test_a_hung_stage_is_a_timeout_naming_the_pending_receive(monkeypatch):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "3")
    with pytest.raises(RankFailure) as e:
        spawn(2, _stage_fails, "hang")
    text = str(e.value)
    assert "CollectiveTimeout" in text and "recv" in text and "pp0.grad1>0" in text
    assert "flight recorder" in text
