"""Mixed-precision training end to end: fp32 changes nothing, bf16 / fp16 / fp8 train as
well as fp32 on the synthetic task, dp=2 and ZeRO 1-3 compute what one process computes
(bitwise where the design allows it, within the format's rounding where it does not),
hold ZeRO's 2Ψ + 2Ψ + 12Ψ bytes, and an inf on one rank skips the step on every rank.

The default run trains bf16 (grads low) against fp32 for N steps, and takes one case of
each dp=2 / ZeRO / overflow sweep; `-m slow` adds fp16, fp8, bf16 with fp32 grads and the
other cases."""

import functools

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel.zero.flat import split_units
from minidist.parallel.zero.memory import exact_bytes, formula_bytes
from minidist.runtime.launch import spawn
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank

pytestmark = pytest.mark.multiproc
DATA = DataConfig(task="sort", length=6, seed=0)
CFG = model_config_for(DATA, n_layer=2, n_head=4, n_embd=32, dtype="float32")
B, LR, N, LAST = 16, 3e-3, 100, 10          # batch, lr, steps, steps averaged at the end


@functools.lru_cache(maxsize=None)
def _run(W: int = 1, zero: int = 0, precision: str = "fp32", reduce: str = "fp32",
         steps: int = N):
    plan = Plan(dp=W, zero=zero, precision=precision, grad_reduce=reduce)
    return spawn(W, train_on_rank, CFG, DATA, plan, RunConfig(steps=steps, global_batch=B, seed=0),
                 OptimizerConfig(lr=LR))


def _same_params(a, b) -> bool:
    return all(np.array_equal(a.params[k], b.params[k]) for k in a.params)


def test_fp32_policy_is_bitwise_the_plain_single_process_run():
    ref = train_single_process(CFG, DATA, steps=5, global_batch=B, lr=LR, seed=0)
    run = _run(precision="fp32", steps=5)[0]
    assert run.losses == ref.losses and _same_params(run, ref)


@pytest.mark.parametrize("precision,reduce,tol", [       # ~3 s each: bf16 by default
    ("bf16", "low", 0.05), pytest.param("bf16", "fp32", 0.05, marks=pytest.mark.slow),
    pytest.param("fp16", "low", 0.05, marks=pytest.mark.slow),
    pytest.param("fp8", "low", 0.08, marks=pytest.mark.slow)])
def test_low_precision_training_reaches_the_fp32_loss(precision, reduce, tol):
    """After N = 100 steps (loss 2.38 -> 0.65 in fp32), the mean loss of the last 10 steps
    lies within `tol` of fp32's loss DROP of it. Measured on 8 data seeds (0-7): the worst
    |Δ| / drop was 1.5 % (bf16, grads low), 0.8 % (bf16, fp32), 1.2 % (fp16) and 2.6 %
    (fp8); the tolerance leaves ~3x room. A run whose updates vanish or whose gradients
    are wrongly scaled moves the loss by a large fraction of the drop, not a few %."""
    ref, run = _run()[0], _run(precision=precision, reduce=reduce)[0]
    end_ref, end = np.mean(ref.losses[-LAST:]), np.mean(run.losses[-LAST:])
    drop = ref.losses[0] - end_ref
    assert drop > 1.5
    assert abs(end - end_ref) <= tol * drop, \
        f"{precision}: loss {end:.4f} vs fp32 {end_ref:.4f} ({(end - end_ref) / drop:+.1%} " \
        f"of the drop {drop:.3f}, allowed {tol:.0%})"
    assert abs(run.losses[0] - ref.losses[0]) < 2e-3 * ref.losses[0]   # one rounding apart


@pytest.mark.parametrize("precision,reduce", [("bf16", "low"),
                                              pytest.param("fp16", "low", marks=pytest.mark.slow),
                                              pytest.param("bf16", "fp32", marks=pytest.mark.slow)])
def test_dp2_equals_single_process_within_the_formats_rounding(precision, reduce):
    """Not bitwise: one process rounds each gradient GEMM's output over the whole batch
    once; under dp=2 each rank rounds its half, then the halves are summed (in the format
    under grad_reduce "low"). Each element is then within ~2 roundings, u = 2^-(m+1) each,
    so the step-0 gradient norm agrees to 2u = 2^-m (measured: 5e-5 bf16, 1e-5 fp16). The
    step-0 loss is the same numbers summed in another order (fp32: ~1e-7). Over 6 steps
    the curves stay within 1e-3 (measured <= 2e-4). The replicas are bitwise equal."""
    one, two = _run(precision=precision, reduce=reduce, steps=6)[0], \
        _run(2, precision=precision, reduce=reduce, steps=6)
    m = {"bf16": 7, "fp16": 10}[precision]
    assert abs(one.losses[0] - two[0].losses[0]) <= 1e-6
    assert abs(one.grad_norms[0] - two[0].grad_norms[0]) <= 2.0 ** -m * one.grad_norms[0]
    assert max(abs(x - y) for x, y in zip(one.losses, two[0].losses)) <= 1e-3
    assert _same_params(two[0], two[1]) and two[0].losses == two[1].losses


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 1]   # 1: bitwise
                         + [pytest.param(s, marks=pytest.mark.slow) for s in (2, 3)])
def test_zero_holds_2psi_2psi_12psi_and_computes_what_ddp_does(stage):
    """grad_reduce "low", AdamW: model copy and gradients in 2 bytes, master + m + v in
    4 + 4 + 4 (K = 12), exactly minidist's layout (exact_bytes with 2-byte elements and 6
    two-byte state arrays per element), and the paper's formula up to the padding. ZeRO-1
    and -2 sum the same bf16 partials in the same rank order as DDP: bitwise. ZeRO-3
    backpropagates each block on its own graph whose input is a leaf, and a leaf's
    gradient is stored in its dtype: the activation gradient crossing a block boundary is
    rounded to bf16 there (DDP keeps it in fp32): close, not bitwise (next test)."""
    runs = _run(2, stage, "bf16", "low", steps=4)
    numels = [u.numel for u in split_units(GPT(CFG, seed=None), 2)]
    assert runs[0].memory == exact_bytes(stage, numels, 2, itemsize=2, state_arrays=6)
    paper = formula_bytes(stage, sum(numels), 2, param_bytes=2, grad_bytes=2, k=12)
    pad = 16 * len(numels)                  # < 1 element of padding per unit and rank
    for key in ("params", "grads", "optimizer"):
        assert abs(runs[0].memory[key] - paper[key]) <= pad, key
    ddp = _run(2, 0, "bf16", "low", steps=4)[0]
    if stage in (1, 2):
        assert runs[0].losses == ddp.losses and _same_params(runs[0], ddp)
    assert max(abs(x - y) for x, y in zip(runs[0].losses, ddp.losses)) <= 1e-3
    assert _same_params(runs[0], runs[1])


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp8", marks=pytest.mark.slow)])
def test_zero3_keeps_its_blocks_rounded_copies_and_equals_ddp(precision):
    """Under autocast a block's GEMMs save rounded (fp8: quantised) copies of W, not views
    of the gathered buffer: ZeRO-3's graphs keep those copies (unpin leaves them), and each
    GEMM is quantised once, in the forward. With grad_reduce "fp32" (block inputs are fp32
    arrays, so nothing is rounded at block boundaries) ZeRO-3 is bitwise DDP."""
    z3 = _run(2, 3, precision, "fp32", steps=4)[0]
    ddp = _run(2, 0, precision, "fp32", steps=4)[0]
    assert z3.losses == ddp.losses and _same_params(z3, ddp)


def test_grad_reduce_low_sends_half_the_bytes_of_fp32():
    low, wide = _run(2, 0, "bf16", "low", steps=4)[0], _run(2, 0, "bf16", "fp32", steps=4)[0]
    for a, b in zip(low.bytes_by_axis, wide.bytes_by_axis):
        assert 2 * a["dp"] == b["dp"] > 0                     # 2 bytes vs 4 per element
    assert 2 * low.memory["grads"] == wide.memory["grads"]


AT = 2                                       # the step whose gradient gets an inf


class _InfIntoRank0sShard:
    """A stand-in for spike.Guard (train_on_rank calls guard.step in place of engine.step):
    on rank 1 at step AT it writes one inf into its local ZeRO-1 gradient, at an element
    whose reduced value only RANK 0 holds. Rank 1's own shard stays finite, so only the
    all-reduced flag can tell rank 1 to skip."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def step(self, step, engine, lr, clip_grad, loss, again):
        if self.rank == 1 and step == AT:
            inner = engine.inner                              # the ZeroEngine
            lo, _ = inner.units[0].shard_range(0)
            inner.g_acc[0][lo] = np.inf
        return (engine.step(lr, clip_grad),)


def _overflow_on_rank_1(ctx, zero: int):
    """fp16 dp=2; rank 1's step AT overflows (ZeRO-1: an inf in one gradient element;
    DDP: its loss x 1e30, so its backward's fp16 GEMMs overflow). Returns this rank's
    (result, per step: (scale used, stepped), scale after, params, Adam's t)."""
    seen = []

    def end(s):
        e = s.engine
        seen.append((e.scaler.history[-1], e.scaler.scale, e.full_params(),
                     e.full_optimizer_state()["step"]))
        if zero == 0 and ctx.rank == 1 and s.step in (AT - 1, AT):
            if s.step == AT - 1:
                loss = e.model.loss
                e.model.loss = lambda *a, **k: loss(*a, **k) * 1e30
            else:
                del e.model.loss
    plan = Plan(dp=2, zero=zero, precision="fp16", grad_reduce="low")
    result = train_on_rank(ctx, CFG, DATA, plan, RunConfig(steps=AT + 2, global_batch=B, seed=0),
                           OptimizerConfig(lr=LR), hooks=[OnStepEnd(end)],
                           guard=_InfIntoRank0sShard(ctx.rank) if zero else None)
    return result, seen


# default: ZeRO-1, where only the all-reduced flag tells rank 1 to skip
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_an_inf_on_one_rank_skips_the_step_and_halves_the_scale_on_every_rank(zero):
    (r0, seen0), (r1, seen1) = spawn(2, _overflow_on_rank_1, zero)
    for rank, seen in enumerate((seen0, seen1)):
        scales = [(used, stepped) for (used, stepped), *_ in seen]
        assert scales == [(65536.0, True)] * AT + [(65536.0, False), (32768.0, True)], rank
        assert seen[AT][1] == 32768.0
        before, skipped, after = (seen[s][2] for s in (AT - 1, AT, AT + 1))
        assert all(np.array_equal(before[k], skipped[k]) for k in before), rank   # no update
        assert not all(np.array_equal(skipped[k], after[k]) for k in skipped), rank
        assert [t for *_, t in seen] == [1, 2, 2, 3]          # Adam's t skipped one step
    assert all(np.isfinite(v).all() for v in r0.params.values())
    assert _same_params(r0, r1) and r0.losses == r1.losses


def test_train_cli_runs_bf16_on_dp2_zero1(capsys):
    from minidist.train_cli import main
    rc = main(["--precision", "bf16", "--grad-reduce", "low", "--dp", "2", "--zero", "1",
               "--steps", "3", "--batch", "8", "--run-dir", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "dp=2 x tp=1, bf16 (grads low), ZeRO-1" in out
    assert "params sha256:" in out
