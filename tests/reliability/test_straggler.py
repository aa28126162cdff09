"""Stragglers (reliability/straggler.py): the detector's rule on synthetic timings, the
rebalancer's partition, uneven micro-batches giving the even gradient, and runs with an
injected slow rank (`slow` in reliability/faults.py) through train_on_rank and the CLI.

The runs with an injected slow rank are in the slow set: whether a rank is named (and rows
move) follows measured compute times, which a loaded machine changes. By default the
detector and the rebalancer run on synthetic timings, and the uneven-rows runs on dp, ZeRO-1
and dp x pp (tp's case is in the slow set)."""

from __future__ import annotations

import re
from argparse import Namespace

import numpy as np
import pytest

from minidist import train_cli
from minidist.baseline import train_single_process
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.nn import GPT
from minidist.parallel import micro_batching
from minidist.reliability import faults
from minidist.reliability.straggler import (EVERY, FACTOR, PATIENCE, Balancer, Detector,
                                            Straggler, for_rank, partition)
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_close

DATA = DataConfig(task="sort", seed=3)
CFG = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16, dropout=0.1)   # float64
B, LR = 16, 1e-2


# --- the detector: rank r is slow when compute_r > F x median(others), named after K ---

def test_the_detector_names_the_slow_rank_after_k_steps_and_not_before():
    d = Detector()
    step = [0.017, 0.017, 0.041, 0.017]                    # rank 2 at 2.4x
    assert (FACTOR, PATIENCE) == (1.5, 3)
    assert d.observe(step) == [] and d.observe(step) == []
    assert d.observe(step) == ["straggler: rank 2 computes 2.4x the median for 3 steps "
                               "(compute 41 ms vs 17 ms)"]
    assert d.observe(step) == []                           # named once per episode
    d.observe([0.017] * 4)                                 # recovered: the count restarts
    assert [d.observe(step) for _ in range(3)][-1][0].startswith("straggler: rank 2 ")


def test_an_interrupted_streak_a_single_rank_and_noise_within_f_name_nobody():
    d = Detector()
    for t in ([1, 1, 2], [1, 1, 2], [1, 1, 1], [1, 1, 2], [1, 1, 2]):
        assert d.observe(t) == []
    assert all(Detector().observe([5.0]) == [] for _ in range(5))       # no others
    rng, d = np.random.default_rng(0), Detector()
    lines = [d.observe(0.02 * rng.uniform(0.82, 1.22, size=5)) for _ in range(500)]
    assert not any(lines)                                  # 1.22 / 0.82 < 1.5: never slow


# --- the partition and the rebalancer (synthetic timings) ---

def test_the_partition_follows_the_speeds_keeps_the_batch_and_a_row_per_micro_batch():
    assert partition([1.0, 1.0], 16, 2) == (8, 8)
    assert partition([3.0, 1.0], 16, 1) == (12, 4)
    assert partition([1.0, 1.0, 1.0], 16, 1) == (6, 5, 5)          # remainder to rank 0
    assert partition([100.0, 1.0, 1.0], 16, 2) == (12, 2, 2)       # floored at M
    for seed in range(50):
        speeds = np.random.default_rng(seed).uniform(0.01, 1.0, size=4)
        rows = partition(speeds, 64, 3)
        assert sum(rows) == 64 and min(rows) >= 3
    with pytest.raises(ValueError, match="cannot give each of 3 ranks 4"):
        partition([1.0, 1.0, 1.0], 8, 4)


def _balance(balancer: Balancer, fixed: list[float], per_row: float, steps: int,
             noise: float = 0.0, seed: int = 0) -> list[str]:
    """Feed the balancer replica times fixed_d + per_row x rows_d (x noise)."""
    rng, lines = np.random.default_rng(seed), []
    for _ in range(steps):
        t = [(f + per_row * r) * rng.uniform(1 - noise, 1 + noise)
             for f, r in zip(fixed, balancer.rows)]
        line = balancer.observe(t)
        lines += [line] if line else []
    return lines


def test_the_rebalancer_moves_rows_off_a_slow_replica_every_r_steps_at_most():
    b = Balancer(dp=2, global_batch=64, micro_batches=2)
    assert b.rows == (32, 32)
    assert _balance(b, [0.0, 0.02], 1e-3, EVERY - 1) == [] and b.rows == (32, 32)
    lines = _balance(b, [0.0, 0.02], 1e-3, 1)
    # speeds 32/32 ms and 32/52 ms: 64 rows in proportion are (39.6, 24.4) -> (40, 24)
    assert lines == ["straggler: rows per dp rank (32, 32) -> (40, 24) (slowest replica's "
                     "compute 52 ms; 40 ms if proportional to rows)"]
    # the next move, to (41, 23), would gain 44 -> 42.2 ms, under 10 %: it stays
    assert _balance(b, [0.0, 0.02], 1e-3, 10 * EVERY) == [] and b.rows == (40, 24)
    assert _balance(b, [0.0, 0.0], 1e-3, EVERY) == [        # the replica recovered
        "straggler: rows per dp rank (40, 24) -> (32, 32) (slowest replica's compute 40 ms; "
        "32 ms if proportional to rows)"]


def test_the_rebalancer_leaves_even_replicas_alone_under_noise():
    b = Balancer(dp=4, global_batch=64, micro_batches=1)
    assert _balance(b, [0.0] * 4, 1e-3, 200, noise=0.04) == [] and b.rows == (16,) * 4


# --- uneven micro-batches: the same rows, the same gradient ---

def test_uneven_rows_hold_the_same_global_rows_and_even_rows_are_bitwise_the_default():
    data = SyntheticData(DATA)
    ids = data.global_indices(5, B)
    got = []
    for d, mine in enumerate((11, 5)):
        batches, _ = micro_batching.micro_batches(data, 5, B, 2, d, 2, 0, rows=(11, 5))
        assert [mb.x.shape[0] for mb in batches] == [(mine + 1) // 2, mine // 2]
        got += [i for mb in batches for i in mb.dropout_key.sample_ids]
        assert sum(mb.aux_weight for mb in batches) == pytest.approx(mine / B)
    assert got == [int(i) for i in ids]
    for d in range(2):
        a, n = micro_batching.micro_batches(data, 5, B, 2, d, 2, 0)
        b, m = micro_batching.micro_batches(data, 5, B, 2, d, 2, 0, rows=(8, 8))
        assert n == m and all(np.array_equal(u.x, v.x) and np.array_equal(u.y, v.y)
                              and u.aux_weight == v.aux_weight and u.dropout_key ==
                              v.dropout_key for u, v in zip(a, b))
    for bad in ((12, 3), (8, 7), (8, 8, 0), (8.0, 8)):
        with pytest.raises(ValueError, match="must give each of the dp=2 ranks"):
            micro_batching.micro_batches(data, 5, B, 2, 0, 4, 0, rows=bad)


def _dp_gradient(rows: tuple[int, ...], M: int) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, gradient) of step 0, dp ranks emulated in one process: each rank's
    micro-batches backward into fresh .grad, then the ranks' gradients summed."""
    model, data = GPT(CFG, 0), SyntheticData(DATA)
    loss, total = 0.0, {}
    for d in range(len(rows)):
        for p in model.parameters():
            p.grad = None
        batches, n = micro_batching.micro_batches(data, 0, B, len(rows), d, M, 0, rows=rows)
        for mb in batches:
            _, l_mb = model(mb.x, mb.y, n_tokens=n, aux_weight=mb.aux_weight,
                            dropout_key=mb.dropout_key)
            l_mb.backward()
            loss += float(l_mb.item())
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0.0) + p.grad
    return loss, total


def test_uneven_micro_batches_give_the_even_gradient_within_1e_12():
    loss, grad = _dp_gradient((8, 8), 2)
    for rows in ((12, 4), (3, 13), (2, 7, 7)):
        loss_u, grad_u = _dp_gradient(rows, 2)
        assert abs(loss_u - loss) <= 1e-12
        for name, g in grad.items():       # the order of additions differs: not bitwise
            assert_close(grad_u[name], g, atol=1e-12, what=f"rows {rows}: d{name}")


# --- the `slow` fault ---

def test_slow_sleeps_at_the_start_of_every_step_from_its_own_and_says_so_once(
        monkeypatch, capsys):
    f = faults.parse("slow:rank=1:step=2:seconds=0.25")
    assert str(f) == "slow:rank=1:step=2:point=start:attempt=0:seconds=0.25"
    with pytest.raises(ValueError, match="slow delays the start of every step from 2 on"):
        faults.parse("slow:rank=1:step=2:point=end")
    slept: list[tuple[int, float]] = []
    inj = faults.Injector([f], rank=1)
    for step in range(5):
        monkeypatch.setattr(faults.time, "sleep", lambda s, step=step: slept.append((step, s)))
        inj.at("start", step)                          # not an event: nothing happens here
        inj.at("end", step)
        inj.slow(step)                                 # train.py: as the forward begins
    assert slept == [(2, 0.25), (3, 0.25), (4, 0.25)]
    assert capsys.readouterr().out.count("injecting slow:rank=1:step=2") == 1
    assert faults.Injector([f], rank=0).faults == [] and \
        faults.Injector([f], rank=1, attempt=1).faults == []


def test_slow_per_row_is_a_slow_device_whose_delay_follows_the_rows(monkeypatch):
    f = faults.parse("slow:rank=1:step=1:per_row=0.01")
    assert (f.seconds, f.per_row) == (0.0, 0.01)          # no fixed delay unless asked
    assert str(f) == "slow:rank=1:step=1:point=start:attempt=0:seconds=0:per_row=0.01"
    both = faults.parse("slow:rank=1:step=1:seconds=0.5:per_row=0.01")
    for bad, why in [("sleep:rank=1:step=1:per_row=0.1", "per_row is an option of slow"),
                     ("slow:rank=1:step=1:per_row=-1", "per_row >= 0"),
                     ("slow:rank=1:step=1:per_row=x", "per_row numbers")]:
        with pytest.raises(ValueError, match=why):
            faults.parse(bad)
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    for fault, rows in [(f, 32), (f, 8), (both, 8)]:
        faults.Injector([fault], rank=1).slow(2, rows)
    assert slept == [0.01 * 32, 0.01 * 8, 0.5 + 0.01 * 8]


def test_moe_models_keep_the_even_split(capsys):
    ctx = Namespace(rank=0, world=None)
    moe = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16, moe_every=2)
    s = for_rank(ctx, Namespace(straggler="rebalance", batch=B), Plan(dp=2), moe)
    assert s.mode == "detect" and "rows stay even" in capsys.readouterr().out
    assert for_rank(ctx, Namespace(straggler="off", batch=B), Plan(dp=2), CFG) is None


# --- runs on ranks ---

def _rank(ctx, plan: Plan, steps: int, mode: str | None, rows=None, slow: str | None = None):
    """train_on_rank with a Straggler (rows: forced, never rebalanced) and a slow fault;
    returns (result, rows used per step, lines logged)."""
    lines: list[str] = []
    straggler = None
    if mode is not None:
        balancer = Balancer(plan.dp, B, plan.micro_batches, every=EVERY if rows is None
                            else 10 ** 9)
        balancer.rows = rows or balancer.rows
        straggler = Straggler(mode, ctx.world, plan.dp, B, plan.micro_batches, lines.append,
                              balancer=balancer)
    injector = None if slow is None else faults.Injector([faults.parse(slow)], ctx.rank)
    result = train_on_rank(ctx, CFG, DATA, plan, RunConfig(steps=steps, global_batch=B),
                           OptimizerConfig(lr=LR), hooks=[injector], straggler=straggler)
    return result, [] if straggler is None else [r for r, _ in straggler.history], lines


def _assert_matches(runs, ref, what: str) -> None:
    for rank, (run, _, _) in enumerate(runs):
        assert_close(run.losses, ref.losses, atol=1e-12, what=f"{what} rank {rank}: losses")
        for name, p in ref.params.items():
            assert_close(run.params[name], p, atol=1e-12, what=f"{what} rank {rank}: {name}")


@pytest.mark.multiproc
@pytest.mark.parametrize("plan, rows", [
    (Plan(dp=2), (13, 3)),
    (Plan(dp=2, zero=1, micro_batches=2), (5, 11)),
    pytest.param(Plan(dp=2, tp=2), (4, 12), marks=pytest.mark.slow),   # tp: the demos cover it
    (Plan(dp=2, pp=2, micro_batches=2), (10, 6)),                       # a dp x pp composition
])
def test_a_run_on_uneven_rows_equals_the_single_process_run_within_1e_12(plan, rows):
    ref = train_single_process(CFG, DATA, steps=3, global_batch=B, lr=LR,
                               grad_accum=plan.micro_batches)
    runs = spawn(plan.world_size, _rank, plan, 3, "detect", rows)
    assert all(used == [rows] * 3 for _, used, _ in runs)
    _assert_matches(runs, ref, f"{plan.describe()} rows {rows}")


# timing: rank 1 is named only if its measured compute > 1.5 x rank 0's
@pytest.mark.slow
@pytest.mark.multiproc
def test_a_slow_rank_is_named_and_rebalanced_and_the_result_does_not_change():
    # 50 ms a step on rank 1 from step 2, against a step of a few ms: far above F = 1.5
    slow = "slow:rank=1:step=2:seconds=0.05"
    ref = train_single_process(CFG, DATA, steps=12, global_batch=B, lr=LR)
    runs = spawn(2, _rank, Plan(dp=2), 12, "rebalance", None, slow)
    _, used, lines = runs[0]
    assert any(re.match(r"straggler: rank 1 computes [\d.]+x the median for 3 steps", line)
               for line in lines), lines
    assert used[0] == (8, 8) and used[-1][1] < used[-1][0], (used, lines)
    assert all(r == used for _, r, _ in runs)              # every rank, the same partition
    _assert_matches(runs, ref, "rebalanced")
    assert all(np.array_equal(runs[1][0].params[k], v) for k, v in runs[0][0].params.items())


# timing: named before step 8 only if the measured compute ratio > 1.5
@pytest.mark.slow
@pytest.mark.multiproc
def test_the_cli_names_the_slow_rank_within_a_few_steps(capfd):
    code = train_cli.main(["--dp", "2", "--steps", "10", "--every", "1", "--n-layer", "2",
                       "--n-embd", "16", "--n-head", "2", "--batch", "8", "--straggler",
                       "detect", "--inject", "slow:rank=1:step=2:seconds=0.05"])
    out = capfd.readouterr().out                    # the ranks write to the inherited fd
    assert code == 0, out
    lines = out.splitlines()
    named = [i for i, line in enumerate(lines) if line.startswith("straggler: rank 1 ")]
    step8 = next(i for i, line in enumerate(lines) if line.startswith("step    8"))
    assert named and named[0] < step8, out


# timing: asserts comm_wait > 0.04 s > compute, wall-clock seconds of a loaded machine
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_name_the_slow_rank_though_they_wait_inside_the_backward(zero):
    """Stages 2-3 block in the backward (reduce-scatters; stage 3's gathers too), so a fast
    rank's forward + backward includes waiting for the slow one; the seconds of those
    calls (train.py's comm_wait) come out of compute, and only the slow rank is named."""
    slow = "slow:rank=1:step=2:seconds=0.05"
    runs = spawn(2, _rank, Plan(dp=2, zero=zero), 7, "detect", None, slow)
    lines = runs[0][2]
    named = {int(m[1]) for line in lines if (m := re.match(r"straggler: rank (\d) ", line))}
    assert named == {1}, lines
    fast, slowed = (runs[r][0].timing for r in (0, 1))
    assert fast["comm_wait"][-1] > 0.04 > fast["compute"][-1], fast      # rank 0 waited
    assert slowed["compute"][-1] > 0.05, slowed


def test_the_straggler_state_round_trips_through_json():
    """What a checkpoint keeps: the detector's streaks, the balancer's rows and window."""
    import json
    from minidist.reliability.straggler import Balancer, Detector
    d, b = Detector(), Balancer(2, 16, 2, every=3)
    d.observe([0.1, 0.5])
    b.observe([0.1, 0.3])
    b.rows = (6, 10)
    d2, b2 = Detector(), Balancer(2, 16, 2, every=3)
    d2.load_state_dict(json.loads(json.dumps(d.state_dict())))
    b2.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert d2.streak == d.streak and b2.rows == (6, 10)
    assert [(r, t.tolist()) for r, t in b2.window] == [(r, t.tolist()) for r, t in b.window]
    assert b2.observe([0.1, 0.3]) == b.observe([0.1, 0.3])
    assert b2.observe([0.1, 0.3]) == b.observe([0.1, 0.3]) and b2.rows == b.rows
