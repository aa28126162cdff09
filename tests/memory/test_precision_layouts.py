"""Mixed precision on every layout: tp (with and without SP), pp, cp and ep run under the same
policy as the single process and pass `train --check` against it (baseline.py's
`precision`); an inf in one rank's gradients (one pipeline stage, one tp or cp shard, one
expert rank) skips the step on every rank and halves the scale; the pipeline scales its
loss as forward() would (fp16); the sequence-parallel matmul rounds as MatMul does."""

import numpy as np
import pytest

from minidist import train_check, train_cli
from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.memory import loss_scale
from minidist.runtime.launch import spawn
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank

pytestmark = pytest.mark.multiproc
DATA = DataConfig(task="sort", length=4, seed=0)
CFG = model_config_for(DATA, n_layer=2, n_head=4, n_embd=32, dtype="float32")
MOE = model_config_for(DATA, n_layer=2, n_head=4, n_embd=32, dtype="float32", moe_every=1,
                       n_experts=4, top_k=2)
B, LR, AT = 16, 3e-3, 1                      # AT: the step whose gradient gets an inf


def _overflow_on_last_rank(ctx, plan: Plan, cfg):
    """fp16 on `plan`; the last rank writes an inf into its first gradient at step AT, after
    the reduction, just before the flag is taken (loss_scale.has_inf_or_nan). Returns this
    rank's per-step (scale used, stepped) and its params after each step."""
    seen, step = [], [0]
    original = loss_scale.has_inf_or_nan

    def check(arrays):
        arrays = [a for a in arrays if a is not None and a.size]
        if ctx.rank == ctx.world_size - 1 and step[0] == AT:
            arrays[0].reshape(-1)[0] = np.inf
        return original(arrays)
    loss_scale.has_inf_or_nan = check

    def end(s):
        seen.append((s.engine.scaler.history[-1], s.engine.full_params()))
        step[0] += 1
    train_on_rank(ctx, cfg, DATA, plan, RunConfig(steps=AT + 2, global_batch=B, seed=0),
                  OptimizerConfig(lr=LR), hooks=[OnStepEnd(end)])
    return seen


@pytest.mark.parametrize("fields, cfg", [
    (dict(pp=2), CFG), (dict(tp=2), CFG), (dict(cp=2), CFG), (dict(dp=2, ep=2), MOE)],
    ids=["pp", "tp", "cp", "ep"])
def test_an_inf_on_one_rank_skips_the_step_and_halves_the_scale_everywhere(fields, cfg):
    plan = Plan(**fields, precision="fp16")
    runs = spawn(plan.world_size, _overflow_on_last_rank, plan, cfg)
    for rank, seen in enumerate(runs):
        scales = [history for history, _ in seen]
        assert scales == [(65536.0, True)] * AT + [(65536.0, False), (32768.0, True)], rank
        before, skipped, after = (seen[s][1] for s in (AT - 1, AT, AT + 1))
        assert all(np.array_equal(before[k], skipped[k]) for k in before), rank  # no update
        assert not all(np.array_equal(skipped[k], after[k]) for k in skipped), rank
        assert all(np.isfinite(v).all() for v in after.values()), rank


def _first_loss(ctx, plan: Plan):
    r = train_on_rank(ctx, CFG, DATA, plan, RunConfig(steps=2, global_batch=B, seed=0),
                      OptimizerConfig(lr=LR))
    return r.losses


def test_the_pipeline_scales_its_loss_under_fp16_and_runs_under_autocast():
    """pp = 2 under bf16 and fp16 computes the single process's numbers bit for bit: the
    stages run their GEMMs rounded (autocast on without forward()) and seed the backward
    with S (engine.loss_seed()); without either the second loss would differ."""
    for precision in ("bf16", "fp16"):
        ref = train_single_process(CFG, DATA, steps=2, global_batch=B, lr=LR, seed=0,
                                   grad_accum=4, precision=precision)
        losses = spawn(2, _first_loss, Plan(pp=2, micro_batches=4, precision=precision))[-1]
        assert losses == ref.losses, precision


def test_the_sequence_parallel_matmul_rounds_as_matmul_does():
    """Under fp8 the SP all-gather matmul quantises its operands as MatMul does: the first
    loss of tp = 2 with SP equals tp = 2 without (the same GEMMs, the same scales)."""
    sp = spawn(2, _first_loss, Plan(tp=2, sequence_parallel=True, precision="fp8"))[0]
    plain = spawn(2, _first_loss, Plan(tp=2, precision="fp8"))[0]
    ref = train_single_process(CFG, DATA, steps=1, global_batch=B, lr=LR, seed=0,
                               precision="fp8").losses[0]
    assert sp[0] == plain[0]
    assert abs(sp[0] - ref) < 1e-3 * ref


@pytest.mark.parametrize("argv", [
    ["--precision", "bf16", "--tp", "2", "--pp", "2"],
    pytest.param(["--precision", "fp16", "--cp", "2", "--dp", "2"], marks=pytest.mark.slow),
    pytest.param(["--precision", "fp8", "--dp", "2", "--zero", "3"], marks=pytest.mark.slow),
    pytest.param(["--precision", "fp8", "--fp8-recipe", "blockwise", "--moe-every", "1",
                  "--ep", "2"], marks=pytest.mark.slow),
    pytest.param(["--precision", "bf16", "--tp", "2", "--sp"], marks=pytest.mark.slow),
    pytest.param(["--precision", "fp16", "--dp", "2", "--ep", "2", "--moe-every", "1"],
                 marks=pytest.mark.slow),
], ids=lambda argv: " ".join(argv))
def test_layouts_under_reduced_precision_pass_the_check(argv, capsys):
    assert train_cli.main(argv + ["--check", "--steps", "30", "--run-dir", "none"]) == 0
    out = capsys.readouterr().out
    assert "\nOK: " in out and "under the same policy" in out, out


def test_the_first_step_budget_is_stated_by_format_and_layout():
    cfg = model_config_for(DATA, n_layer=2, dtype="float32")
    assert train_check.rounding_budget(Plan(precision="bf16"), cfg) == (12 + 1 + 4) / 256
    assert train_check.rounding_budget(Plan(tp=2, precision="fp16"), cfg) == (13 + 8) / 2048
