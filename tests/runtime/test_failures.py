"""Failures are reported fast and once: async errors fail the rank at once, a timeout
names the rank that never arrived, and an error while setting up a rank reaches the report.

(test_launch.py covers the basic cases; the autouse fixture in conftest.py checks that no
child process and no /dev/shm entry is left after every test.)

The tests that assert how long something took, and those that name the rank stopped inside
a call (which tells it by its heartbeat: a waiting rank starved of CPU for STALE = 0.5 s
looks stopped too), can fail on a loaded machine, so they run under -m slow only.
"""

import os
import signal
import time

import numpy as np
import pytest

import minidist.collectives as C
from minidist.runtime import RankFailure, spawn
from minidist.runtime.world import Job
from minidist.runtime.shm import Arena

pytestmark = pytest.mark.multiproc


def _stop_one_rank_behind_async_calls(ctx):
    """Rank 2 stops (SIGSTOP) before its first call; the others queue three async
    collectives, then make a synchronous one."""
    g, W = ctx.world, ctx.world_size
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    C.all_to_all(np.arange(2.0 * W), group=g, async_op=True)
    C.scatter(np.zeros((W, 3)) if g.rank == 0 else None, root=0, group=g, async_op=True)
    C.barrier(group=g, async_op=True)
    C.reduce(np.ones(3), root=0, group=g)


@pytest.mark.slow                  # wall-clock: elapsed < timeout + 1.5
def test_a_stopped_rank_behind_async_calls_is_named_hung_within_one_timeout(monkeypatch):
    """Before, each queued call waited its own timeout (4 x 2 s + 1 s here, measured 7.1 s);
    now the first timeout fails the job, names the stopped rank, and the launcher kills
    it (a stopped process too) without waiting out its grace period."""
    timeout = 2.0
    monkeypatch.setenv("MINIDIST_TIMEOUT", str(timeout))
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(4, _stop_one_rank_behind_async_calls)
    elapsed = time.monotonic() - t0
    err, text = info.value, str(info.value)
    assert elapsed < timeout + 1.5, f"reported after {elapsed:.2f} s"
    assert err.rank == 2 and err.hung == (2,)
    assert text.startswith("rank 2 of 4 is hung: rank "), text.splitlines()[0]
    assert "CollectiveTimeout" in text and "all_to_all #1 on 'world'" in text
    assert "killed by the launcher" in err.failures[2]
    assert text.count("flight recorder (") == 1                 # printed once, not twice


def _async_mismatch_then_busy(ctx):
    w = C.all_reduce(np.zeros(2 + ctx.rank), group=ctx.world, async_op=True)   # shapes differ
    time.sleep(30)                   # busy elsewhere: nobody waits on w for a long time
    w.wait()


@pytest.mark.slow                  # wall-clock: elapsed < 3.0
def test_an_async_error_reaches_the_launcher_while_the_rank_is_busy():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(2, _async_mismatch_then_busy, collective_timeout=30)
    elapsed = time.monotonic() - t0
    text = str(info.value)
    assert "CollectiveMismatch" in text and "all_reduce #1 on 'world'" in text
    assert elapsed < 3.0, f"reported after {elapsed:.2f} s"


def _next_call_after_an_async_failure(ctx, folder):
    w = C.all_reduce(np.zeros(2 + ctx.rank), group=ctx.world, async_op=True)
    while not w.is_completed():
        time.sleep(1e-3)
    t0 = time.monotonic()
    try:
        C.barrier(group=ctx.world)
    except RankFailure as e:
        with open(os.path.join(folder, f"rank{ctx.rank}.txt"), "w") as f:
            f.write(f"{time.monotonic() - t0}\n{e}")
        raise


@pytest.mark.slow                  # wall-clock: each rank's wait < 0.1 s
def test_the_next_call_after_an_async_failure_raises_at_once(tmp_path):
    with pytest.raises(RankFailure):
        spawn(2, _next_call_after_an_async_failure, str(tmp_path), collective_timeout=30)
    for r in (0, 1):
        seconds, text = (tmp_path / f"rank{r}.txt").read_text().split("\n", 1)
        assert float(seconds) < 0.1, f"rank {r} waited {float(seconds):.2f} s"
        assert f"[rank {r}/2] barrier on 'world' not started" in text
        assert "async all_reduce #1 on 'world'" in text and "failed earlier" in text


def _plain_submit_error(ctx):
    w = ctx.world.submit(lambda: 1 / 0)        # no collective: the group stays consistent
    try:
        w.wait()
    except ZeroDivisionError:
        C.barrier(group=ctx.world)             # so the rank carries on
        return "caught"


def test_an_error_outside_any_collective_stays_in_its_work():
    assert spawn(2, _plain_submit_error) == ["caught", "caught"]


def _sleep_on_rank_2(ctx):
    if ctx.rank == 2:
        time.sleep(60)
    C.all_reduce(np.ones(4), group=ctx.world)


@pytest.mark.slow                  # wall-clock: elapsed < 2.0
def test_a_timeout_names_the_rank_that_never_arrived_first_and_once():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(3, _sleep_on_rank_2, collective_timeout=1.0)
    elapsed = time.monotonic() - t0
    err, text = info.value, str(info.value)
    first = text.splitlines()[0]
    assert first.startswith("rank 2 of 3 is hung: rank ") and "timed out waiting" in first
    assert err.rank == 2 and err.hung == (2,)
    assert text.count("flight recorder (") == 1
    assert text.count("behind this call") == 1                 # the error text, once
    assert "Traceback" in text
    assert elapsed < 1.0 + 1.0, f"took {elapsed:.2f} s"        # the sleeper is not waited for


def _stop_inside_a_call(ctx, stopped):
    g = ctx.world
    C.all_reduce(np.ones(4), group=g)
    if ctx.rank == stopped:                 # enters barrier #2, then stops inside it
        with g.collective("barrier", None):
            os.kill(os.getpid(), signal.SIGSTOP)
    C.barrier(group=g)


@pytest.mark.slow                  # load: a starved waiting rank's beat is old too
@pytest.mark.parametrize("stopped", [1, 3])
def test_a_rank_stopped_inside_a_call_every_rank_reached_is_the_one_named_hung(stopped):
    # Every rank reached barrier #2, so sequence numbers cannot tell who hangs; the
    # stopped rank is the one that no longer waits (its beat on the board is old).
    with pytest.raises(RankFailure) as info:
        spawn(4, _stop_inside_a_call, stopped, collective_timeout=1.0)
    err, text = info.value, str(info.value)
    assert err.rank == stopped and err.hung == (stopped,)
    assert text.startswith(f"rank {stopped} of 4 is hung: rank ")
    assert f"global rank {stopped}: inside this call but not waiting for anyone" in text


def _hello(ctx):
    ctx.new_group([0, 1], name="pair")
    C.barrier(group=ctx.world)


def test_a_setup_error_reaches_the_report_once(monkeypatch, capfd):
    def cannot(job):                          # the ranks inherit it: each fails in Job()
        raise MemoryError("shared arena too small: planted while making 'alone'")
    monkeypatch.setattr(Job, "_alone", cannot)
    with pytest.raises(RankFailure) as info:
        spawn(3, _hello)
    text = str(info.value)
    lines = text.splitlines()
    assert lines[0] == "rank {} of 3 failed, and every other rank the same way:".format(
        info.value.rank)
    cause = lines[1]                           # the cause, in one line
    assert "MemoryError" in cause and "planted while making 'alone'" in cause
    assert "while setting up the job" in lines[2]
    assert "without reporting a result" not in text
    assert text.count("Traceback") == 1
    assert "Traceback" not in capfd.readouterr().err          # no dump from each rank


def test_a_group_region_too_small_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("MINIDIST_GROUP_BYTES", "4096")
    with pytest.raises(ValueError, match=r"MINIDIST_GROUP_BYTES=4096 is too small: the world "
                                         r"group of 3 ranks needs \d+ B .* set it to at least"):
        spawn(3, _hello)


def test_too_many_groups_names_the_variable(monkeypatch):
    monkeypatch.setenv("MINIDIST_GROUPS", "2")                  # the world and alone
    with pytest.raises(RankFailure, match=r"failed, and every other rank the same way:\n"
                       r".*cannot create group 'pair': the job allows 2 groups\. "
                       r"Set MINIDIST_GROUPS higher"):
        spawn(2, _hello)


def test_zero_groups_is_refused_before_launching(monkeypatch):
    monkeypatch.setenv("MINIDIST_GROUPS", "0")
    with pytest.raises(ValueError, match="MINIDIST_GROUPS=0 must be >= 2"):
        spawn(2, _hello)


def test_an_arena_the_kernel_refuses_names_the_variables():
    with pytest.raises(MemoryError, match="could not reserve.*MINIDIST_GROUPS.*"
                       "MINIDIST_GROUP_BYTES"):
        Arena(1 << 62)                         # 4 EiB: more address space than there is
