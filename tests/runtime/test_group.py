"""Groups: barriers, shared regions, async work, subgroups side by side, and the mesh."""

import threading
import time

import numpy as np
import pytest

from minidist import collectives as C

from minidist.runtime import RankFailure, spawn
from minidist.runtime.mesh import DeviceMesh

pytestmark = pytest.mark.multiproc


def _barrier_order(ctx):
    """Rank r sleeps r*20 ms before the barrier; after it, everyone must see all arrivals."""
    board = ctx.world.shared("arrivals", 8)
    time.sleep(0.02 * ctx.rank)
    board.local(np.int64, 1)[0] = 1
    ctx.world.barrier()
    seen = sum(int(board.peer(r, np.int64, 1)[0]) for r in range(ctx.world_size))
    ctx.world.barrier()
    return seen


@pytest.mark.parametrize("W", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(4, marks=pytest.mark.slow)])
def test_barrier_lets_nobody_through_early(W):
    assert spawn(W, _barrier_order) == [W] * W


def _shared_reads(ctx):
    g = ctx.world
    buf = g.shared("x", 8 * 5)
    buf.local(np.float64, 5)[:] = g.rank * 10 + np.arange(5)
    g.barrier()
    seen = [buf.peer(r, np.float64, 5).copy() for r in range(g.size)]
    same = g.shared("x", 16) is buf                      # smaller request: same region
    g.barrier()
    return seen, same


def test_shared_regions_are_visible_to_every_member():
    for seen, same in spawn(3, _shared_reads):
        assert same
        for r, arr in enumerate(seen):
            assert np.array_equal(arr, r * 10 + np.arange(5))


def _shared_mismatch(ctx):
    ctx.world.shared("x", 8 * (1 + ctx.rank))


def test_shared_with_different_sizes_is_a_mismatch():
    with pytest.raises(RankFailure, match="CollectiveMismatch"):
        spawn(2, _shared_mismatch)


def _subgroups_side_by_side(ctx):
    """Even and odd ranks form two groups and exchange at the same time, plus the world."""
    evens = ctx.new_group([0, 2], name="evens")
    odds = ctx.new_group([1, 3], name="odds")
    g = evens if ctx.rank % 2 == 0 else odds
    assert (evens is None) != (odds is None)
    x = np.full(50_000, float(ctx.rank))
    got = g.sendrecv(x, 1 - g.rank, 1 - g.rank)
    w = ctx.world
    whole = w.sendrecv(x, (w.rank + 1) % 4, (w.rank - 1) % 4)
    return g.name, g.ranks, got[0], whole[0]


def test_two_groups_in_use_at_the_same_time():
    out = spawn(4, _subgroups_side_by_side)
    assert out[0] == ("evens", (0, 2), 2.0, 3.0)
    assert out[1] == ("odds", (1, 3), 3.0, 0.0)
    assert out[2] == ("evens", (0, 2), 0.0, 1.0)
    assert out[3] == ("odds", (1, 3), 1.0, 2.0)


def _async_on_two_groups(ctx):
    """Async exchanges on two groups overlap; Work.wait returns each result."""
    a = ctx.new_group([0, 1], name="a")
    b = ctx.new_group([0, 1], name="b")
    x = np.full(200_000, float(ctx.rank))

    def exchange(g):
        with g.collective("swap", x):
            return g.sendrecv(x, 1 - g.rank, 1 - g.rank)

    works = [g.submit(lambda g=g: exchange(g)) for g in (a, b)]
    results = [w.wait(timeout=10) for w in works]
    return [float(r[0]) for r in results], all(w.is_completed() for w in works)


def test_async_work_on_two_groups():
    (r0, done0), (r1, done1) = spawn(2, _async_on_two_groups)
    assert r0 == [1.0, 1.0] and r1 == [0.0, 0.0] and done0 and done1


def _async_error(ctx):
    w = ctx.world.submit(lambda: 1 / 0)
    try:
        w.wait()
    except ZeroDivisionError:
        return "raised"


def test_async_errors_reach_wait():
    assert spawn(1, _async_error) == ["raised"]


def _bad_group(ctx, ranks):
    ctx.new_group(ranks)


@pytest.mark.parametrize("ranks", [[], [0, 0], [0, 5]])
def test_new_group_rejects_bad_ranks(ranks):
    with pytest.raises(RankFailure, match="ValueError.*distinct global ranks"):
        spawn(2, _bad_group, ranks)


def _different_groups(ctx):
    ctx.new_group([0, 1] if ctx.rank == 0 else [1, 2])


def test_ranks_creating_different_groups_is_a_mismatch():
    with pytest.raises(RankFailure, match="CollectiveMismatch"):
        spawn(3, _different_groups)


def _mesh(ctx):
    m = DeviceMesh(ctx.job, ("dp", "tp"), (2, 3))
    return {a: (m.group(a).name, m.group(a).ranks, m.coord(a)) for a in m.axes}


def test_mesh_groups_follow_row_major_layout():
    out = spawn(6, _mesh)
    grid = np.arange(6).reshape(2, 3)
    for r, groups in enumerate(out):
        d, t = divmod(r, 3)
        assert groups["tp"] == (f"tp{d}", tuple(grid[d]), t)
        assert groups["dp"] == (f"dp{t}", tuple(grid[:, t]), d)


def _bad_mesh(ctx):
    DeviceMesh(ctx.job, ("dp", "tp"), (2, 2))


def test_mesh_shape_must_cover_the_world():
    with pytest.raises(RankFailure, match="ValueError.*shape \\(2, 2\\) has 4 ranks"):
        spawn(3, _bad_mesh)


def _barrier_from_different_calls(ctx, shift):
    g = ctx.world
    for _ in range(shift):
        C.barrier(group=g)                      # both ranks: the barriers line up
    if ctx.rank == 0:
        C.barrier(group=g)
    else:                                       # its only wait is direct_small's barrier
        C.all_reduce(np.ones(2, np.float32), group=g, algo="direct")


@pytest.mark.multiproc
@pytest.mark.parametrize("shift", [0, 3])
def test_ranks_meeting_at_a_barrier_from_different_calls_is_a_mismatch_naming_both(shift):
    with pytest.raises(RankFailure) as info:
        spawn(2, _barrier_from_different_calls, shift)
    text = str(info.value)
    assert "CollectiveMismatch" in text
    assert f"barrier #{shift + 1} on 'world'" in text
    assert f"all_reduce #{shift + 1} on 'world' (float32 (2,), op sum, algo direct)" in text


class _ReleasingCondition(threading.Condition):
    """The group's condition, which lets the queued call `go` once drain() waits on it:
    the main thread is then certainly waiting for the queue (no timing involved)."""

    def __init__(self, go: threading.Event):
        super().__init__()
        self.go = go

    def wait_for(self, predicate, timeout=None):
        self.go.set()
        return super().wait_for(predicate, timeout)


def _seconds_in_calls(ctx):
    g = ctx.world
    before = g.stats["seconds"]
    for _ in range(3):
        C.all_reduce(np.ones(1000), group=g)
    synchronous = g.stats["seconds"] - before
    work = C.all_reduce(np.ones(1000), group=g, async_op=True)
    work.wait()
    waited = g.stats["seconds"] - before - synchronous
    go = threading.Event()
    g._cv = _ReleasingCondition(go)
    g.submit(go.wait)                     # queued until drain() waits for it
    before = g.stats["seconds"]
    g.drain()
    return synchronous, waited, g.stats["seconds"] - before


def test_a_group_counts_the_seconds_its_caller_spent_in_calls():
    """train.py's comm column adds these for every group of the layout: synchronous
    calls, the main thread's waits in Work.wait() (the async call's own run on the
    group's worker is not waiting) and in drain() (a synchronous call waiting for the
    group's queued async ones)."""
    for synchronous, waited, drained in spawn(2, _seconds_in_calls):
        assert synchronous > 0 and waited > 0 and drained > 0
