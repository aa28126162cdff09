"""The public API: input validation, group=None, subgroups, async Work, new arrays, one
header scope per call, and mismatched calls caught by the header."""

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import simulated
from minidist.runtime import RankFailure
from minidist.runtime.launch import spawn

pytestmark = pytest.mark.multiproc

# (what to call, words the ValueError must contain). Run on every rank of a 2-rank job.
BAD_CALLS = [
    (lambda g: C.all_reduce([1.0, 2.0], group=g), "np.asarray"),
    (lambda g: C.all_reduce(np.array([1, "a"], dtype=object), group=g), "object"),
    (lambda g: C.broadcast(np.ones(3), root=-1, group=g), "root=-1"),
    (lambda g: C.reduce(np.ones(3), root=2, group=g), "ranks 0..1"),
    (lambda g: C.gather(np.ones(3), root=True, group=g), "root=True"),
    (lambda g: C.all_reduce(np.ones(3), op="mean", group=g), "'avg'"),
    (lambda g: C.all_reduce(np.ones(3, np.int64), op="avg", group=g), "op='sum'"),
    (lambda g: C.reduce_scatter(np.ones(3, bool), group=g), "int64"),
    (lambda g: C.all_reduce(np.ones(3), algo="fastest", group=g), "'ring'"),
    (lambda g: C.all_gather(np.ones(3), algo="direct", group=g), "'halving'"),
    (lambda g: C.all_reduce(np.ones(3), async_op="yes", group=g), "async_op"),
    (lambda g: C.scatter(np.ones((3, 2)), root=g.rank, group=g), "(2, ...)"),
    (lambda g: C.all_to_all(np.ones(5), group=g), "split_sizes"),
    (lambda g: C.all_to_all(np.ones(5), split_sizes=[2, 2], group=g), "summing to"),
    (lambda g: C.all_to_all(np.ones(4), split_sizes=[5, -1], group=g), "non-negative"),
    (lambda g: C.all_to_all(np.ones(4), split_sizes=[1.5, 2.5], group=g), "integers"),
    (lambda g: C.all_to_all(np.ones(4), split_sizes=[4], group=g), "2 non-negative"),
    (lambda g: C.broadcast(1.0, group=g), "NumPy array"),
    (lambda g: C.all_to_all(np.ones(()), group=g), "0-d"),
]


def _bad_inputs_on_rank(ctx):
    g, messages = ctx.world, []
    for call, _ in BAD_CALLS:
        try:
            call(g)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    # nothing was sent by the failed calls: a valid collective still works afterwards
    return messages, C.all_reduce(np.full(2, g.rank + 1.0), group=g)


def test_bad_input_raises_value_error_saying_how_to_fix_it():
    for messages, total in spawn(2, _bad_inputs_on_rank):
        for (_, words), msg in zip(BAD_CALLS, messages):
            assert msg is not None, f"no ValueError for the call expecting {words!r}"
            assert words in msg, f"{msg!r} should mention {words!r}"
        assert total.tolist() == [3.0, 3.0]


def _world_default_on_rank(ctx):
    """group=None means the world; results are new arrays; non-contiguous input is fine."""
    g, r, W = ctx.world, ctx.rank, ctx.world_size
    base = np.arange(24, dtype=np.float64).reshape(4, 6) * (r + 1)
    x = base[:, ::2]                                       # (4, 3), not C-contiguous
    before = x.copy()
    seq0 = g.seq
    results = {
        "all_reduce": C.all_reduce(x),
        "broadcast": C.broadcast(x, root=W - 1),
        "all_gather": C.all_gather(x),
        "reduce_scatter": C.reduce_scatter(x, op="max"),
        "reduce": C.reduce(x, root=0, op="min"),
        "gather": C.gather(x, root=0),
        "scatter": C.scatter(np.stack([x] * W) if r == 0 else None, root=0),
        "all_to_all": C.all_to_all(np.ascontiguousarray(x[:W])),
        "0-d all_reduce": C.all_reduce(x[1, 2]),            # a 0-d array stays 0-d
        "0-d all_gather": C.all_gather(x[1, 2], algo="halving"),
        "0-d scatter": C.scatter(np.stack([x[1, 2]] * W) if r == 0 else None),
    }
    C.barrier()
    calls = g.seq - seq0                                   # one header scope per call
    shares = [k for k, v in results.items() if v is not None and np.shares_memory(v, base)]
    return results, calls, shares, np.array_equal(x, before)


def test_group_none_is_the_world_and_results_are_new_arrays():
    W = 3
    per_rank = spawn(W, _world_default_on_rank)
    xs = [(np.arange(24, dtype=np.float64).reshape(4, 6) * (r + 1))[:, ::2] for r in range(W)]
    want = {
        "all_reduce": simulated.all_reduce(xs), "broadcast": simulated.broadcast(xs, W - 1),
        "all_gather": simulated.all_gather(xs),
        "reduce_scatter": simulated.reduce_scatter(xs, "max"),
        "reduce": simulated.reduce(xs, 0, "min"), "gather": simulated.gather(xs, 0),
        "scatter": simulated.scatter(np.stack([xs[0]] * W), W),
        "all_to_all": simulated.all_to_all([x[:W] for x in xs], [[1] * W] * W),
        "0-d all_reduce": simulated.all_reduce([x[1, 2] for x in xs]),
        "0-d all_gather": simulated.all_gather([x[1, 2] for x in xs]),
        "0-d scatter": simulated.scatter(np.stack([xs[0][1, 2]] * W), W),
    }
    for r, (results, calls, shares, untouched) in enumerate(per_rank):
        assert calls == len(results) + 1, f"rank {r}: {calls} header scopes for 12 calls"
        assert not shares, f"rank {r}: results share memory with the input: {shares}"
        assert untouched, f"rank {r}: the input was modified"
        for name, got in results.items():
            if want[name][r] is None:
                assert got is None, f"rank {r}: {name} should return None off the root"
            else:
                assert got.shape == want[name][r].shape, f"rank {r}: {name} shape {got.shape}"
                np.testing.assert_allclose(got, want[name][r], rtol=1e-14, err_msg=name)


def _subgroups_on_rank(ctx):
    """Groups {0, 2, 3} and {1, 4} run collectives side by side; roots are group ranks."""
    a = ctx.new_group([0, 2, 3], name="a")
    b = ctx.new_group([1, 4], name="b")
    g = a if a is not None else b
    x = np.arange(5, dtype=np.float64) + 10 * ctx.rank
    return (g.name, g.ranks, C.all_reduce(x, group=g, algo="ring"),
            C.broadcast(x, root=1, group=g), C.reduce_scatter(x, group=g, algo="halving"),
            C.all_reduce(x, group=g, algo="direct"), C.all_reduce(x, op="max"))


def test_subgroups():
    per_rank = spawn(5, _subgroups_on_rank)
    xs = [np.arange(5, dtype=np.float64) + 10 * r for r in range(5)]
    for r, (name, ranks, summed, bcast, part, canon, world_max) in enumerate(per_rank):
        assert ranks == ((0, 2, 3) if r in (0, 2, 3) else (1, 4)) and name in "ab"
        members = [xs[m] for m in ranks]
        me = ranks.index(r)
        np.testing.assert_allclose(summed, simulated.all_reduce(members)[me], rtol=1e-14)
        assert np.array_equal(bcast, xs[ranks[1]]), f"rank {r}: root=1 is group rank 1"
        np.testing.assert_allclose(part, simulated.reduce_scatter(members)[me], rtol=1e-14)
        assert np.array_equal(canon, simulated.all_reduce(members)[me])
        assert np.array_equal(world_max, xs[4])


def _async_on_rank(ctx):
    g, r = ctx.world, ctx.rank
    works = [C.all_reduce(np.full(1000, float(r + k)), group=g, async_op=True, algo=algo)
             for k, algo in enumerate(["ring", "tree", "halving", "direct"])]
    works.append(C.broadcast(np.full(3, float(r)), root=1, group=g, async_op=True))
    works.append(C.barrier(group=g, async_op=True))
    sync = C.all_gather(np.array([r]), group=g)          # runs after the queued calls
    results = [w.wait(timeout=30) for w in works]
    return results, sync, all(w.is_completed() for w in works)


def test_async_work_returns_results_in_order():
    W = 3
    for r, (results, sync, done) in enumerate(spawn(W, _async_on_rank)):
        assert done
        for k in range(4):
            assert np.array_equal(results[k], np.full(1000, float(sum(range(W)) + W * k)))
        assert np.array_equal(results[4], np.full(3, 1.0)) and results[5] is None
        assert sync.tolist() == [[0], [1], [2]]


def _async_error_on_rank(ctx):
    work = C.all_reduce(np.ones(3), op="avg", group=ctx.world, async_op=True)
    try:
        C.all_reduce(np.ones(3, np.int64), op="avg", group=ctx.world, async_op=True)
    except ValueError:
        pass                                               # validated before it is queued
    return work.wait(timeout=30)


def test_async_validates_before_queueing():
    for y in spawn(2, _async_error_on_rank):
        assert y.tolist() == [1.0, 1.0, 1.0]


def _mismatch_on_rank(ctx):
    return C.all_reduce(np.ones(3), group=ctx.world, algo="ring" if ctx.rank else "tree")


def test_ranks_choosing_different_algorithms_is_a_mismatch_not_a_hang():
    with pytest.raises(RankFailure, match="CollectiveMismatch"):
        spawn(2, _mismatch_on_rank, collective_timeout=10.0)
