"""Offloading changes where the optimizer state lives, never a bit of the result: offloaded
runs (host and disk tiers, single process, DDP and ZeRO 1-3) equal the plain runs bitwise,
the ledger's device peak drops by exactly the offloaded bytes, the disk tier's reads really
run ahead of the updates, and its files go away: on close, and after a SIGKILL, at the
next run's start.

The default run takes the single-process tiers, dp=2 under ZeRO-1, the ZeRO-3 resume and the
prefetch; `-m slow` adds the disk tier without prefetch in one process (test_disk_tier_* runs
it too), dp=2 under DDP, ZeRO-2, -3, the SIGKILLed run's sweep (a
subprocess; the sweep itself is test_sweep_removes_only_runs_whose_pid_is_dead_and_lock_free)
and the CLI run."""

import fcntl
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from minidist import optim
from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.memory import offload
from minidist.optim import SGD, AdamW
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from minidist.train_cli import main

DATA = DataConfig(task="sort", length=4, seed=1)                        # T = 8
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)           # float64
STEPS, BATCH, LR = 3, 8, 1e-2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_dirs(root) -> list[str]:
    return sorted(d for d in os.listdir(root) if d.startswith(offload.PREFIX))


def _assert_same(run, ref, what: str) -> None:
    """Losses, norms, parameters and optimizer state equal with == (bitwise)."""
    assert run.losses == ref.losses and run.grad_norms == ref.grad_norms, what
    for name, p in ref.params.items():
        assert np.array_equal(run.params[name], p), f"{what}: param {name}"
    assert run.optimizer_state.keys() == ref.optimizer_state.keys(), what
    for key, v in ref.optimizer_state.items():
        assert np.array_equal(run.optimizer_state[key], v), f"{what}: state {key}"


class _Param:
    """An object shaped like a Parameter: .data and .grad."""

    def __init__(self, n: int, seed: int):
        rng = np.random.default_rng(seed)
        self.data, self.grad = rng.standard_normal(n), rng.standard_normal(n)


@pytest.mark.parametrize("tier,prefetch", [("host", True), ("disk", True),
                                           pytest.param("disk", False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("optimizer,kw", [("adamw", dict(weight_decay=0.1)),
                                          ("sgd", dict(momentum=0.9, weight_decay=0.1))])
def test_single_process_offloaded_equals_plain_bitwise(monkeypatch, tmp_path, tier, prefetch,
                                                       optimizer, kw):
    ref = train_single_process(TINY, DATA, steps=STEPS, global_batch=BATCH, lr=LR,
                               optimizer=optimizer, **kw)
    made, plain = [], optim.make_optimizer

    def offloaded(*args):                     # baseline's optimizer, wrapped
        made.append(offload.wrap(plain(*args), tier, tmp_path, prefetch=prefetch))
        return made[-1]
    monkeypatch.setattr(optim, "make_optimizer", offloaded)
    run = train_single_process(TINY, DATA, steps=STEPS, global_batch=BATCH, lr=LR,
                               optimizer=optimizer, **kw)
    _assert_same(run, ref, f"{optimizer} {tier} prefetch={prefetch}")
    (opt,) = made
    assert type(opt) is {"adamw": offload.OffloadedAdamW, "sgd": offload.OffloadedSGD}[optimizer]
    assert opt.state_arrays() == [] and len(opt.host_arrays()) == (2 if optimizer == "adamw"
                                                                   else 1) * len(opt.params)
    assert len(_run_dirs(tmp_path)) == (tier == "disk")
    opt.close()
    assert _run_dirs(tmp_path) == [], "close() leaves no run directory"


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 1]
                         + [pytest.param(s, marks=pytest.mark.slow) for s in (2, 3)])
def test_dp2_offloaded_equals_plain_and_the_device_peak_drops_by_its_bytes(tmp_path, stage):
    runs = {}
    for tier in offload.TIERS:
        plan = Plan(dp=2, zero=stage, offload=tier,
                    offload_dir=str(tmp_path) if tier == "disk" else None)
        runs[tier] = spawn(2, train_on_rank, TINY, DATA, plan,
                           RunConfig(steps=STEPS, global_batch=BATCH, seed=0, memory_ledger=True),
                           OptimizerConfig(lr=LR))
    assert _run_dirs(tmp_path) == [], "train_on_rank closes the offload: no files left"
    for tier in ("host", "disk"):
        for rank in range(2):
            plain, off = runs["none"][rank], runs[tier][rank]
            _assert_same(off, plain, f"ZeRO-{stage} {tier} rank {rank}")
            # off the device: the optimizer state, and under ZeRO-3 the parameter shards
            moved = plain.memory["optimizer"] + (plain.memory["params"] if stage == 3 else 0)
            assert moved > 0
            ledger, ref = off.memory["ledger"], plain.memory["ledger"]
            assert ref["peak"] - ledger["peak"] == moved, (tier, rank, ref["peak"], ledger)
            assert ledger["peak_by_category"]["optimizer"] == 0
            assert off.memory == {**plain.memory, "ledger": ledger}   # engine.memory(): all


@pytest.mark.multiproc
def test_resuming_into_offloaded_zero3_continues_bitwise_as_the_plain_run(tmp_path):
    """load_full_state writes into the memmap files (w shards, m, v) in place."""
    first = train_single_process(TINY, DATA, steps=1, global_batch=BATCH, lr=LR)
    runs = {}
    for tier in ("none", "disk"):
        plan = Plan(dp=2, zero=3, offload=tier,
                    offload_dir=str(tmp_path) if tier == "disk" else None)
        runs[tier] = spawn(2, train_on_rank, TINY, DATA, plan,
                           RunConfig(steps=2, global_batch=BATCH, seed=0, start_step=1,
                                     total_steps=3),
                           OptimizerConfig(lr=LR),
                           initial_state=(first.params, first.optimizer_state))
    for rank in range(2):
        _assert_same(runs["disk"][rank], runs["none"][rank], f"resumed rank {rank}")
    assert _run_dirs(tmp_path) == []


def test_disk_tier_reads_the_next_unit_while_this_one_is_updated(tmp_path):
    """Timing-free: the update of unit 0 waits until the read of unit 1 has started, and the
    read of unit 1 cannot finish before update 0 has: only a read running on another thread
    at the same time as the update lets both happen (no prefetch: the wait fails)."""
    for prefetch in (True, False):
        params = [_Param(5, seed) for seed in range(3)]
        opt = offload.wrap(AdamW(params, lr=0.1), "disk", tmp_path, prefetch=prefetch)
        opt.trace = []
        started, updated, seen = threading.Event(), threading.Event(), []
        real_read, real_update = opt.store.read, opt._update

        def slow_read(home, _read=real_read):
            if home is opt.m[1]:
                started.set()
                updated.wait(timeout=30)          # a slow disk: done only after update 0
            return _read(home)

        def update(i, *args, _update=real_update):
            if i == 0:
                seen.append(started.wait(timeout=10 if prefetch else 0.5))
            _update(i, *args)
            if i == 0:
                updated.set()
        opt.store.read, opt._update = slow_read, update
        opt.step()
        opt.close()
        order = [e for e in opt.trace if e[1] in (0, 1) and e[0] != "write start"]
        if prefetch:
            assert seen == [True], "update 0 ran without the read of unit 1 in flight"
            assert order.index(("read start", 1)) < order.index(("update end", 0)) \
                < order.index(("read end", 1)), order
        else:
            assert seen == [False], "without prefetch unit 1 is read after update 0"
            assert order.index(("update end", 0)) < order.index(("read start", 1)), order


def test_close_removes_the_files_and_the_state_stays_readable(tmp_path):
    params = [_Param(4, 0), _Param(3, 1)]
    plain = SGD([_Param(4, 0), _Param(3, 1)], lr=0.1, momentum=0.9)
    opt = offload.wrap(SGD(params, lr=0.1, momentum=0.9), "disk", tmp_path)
    opt.step()
    plain.step()
    (run,) = _run_dirs(tmp_path)
    files = sorted(os.listdir(tmp_path / run))
    assert files == ["buffers.0.bin", "buffers.1.bin", offload.LOCK]
    assert [(n, t, b) for n, t, b, _ in opt.placement()] == [
        ("buffers.0", "disk", 32), ("buffers.1", "disk", 24)]
    assert opt.store.bytes_read == opt.store.bytes_written == 56    # one read, one write each
    opt.close()
    assert _run_dirs(tmp_path) == []
    state = opt.state_dict()
    assert all(type(v) is np.ndarray for v in state.values())
    for key, v in plain.state_dict().items():
        assert np.array_equal(state[key], v), key
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


_KILLED_RUN = """
import sys, time
import numpy as np

from minidist.memory import offload
from minidist.optim import AdamW

class P:
    def __init__(self, n):
        self.data, self.grad = np.ones(n), np.full(n, 0.5)

opt = offload.wrap(AdamW([P(6), P(4), P(5)], lr=0.1), "disk", sys.argv[1])
real = opt._update
def update(i, *args):
    if i == 1:                                # mid-step: unit 0 updated, unit 1 not
        print(opt.store.dir.path, flush=True)
        time.sleep(120)
    real(i, *args)
opt._update = update
opt.step()
"""


@pytest.mark.slow
def test_a_run_killed_mid_step_is_swept_by_the_next(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, str(tmp_path)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        stale = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert os.path.basename(stale) in _run_dirs(tmp_path), "the killed run left its files"
    assert {"m.0.bin", "v.2.bin", offload.LOCK} <= set(os.listdir(stale))
    params = [_Param(6, 0), _Param(4, 1)]
    opt = offload.wrap(AdamW(params, lr=0.1), "disk", tmp_path)
    assert opt.store.dir.swept == [stale] and not os.path.exists(stale)
    live = offload.RunDir(tmp_path)           # owners alive in this process are spared
    assert live.swept == [] and len(_run_dirs(tmp_path)) == 2
    plain = AdamW([_Param(6, 0), _Param(4, 1)], lr=0.1)
    for _ in range(2):
        opt.step()
        plain.step()
    for p, q in zip(params, plain.params):
        assert np.array_equal(p.data, q.data)
    opt.close()
    assert _run_dirs(tmp_path) == [os.path.basename(live.path)]
    live.close()
    assert _run_dirs(tmp_path) == []


def test_sweep_removes_only_runs_whose_pid_is_dead_and_lock_free(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(done.stdout)                                       # exited: a dead pid
    dead = tmp_path / f"{offload.PREFIX}{pid}-x"
    held = tmp_path / f"{offload.PREFIX}{pid}-z"               # its lock held (a fork of it)
    making = tmp_path / f"{offload.PREFIX}{os.getpid()}-y"     # no lock yet, maker alive
    other = tmp_path / "not-ours"
    for d in (dead, held, making, other):
        d.mkdir()
    fd = os.open(held / offload.LOCK, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert offload.sweep(str(tmp_path)) == [str(dead)]
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted([held.name, making.name, other.name])
    assert offload.sweep(str(tmp_path)) == [str(held)]          # its lock is free now


def test_errors_name_the_fix(tmp_path):
    opt = AdamW([_Param(2, 0)], lr=0.1)
    assert offload.wrap(opt, "none") is opt
    with pytest.raises(ValueError, match="tier='tape' is unknown"):
        offload.wrap(opt, "tape")
    with pytest.raises(ValueError, match="depth=0"):
        offload.wrap(opt, "host", depth=0)
    with pytest.raises(ValueError, match="cannot offload a MasterWeights"):
        offload.wrap(type("MasterWeights", (), {})(), "host")
    with pytest.raises(ValueError, match="offload='tape' is unknown"):
        Plan(offload="tape")
    with pytest.raises(ValueError, match="but offload='host'; use offload='disk'"):
        Plan(offload="host", offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="master weights are not offloaded"):
        Plan(offload="disk", precision="bf16")


@pytest.mark.slow
@pytest.mark.multiproc
def test_cli_offload_disk_under_zero3_checks_ok_and_leaves_no_files(tmp_path, capsys):
    code = main(["--dp", "2", "--zero", "3", "--offload", "disk", "--offload-dir",
                 str(tmp_path), "--check", "--steps", "3", "--batch", "8", "--n-embd", "16",
                 "--n-head", "2", "--length", "4", "--every", "1", "--run-dir", "none"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[-1].startswith("OK: dp=2 x tp=1, ZeRO-3 training matches"), out
    assert _run_dirs(tmp_path) == []
