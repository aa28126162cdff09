"""Every collective x every algorithm x awkward world sizes, lengths and dtypes, against the oracle.

Launching processes is the expensive part, so each world size is ONE spawn: every
rank walks the same list of cases, calls the public API with an explicit algorithm,
compares its result with simulated.py (every rank can build every rank's input from
the case's seed), and returns per case an error text (or None) and a digest of its
result. The test then names every failing case, and checks that results meant to be
replicated (all_reduce, broadcast, all_gather) are bitwise identical on every rank.

The default run keeps W=3 (the smallest world that is not a power of two: every collective
and every algorithm, halving with its fold of the extra rank); W=1, 2, 4, 5 and 8 are in the
slow set.
"""

import hashlib

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import cost, simulated
from minidist.runtime.launch import spawn
from tests.helpers import assert_close

pytestmark = pytest.mark.multiproc

WORLD_SIZES = [1, 2, 3, 4, 5, 8]                 # 1 and non-powers of two on purpose
DEFAULT_WORLD_SIZES = (3,)                       # the smallest non-power of two
DTYPES = ["float64", "float32", "int64"]
TOL = {"float64": 1e-12, "float32": 1e-5, "int64": 0.0}
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
REPLICATED = ("all_reduce", "broadcast", "all_gather")


def _shapes(W):
    """Lengths 0, 1, W-1 (N < W: empty chunks), W+1 (N % W != 0), and a 2-D few thousand."""
    lengths = sorted({0, 1, W - 1, W + 1})
    return [(n,) for n in lengths] + [(7, 429)]


def _inputs(case):
    """Every rank's input for a case, from the case's seed alone (same on every rank)."""
    W, shape, dtype, op = case["W"], case["shape"], case["dtype"], case["op"]
    rng = np.random.default_rng(case["seed"])
    xs = []
    for _ in range(W):
        if dtype == "int64":
            lo, hi = (-3, 4) if op == "prod" else (-1000, 1000)
            xs.append(rng.integers(lo, hi, shape).astype(dtype))
        else:                                    # prod near 1: 8 factors neither blow up nor vanish
            x = rng.standard_normal(shape)
            xs.append((1 + 0.05 * x if op == "prod" else x).astype(dtype))
    return xs


def _cases(W):
    cases = []

    def add(coll, algo, shape, dtype, op="sum"):
        seed = len(cases)
        cases.append(dict(coll=coll, algo=algo, W=W, shape=shape, dtype=dtype, op=op,
                          root=seed % W, seed=seed))

    for coll, algos in cost.ALGOS.items():
        if coll == "all_to_all":
            continue                             # uneven splits: test_all_to_all.py
        for algo in (*algos, "auto"):
            for shape in _shapes(W):
                for dtype in DTYPES:
                    add(coll, algo, shape, dtype)
            if algo == "ring" and coll in ("broadcast", "reduce"):   # 3 pipeline pieces
                add(coll, algo, (20001,), "float64")
            if coll in REDUCING:                 # every op, on an awkward length
                for op in ("avg", "max", "min", "prod"):
                    for dtype in DTYPES:
                        if not (op == "avg" and dtype == "int64"):
                            add(coll, algo, (W + 1,), dtype, op)
    return cases


def _name(case):
    shape = "x".join(map(str, case["shape"]))
    return (f"{case['coll']}/{case['algo']} W={case['W']} N={shape} {case['dtype']} "
            f"op={case['op']} root={case['root']}")


def _call(case, x, group):
    coll, algo, op, root = case["coll"], case["algo"], case["op"], case["root"]
    if coll in ("all_reduce", "reduce_scatter"):
        return getattr(C, coll)(x, op=op, group=group, algo=algo)
    if coll == "reduce":
        return C.reduce(x, root=root, op=op, group=group, algo=algo)
    if coll in ("broadcast", "gather"):
        return getattr(C, coll)(x, root=root, group=group, algo=algo)
    if coll == "all_gather":
        return C.all_gather(x, group=group, algo=algo)
    if coll == "scatter":                        # every rank's x stacked is the root's xs
        return C.scatter(x if group.rank == root else None, root=root, group=group, algo=algo)
    raise AssertionError(coll)


def _expected(case, xs):
    coll, op, root, W = case["coll"], case["op"], case["root"], case["W"]
    if coll == "scatter":
        return simulated.scatter(xs[root], W)
    if coll in ("all_reduce", "reduce_scatter"):
        return getattr(simulated, coll)(xs, op)
    if coll == "reduce":
        return simulated.reduce(xs, root, op)
    if coll in ("broadcast", "gather"):
        return getattr(simulated, coll)(xs, root)
    return simulated.all_gather(xs)


def _check(case, got, want, x_before, x_after):
    """An error text, or None when `got` matches `want` (dtype, shape, values)."""
    if not np.array_equal(x_before, x_after):
        return "the input was modified"
    if want is None:
        return None if got is None else f"expected None, got {type(got).__name__}"
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype:
        return f"expected {want.dtype} array, got {getattr(got, 'dtype', type(got))}"
    try:                                         # direct folds in the oracle's order: bitwise
        tol = 0.0 if case["algo"] == "direct" else TOL[case["dtype"]]
        assert_close(got, want, atol=tol, rtol=tol, what="value")
    except AssertionError as e:
        return str(e)
    return None


def _digest(a):
    return None if a is None else hashlib.sha1(a.tobytes() + repr(a.shape).encode()).hexdigest()


def _rank_inputs(case):
    xs = _inputs(case)
    return [np.stack(xs)] * case["W"] if case["coll"] == "scatter" else xs   # root's (W, ...)


def _sweep_on_rank(ctx):
    g, out = ctx.world, {}
    for case in _cases(g.size):
        x = _rank_inputs(case)[g.rank]
        try:
            got = _call(case, x, g)
        except Exception as e:                   # name the case in the rank's error
            raise RuntimeError(f"{_name(case)}: {type(e).__name__}: {e}") from e
        fresh = _rank_inputs(case)               # regenerated: untouched by the call
        err = _check(case, got, _expected(case, fresh)[g.rank], fresh[g.rank], x)
        out[_name(case)] = (err, _digest(got))
    return out


@pytest.mark.parametrize("W", [W if W in DEFAULT_WORLD_SIZES else
                               pytest.param(W, marks=pytest.mark.slow) for W in WORLD_SIZES])
def test_every_collective_and_algorithm_matches_the_oracle(W):
    per_rank = spawn(W, _sweep_on_rank)
    failures = [f"rank {r}: {name}: {err}" for r, res in enumerate(per_rank)
                for name, (err, _) in res.items() if err]
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:40])
    for name, (_, digest0) in per_rank[0].items():
        if name.split("/")[0] in REPLICATED:
            differ = [r for r in range(1, W) if per_rank[r][name][1] != digest0]
            assert not differ, f"{name}: ranks {differ} differ bitwise from rank 0"
    assert len(per_rank[0]) == len(_cases(W)) > 300
