"""The same collective algorithms over the MPI transport (runtime/mpi.py), under mpiexec:
every collective x every message-based algorithm against the oracle, on 3 ranks."""

import re
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import mpiexec_or_skip

pytestmark = pytest.mark.mpi

MPIEXEC = mpiexec_or_skip()

SCRIPT = textwrap.dedent("""
    import numpy as np
    import minidist
    from minidist import collectives as C
    from minidist.collectives import cost, simulated

    ctx = minidist.init()
    g, W, r = ctx.world, ctx.world.size, ctx.world.rank
    checked = 0
    for n in (0, 1, W + 1, 1000):
        for dtype in ("float64", "int64"):
            rng = np.random.default_rng(n)
            xs = [rng.integers(-9, 9, n).astype(dtype) for _ in range(W)]
            want = {"all_reduce": simulated.all_reduce(xs), "broadcast": simulated.broadcast(xs, 1),
                    "reduce": simulated.reduce(xs, 2, "max"),
                    "reduce_scatter": simulated.reduce_scatter(xs),
                    "all_gather": simulated.all_gather(xs), "gather": simulated.gather(xs, 1),
                    "scatter": simulated.scatter(np.stack(xs), W)}
            for op, algos in cost.ALGOS.items():
                for algo in algos:
                    if op == "all_to_all" or algo == "direct":
                        continue
                    got = {"all_reduce": lambda: C.all_reduce(xs[r], group=g, algo=algo),
                           "broadcast": lambda: C.broadcast(xs[r], 1, group=g, algo=algo),
                           "reduce": lambda: C.reduce(xs[r], 2, "max", group=g, algo=algo),
                           "reduce_scatter": lambda: C.reduce_scatter(xs[r], group=g, algo=algo),
                           "all_gather": lambda: C.all_gather(xs[r], group=g, algo=algo),
                           "gather": lambda: C.gather(xs[r], 1, group=g, algo=algo),
                           "scatter": lambda: C.scatter(np.stack(xs) if r == 0 else None,
                                                        group=g, algo=algo)}[op]()
                    exp = want[op][r]
                    assert (got is None and exp is None) or np.array_equal(got, exp), (op, algo, n)
                    checked += 1
    splits = [[(s + d) % 3 for d in range(W)] for s in range(W)]
    xs = [np.arange(sum(sp), dtype=float) + 100 * s for s, sp in enumerate(splits)]
    got = C.all_to_all(xs[r], split_sizes=splits[r], group=g)
    assert np.array_equal(got, simulated.all_to_all(xs, splits)[r])
    try:
        C.all_reduce(np.ones(3), group=g, algo="direct")
        raise AssertionError("direct should need shared memory")
    except NotImplementedError as e:
        assert "shared" in str(e)
    print(f"rank {r} ok {checked + 1}", flush=True)
""")


def test_collectives_over_mpi(tmp_path):
    script = tmp_path / "mpi_collectives.py"
    script.write_text(SCRIPT)
    res = subprocess.run([MPIEXEC, "-n", "3", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # 4 lengths x 2 dtypes x 13 (collective, algorithm) pairs, + 1 all_to_all
    # (mpiexec may interleave the ranks' lines, so look for each report anywhere)
    assert sorted(re.findall(r"rank \d ok \d+", res.stdout)) == \
        [f"rank {r} ok 105" for r in range(3)], res.stdout
