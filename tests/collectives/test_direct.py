"""direct.py must be bitwise: rank-order sum, equal to NumPy's `acc = x0; acc = acc + x1; ...`,
identical on every rank, whatever the arrival order and however many rounds it takes.

The world-size sweeps run W=1 (the lone rank) and W=3 (several peers, N % W != 0) by default
and the small-message reuse check W=2; the other world sizes are in the slow set."""

import hashlib

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import direct
from minidist.runtime.launch import spawn

pytestmark = pytest.mark.multiproc

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
DEFAULT_W = (1, 3)          # the world sizes of each sweep in the default run


def _sweep(sizes, default=DEFAULT_W):
    """`sizes` as parameters, the ones not in `default` marked slow."""
    return [W if W in default else pytest.param(W, marks=pytest.mark.slow) for W in sizes]

SMALL_BUFFER = 1024         # bytes per rank: forces many rounds for a few thousand elements


def _inputs(W, n, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return [rng.integers(-10**12, 10**12, n) for _ in range(W)]
    # mixed magnitudes make the sum's rounding depend on the order of additions
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(dtype)
            for _ in range(W)]


def _rank_order_sum(xs):
    """The single-process reference, written out in plain NumPy."""
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = acc + x
    return acc


def _cases(W):
    return [(n, dtype, bb) for n in sorted({0, 1, W - 1, W + 1, 3001})
            for dtype in ("float64", "float32", "int64") for bb in (direct.BUFFER_BYTES,
                                                                     SMALL_BUFFER)]


def _direct_on_rank(ctx):
    g, W = ctx.world, ctx.world_size
    out = []
    for i, (n, dtype, bb) in enumerate(_cases(W)):
        x = _inputs(W, n, dtype, seed=i)[g.rank]
        with g.collective("all_reduce", x, reduce_op="sum", algo="direct"):
            full = direct.all_reduce(x, g, "sum", buffer_bytes=bb)
        with g.collective("reduce_scatter", x, reduce_op="sum", algo="direct"):
            part = direct.reduce_scatter(x, g, "sum", buffer_bytes=bb)
        out.append((full, part))
    return out


@pytest.mark.parametrize("W", _sweep(WORLD_SIZES))
def test_direct_is_bitwise_the_rank_order_sum(W):
    per_rank = spawn(W, _direct_on_rank)
    for i, (n, dtype, bb) in enumerate(_cases(W)):
        ref = _rank_order_sum(_inputs(W, n, dtype, seed=i))
        chunks = np.array_split(ref, W)
        for r in range(W):
            full, part = per_rank[r][i]
            what = f"W={W} N={n} {dtype} buffer={bb} B, rank {r}"
            assert full.dtype == ref.dtype and np.array_equal(full, ref), f"all_reduce {what}"
            assert part.dtype == ref.dtype and np.array_equal(part, chunks[r]), \
                f"reduce_scatter {what}"


def _delayed_on_rank(ctx, orders):
    """The same all_reduce, with the ranks arriving in a different order each time."""
    import time
    g, W = ctx.world, ctx.world_size
    x = _inputs(W, 5000, "float32", seed=7)[g.rank]
    digests = []
    for order in orders:
        time.sleep(0.003 * order.index(g.rank))
        y = C.all_reduce(x, group=g, algo="direct")
        digests.append(hashlib.sha1(y.tobytes()).hexdigest())
    ring_y = C.all_reduce(x, group=g, algo="ring")
    return digests, y, ring_y


def test_direct_does_not_depend_on_arrival_order():
    W = 5
    orders = [list(range(W)), list(reversed(range(W))), [2, 4, 0, 3, 1]]
    per_rank = spawn(W, _delayed_on_rank, orders)
    digests = {d for ds, _, _ in per_rank for d in ds}
    assert len(digests) == 1, "direct.all_reduce changed with arrival order or rank"
    ref = _rank_order_sum(_inputs(W, 5000, "float32", seed=7))
    assert np.array_equal(per_rank[0][1], ref)
    # Not vacuous: on these inputs a ring (different grouping) rounds differently.
    assert not np.array_equal(per_rank[0][2], ref)
    np.testing.assert_allclose(per_rank[0][2], ref, rtol=1e-5, atol=1e-2)


def test_window_respects_both_areas():
    for W in (1, 2, 3, 8):
        for isz in (4, 8):
            m = direct.window(isz, W, SMALL_BUFFER)
            s_in = SMALL_BUFFER * W // (W + 1) // 64 * 64
            assert 1 <= m <= s_in // isz                            # inputs fit the input area
            assert -(-m // W) * isz <= SMALL_BUFFER - s_in          # one share fits the output
    with pytest.raises(ValueError, match="buffer_bytes"):
        direct.window(8, 8, 64)


# --- all_reduce_shared: in place on a region that already lives in group.shared() ---

SHARED_WORLD_SIZES = [1, 2, 3, 4, 5]
OFFSET = 128                     # bytes: the buffer sits at an offset inside the region


def _shared_cases(W):
    return [(n, dtype) for n in sorted({0, 1, W + 1, 3001}) for dtype in ("float64", "float32")]


def _shared_on_rank(ctx, rounds):
    """Every case `rounds` times back to back; new inputs are written into the region
    the moment a call returns (the race the two-barrier argument must rule out)."""
    import time
    g, W = ctx.world, ctx.world_size
    buf = g.shared("test/in-place", OFFSET + 3001 * 8)
    out, sent, recv = [], [], []
    for i, (n, dtype) in enumerate(_shared_cases(W)):
        for k in range(rounds):
            x = _inputs(W, n, dtype, seed=100 * i + k)[g.rank]
            buf.local(dtype, n, OFFSET)[...] = x
            time.sleep(0.001 * ((g.rank + k) % W))          # a different arrival order each round
            s0, r0 = g.stats["bytes_sent"], g.stats["bytes_recv"]
            with g.collective("all_reduce", x, reduce_op="sum", algo="direct"):
                view = direct.all_reduce_shared(buf, dtype, n, g, "sum", offset=OFFSET)
            out.append(view.copy())
            sent.append(g.stats["bytes_sent"] - s0)
            recv.append(g.stats["bytes_recv"] - r0)
    return out, sent, recv


@pytest.mark.parametrize("W", _sweep(SHARED_WORLD_SIZES))
def test_all_reduce_shared_is_bitwise_the_rank_order_sum_in_place(W):
    rounds = 3
    per_rank = spawn(W, _shared_on_rank, rounds)
    j = 0
    for i, (n, dtype) in enumerate(_shared_cases(W)):
        shares = [len(c) for c in np.array_split(np.empty(n), W)]
        for k in range(rounds):
            ref = _rank_order_sum(_inputs(W, n, dtype, seed=100 * i + k))
            for r in range(W):
                out, sent, recv = per_rank[r]
                what = f"W={W} N={n} {dtype} round {k}, rank {r}"
                assert out[j].dtype == ref.dtype and np.array_equal(out[j], ref), what
                # peers read N - n_r of my inputs and W-1 copies of my finished share
                expect = (n - shares[r] + (W - 1) * shares[r]) * np.dtype(dtype).itemsize
                assert sent[j] == recv[j] == expect, f"bytes counted: {what}"
            total = sum(per_rank[r][1][j] for r in range(W))
            assert total == 2 * (W - 1) * n * np.dtype(dtype).itemsize    # 2(W-1)/W N per rank
            j += 1


def _shared_vs_direct_on_rank(ctx):
    g, W = ctx.world, ctx.world_size
    x = _inputs(W, 2000, "float64", seed=3)[g.rank]
    buf = g.shared("test/vs-direct", x.nbytes)
    buf.local(x.dtype, x.size)[...] = x
    with g.collective("all_reduce", x, reduce_op="avg", algo="direct"):
        mine = direct.all_reduce_shared(buf, x.dtype, x.size, g, "avg").copy()
    return mine, C.all_reduce(x, op="avg", group=g, algo="direct")


def test_all_reduce_shared_equals_direct_all_reduce_bitwise():
    for mine, theirs in spawn(3, _shared_vs_direct_on_rank):
        assert np.array_equal(mine, theirs)


def _direct_bytes(ctx, n):
    g = ctx.world
    s0 = g.stats["bytes_sent"]
    direct.all_reduce(np.ones(n), g)
    s1 = g.stats["bytes_sent"]
    direct.reduce_scatter(np.ones(n), g)
    return s1 - s0, g.stats["bytes_sent"] - s1


@pytest.mark.multiproc
def test_direct_counts_what_peers_read_as_sent():
    """Summed over ranks: all_reduce 2(W-1) N elements (the ring's), reduce_scatter (W-1) N."""
    W, n = 3, 3001
    counts = spawn(W, _direct_bytes, n)
    assert sum(a for a, _ in counts) == 2 * (W - 1) * n * 8
    assert sum(b for _, b in counts) == (W - 1) * n * 8


def _small_and_large(ctx, n, W):
    rng = np.random.default_rng(ctx.rank)
    out = []
    for _ in range(3):                              # several calls: both buffers are reused
        x = rng.standard_normal(n)
        small = direct.all_reduce(x, ctx.world)     # n * 8 <= SMALL_BYTES: the one-wait path
        large = direct.all_reduce(x, ctx.world, buffer_bytes=1 << 12)    # the barrier path
        out.append((small, large))
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [1, 2, 3])
def test_small_message_path_gives_the_same_bits(W):
    from minidist.collectives.direct_small import SMALL_BYTES
    n = SMALL_BYTES // 8
    runs = spawn(W, _small_and_large, n, W)
    for k in range(3):
        xs = [np.random.default_rng(r).standard_normal((3, n))[k] for r in range(W)]
        acc = xs[0].copy()
        for x in xs[1:]:
            acc = acc + x
        for r in range(W):
            small, large = runs[r][k]
            assert np.array_equal(small, acc) and np.array_equal(large, acc), (W, k, r)


def _small_mismatch(ctx):
    x = np.ones(3 if ctx.rank else 4)
    with ctx.world.collective("all_reduce", x, reduce_op="sum", algo="direct"):
        from minidist.collectives import direct_small
        direct_small.all_reduce(x, ctx.world)


@pytest.mark.multiproc
def test_small_message_path_names_a_mismatch():
    from minidist.runtime import RankFailure
    with pytest.raises(RankFailure, match="CollectiveMismatch"):
        spawn(2, _small_mismatch)


def _small_back_to_back(ctx, calls):
    """Many small all_reduces in a row, with ranks drifting apart by random delays: a
    buffer reused too early would mix call k's inputs with call k+2's."""
    import time
    rng = np.random.default_rng(100 + ctx.rank)
    wrong = 0
    for k in range(calls):
        x = np.full(5, float(k * 10 + ctx.rank))
        if rng.random() < 0.2:
            time.sleep(rng.random() * 1e-3)
        got = direct.all_reduce(x, ctx.world)
        W = ctx.world_size
        wrong += int(not np.array_equal(got, np.full(5, k * 10.0 * W + W * (W - 1) / 2)))
    return wrong


@pytest.mark.multiproc
@pytest.mark.parametrize("W", _sweep([2, 4], default=(2,)))
def test_small_message_buffers_are_never_reused_too_early(W):
    assert spawn(W, _small_back_to_back, 300) == [0] * W
