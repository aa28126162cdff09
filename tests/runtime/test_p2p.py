"""Point-to-point messages arrive intact, in order, at any size, and never deadlock a ring."""

import numpy as np
import pytest

from minidist.runtime import RankFailure, spawn

pytestmark = pytest.mark.multiproc
SIZES = [0, 1, 7, 65536 + 3, 300_000]            # 300k float64 = 2.4 MB: many slots long


def _ring_shift(ctx, sizes, dtypes):
    """Every rank sends its data right and receives from the left, for each size and dtype."""
    g, out = ctx.world, []
    right, left = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    for n in sizes:
        for dt in dtypes:
            x = (np.arange(n) * (g.rank + 1)).astype(dt)
            out.append(g.sendrecv(x, right, left) if g.size > 1 else x)
    return out


@pytest.mark.parametrize("W", [pytest.param(2, marks=pytest.mark.slow), 3,   # 3: a real ring
                               pytest.param(5, marks=pytest.mark.slow)])
def test_sendrecv_ring_shift_is_exact(W):
    dtypes = [np.float32, np.float64, np.int64, np.uint8]
    results = spawn(W, _ring_shift, SIZES, dtypes)
    for r, got in enumerate(results):
        k = 0
        for n in SIZES:
            for dt in dtypes:
                expected = (np.arange(n) * ((r - 1) % W + 1)).astype(dt)
                assert got[k].dtype == dt and np.array_equal(got[k], expected), (r, n, dt)
                k += 1


def _ping_pong(ctx, n, rounds):
    g = ctx.world
    x = np.zeros(n)
    for i in range(rounds):
        if g.rank == 0:
            g.send(x + i, 1)
            g.recv(1, x)
        else:
            g.recv(0, x)
            g.send(x * 2, 0)
    return x


def test_ping_pong_keeps_message_order():
    out = spawn(2, _ping_pong, 100_000, 5)
    expected = 0.0
    for i in range(5):
        expected = (expected + i) * 2
    assert np.all(out[0] == expected)


def _many_small_then_large(ctx):
    g = ctx.world
    if g.rank == 0:
        for i in range(20):                     # more messages than slots: sender must wait
            g.send(np.full(3, float(i)), 1)
        g.send(np.arange(200_000.0), 1)
        return None
    got = [g.recv(0, np.empty(3))[0] for _ in range(20)]
    big = g.recv(0, np.empty(200_000))
    return got, bool(np.array_equal(big, np.arange(200_000.0)))


def test_queued_messages_arrive_in_order():
    _, (got, big_ok) = spawn(2, _many_small_then_large)
    assert got == [float(i) for i in range(20)] and big_ok


def _wrong_size(ctx):
    g = ctx.world
    if g.rank == 0:
        g.send(np.zeros(5), 1)
    else:
        g.recv(0, np.empty(4))


def test_receiving_a_different_size_is_a_mismatch():
    with pytest.raises(RankFailure) as info:
        spawn(2, _wrong_size)
    assert "CollectiveMismatch" in str(info.value) and "40 B" in str(info.value)


def _bad_peer(ctx):
    ctx.world.send(np.zeros(1), ctx.rank)


def test_sending_to_yourself_is_a_value_error():
    with pytest.raises(RankFailure, match="ValueError.*not another rank"):
        spawn(2, _bad_peer)


def _combine(ctx):
    g = ctx.world
    acc = np.full(100_000, float(g.rank + 1))
    g.sendrecv(np.full(100_000, 10.0 * (g.rank + 1)), 1 - g.rank, 1 - g.rank, acc,
               combine=np.add)
    return acc


def test_sendrecv_can_reduce_straight_out_of_the_slot():
    a, b = spawn(2, _combine)
    assert np.all(a == 1 + 20) and np.all(b == 2 + 10)


def _counts(ctx):
    g = ctx.world
    g.sendrecv(np.zeros(1000), 1 - g.rank, 1 - g.rank)
    return dict(g.stats)


def test_bytes_are_counted():
    for s in spawn(2, _counts):
        assert s["bytes_sent"] == 8000 and s["bytes_recv"] == 8000 and s["messages_sent"] == 1


def test_the_locked_ordering_path_for_weak_memory_cpus(monkeypatch):
    """On ARM/POWER counters go through a process-shared lock; force that path here."""
    monkeypatch.setenv("MINIDIST_LOCKED_ORDERING", "1")
    results = spawn(3, _ring_shift, [0, 7, 300_000], [np.float64])
    for r, got in enumerate(results):
        for k, n in enumerate([0, 7, 300_000]):
            assert np.array_equal(got[k], np.arange(n) * ((r - 1) % 3 + 1.0)), (r, n)
    assert spawn(2, _barrier_then_rank) == [0, 1]


def _barrier_then_rank(ctx):
    from minidist.runtime.shm import strong_ordering
    assert not strong_ordering() and ctx.world.ordering.lock is not None
    ctx.world.barrier()
    return ctx.rank
