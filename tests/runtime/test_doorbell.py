"""Doorbells: a rank asleep at its bell is woken by the peer's publish, and a publish rings
only a rank that sleeps.

In the end-to-end cases the waiting ranks make each sleep last an hour, so their wait can
only end because the peer rang: a missing ring leaves the job stuck, and spawn's
join_timeout turns that into a failure. No wall-clock time is asserted."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from minidist.runtime import spawn, wait
from minidist.runtime.doorbell import Doorbells, close_bells, make_bells

pytestmark = pytest.mark.multiproc


@pytest.fixture
def bells():
    fds = make_bells(2)
    yield fds
    close_bells(fds)


def _empty(fd: int) -> bool:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        return True
    return False


def test_a_publish_rings_only_a_rank_that_sleeps(bells):
    sleeping = np.zeros(2, np.int64)
    door = Doorbells(bells, sleeping, rank=0)
    door.ring(1)
    assert _empty(bells[1]), "rang a rank that was not asleep"
    sleeping[1] = 1
    door.ring(1)
    assert not _empty(bells[1]), "did not ring a sleeping rank"
    door.ring_all([1])
    assert not _empty(bells[1]) and _empty(bells[0])


def test_a_sleep_that_finds_its_data_ready_returns_at_once_and_unmarks_itself(bells):
    sleeping = np.zeros(2, np.int64)
    door = Doorbells(bells, sleeping, rank=0)
    seen = []
    door.sleep(lambda: seen.append(int(sleeping[0])) or True, timeout=3600)
    assert seen == [1] and sleeping[0] == 0      # marked asleep when it looked, not after

    def broken():
        raise RuntimeError("ready() failed")
    with pytest.raises(RuntimeError):
        door.sleep(broken, timeout=3600)
    assert sleeping[0] == 0


def test_an_earlier_ring_ends_the_next_sleep_and_is_used_up(bells):
    sleeping = np.zeros(2, np.int64)
    door = Doorbells(bells, sleeping, rank=0)
    os.eventfd_write(bells[0], 1)                # a ring nobody slept through
    door.sleep(lambda: False, timeout=3600)      # returns: the bell was readable
    assert _empty(bells[0]) and sleeping[0] == 0


def _woken(ctx, how):
    """Ranks 1.. sleep in a recv from rank 0 or in a barrier, each sleep lasting an hour
    (wait.CHECK_EVERY, in this process only); rank 0 acts once all of them sleep."""
    board, W = ctx.job.board, ctx.world_size
    x = np.arange(4, dtype=np.float64)
    if ctx.rank == 0:
        while not all(board.sleeping[r] for r in range(1, W)):
            time.sleep(1e-3)
        if how == "recv":
            for r in range(1, W):
                ctx.world.send(x, r)
        else:
            ctx.world.barrier()
        return None
    checks, wait.CHECK_EVERY = wait.CHECK_EVERY, 3600.0
    try:
        if how == "recv":
            return ctx.world.recv(0, np.zeros(4)).tolist()
        ctx.world.barrier()             # every rank's first wait is for rank 0, the last in
        return "met"
    finally:
        wait.CHECK_EVERY = checks        # the exit barrier waits as usual


@pytest.mark.parametrize("how,W", [("recv", 2), ("barrier", 3)])
def test_a_rank_asleep_in_a_wait_is_woken_by_the_publish(how, W):
    out = spawn(W, _woken, how, join_timeout=60)
    expect = [0.0, 1.0, 2.0, 3.0] if how == "recv" else "met"
    assert out == [None] + [expect] * (W - 1)


def test_bells_made_before_an_open_file_error_are_closed(monkeypatch):
    made, real = [], os.eventfd

    def eventfd(*args):
        if len(made) == 2:
            raise OSError(24, "Too many open files")
        made.append(real(*args))
        return made[-1]
    monkeypatch.setattr(os, "eventfd", eventfd)
    with pytest.raises(OSError):
        make_bells(4)
    for fd in made:
        with pytest.raises(OSError):
            os.fstat(fd)
