"""all_to_all with uneven, per-rank split sizes (as mixture-of-experts routing makes them),
against the oracle; counts exchanged by the collective or given by the caller.

The default run keeps W=1, 2 and 3 (the cheap ones: one rank, a pair, an odd count); W=4, 5
and 8 are in the slow set."""

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import simulated
from minidist.runtime.launch import spawn

pytestmark = pytest.mark.multiproc

WORLD_SIZES = [1, 2, 3, 4, 5, 8]
DEFAULT_WORLD_SIZES = (1, 2, 3)


def _case(W, seed, dtype, rest):
    """Per-rank split sizes (zeros included) and inputs of matching row counts."""
    rng = np.random.default_rng(seed)
    splits = [[int(s) for s in rng.integers(0, 4, W) * rng.integers(0, 2, W)] for _ in range(W)]
    xs = [rng.standard_normal((sum(sp), *rest)).astype(dtype) for sp in splits]
    return splits, xs


CASES = [(seed, dtype, rest) for seed, (dtype, rest) in
         enumerate([("float64", ()), ("float32", (3,)), ("int64", (2, 2)), ("float64", (5,))])]


def _a2a_on_rank(ctx):
    g, W, r = ctx.world, ctx.world_size, ctx.rank
    out = []
    for seed, dtype, rest in CASES:
        splits, xs = _case(W, seed, dtype, rest)
        asked = C.all_to_all(xs[r], split_sizes=splits[r], group=g)          # counts exchanged
        recv = [splits[s][r] for s in range(W)]
        told = C.all_to_all(xs[r], split_sizes=splits[r], group=g, recv_sizes=recv)
        counts = C.all_to_all(np.array(splits[r]), group=g)                   # the idiom
        out.append((asked, told, counts))
    even = np.arange(3 * W * 2, dtype=np.float64).reshape(3 * W, 2) + 100 * r
    out.append(C.all_to_all(even, group=g))
    return out


@pytest.mark.parametrize("W", [W if W in DEFAULT_WORLD_SIZES else
                               pytest.param(W, marks=pytest.mark.slow) for W in WORLD_SIZES])
def test_all_to_all_uneven_matches_the_oracle(W):
    per_rank = spawn(W, _a2a_on_rank)
    for i, (seed, dtype, rest) in enumerate(CASES):
        splits, xs = _case(W, seed, dtype, rest)
        want = simulated.all_to_all(xs, splits)
        for r in range(W):
            asked, told, counts = per_rank[r][i]
            what = f"W={W} case {i} rank {r} splits {splits}"
            assert asked.dtype == want[r].dtype and asked.shape == want[r].shape, what
            assert np.array_equal(asked, want[r]), what
            assert np.array_equal(told, want[r]), what + " (recv_sizes given)"
            assert counts.tolist() == [splits[s][r] for s in range(W)], what
    evens = [np.arange(3 * W * 2, dtype=np.float64).reshape(3 * W, 2) + 100 * r
             for r in range(W)]
    want = simulated.all_to_all(evens, [[3] * W] * W)
    for r in range(W):
        assert np.array_equal(per_rank[r][-1], want[r]), f"even split, rank {r}"
