"""The MPI transport runs the same messages (and catches the same mismatches) under mpiexec.

Each test starts an mpiexec job (~0.5 s); the default run keeps the messages and subgroups
at n=2, the rest runs under -m slow."""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import mpiexec_or_skip

pytestmark = pytest.mark.mpi

MPIEXEC = mpiexec_or_skip()

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import minidist
    ctx = minidist.init()
    g = ctx.world
    x = np.arange(100_000.0) * (g.rank + 1)
    with g.collective("shift", x):
        y = g.sendrecv(x, (g.rank + 1) % g.size, (g.rank - 1) % g.size)
    left = (g.rank - 1) % g.size
    assert np.array_equal(y, np.arange(100_000.0) * (left + 1)), "wrong payload"
    assert g.stats["seconds"] > 0, "the call's seconds (the comm column's) were not counted"
    pair = ctx.new_group([0, 1], name="pair")
    if pair is not None:
        acc = np.ones(3)
        pair.recv(1 - pair.rank, acc, combine=np.add) if pair.rank else pair.send(acc * 5, 1)
        if pair.rank == 1:
            assert np.all(acc == 6), acc
    if "--mismatch" in sys.argv:
        with g.collective("all_reduce" if g.rank else "broadcast", x):
            g.sendrecv(x, (g.rank + 1) % g.size, (g.rank - 1) % g.size)
    sys.stdout.write(f"rank {ctx.rank} ok\\n")
""")


def _mpirun(tmp_path, n, *args):
    script = tmp_path / "mpi_script.py"
    script.write_text(SCRIPT)
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_messages_and_subgroups_over_mpi(tmp_path, n):
    res = _mpirun(tmp_path, n)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.split("\n")[:-1]) == [f"rank {r} ok" for r in range(n)]


@pytest.mark.slow
def test_mismatched_calls_over_mpi_raise(tmp_path):
    res = _mpirun(tmp_path, 2, "--mismatch")
    assert res.returncode != 0
    assert "CollectiveMismatch" in res.stderr and "broadcast #2" in res.stderr


DEFAULT_GROUP = textwrap.dedent("""
    import sys
    import numpy as np
    import minidist
    ctx = minidist.init()                                 # README's example, unchanged
    assert minidist.init() is ctx and minidist.get_world_size() == ctx.world_size
    x = np.full(3, float(minidist.get_rank()))
    total = minidist.all_reduce(x)                        # the default group
    minidist.barrier()
    line = f"rank {minidist.get_rank()} of {minidist.get_world_size()}: {total.tolist()}\\n"
    sys.stdout.write(line)                                # one write: lines never interleave
    sys.stdout.flush()
""")


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_the_same_script_runs_under_mpiexec_on_the_default_group(tmp_path, n):
    script = tmp_path / "default_group.py"
    script.write_text(DEFAULT_GROUP)
    res = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    want = [float(sum(range(n)))] * 3
    lines = [line for line in res.stdout.splitlines() if line.startswith("rank ")]
    assert sorted(lines) == [f"rank {r} of {n}: {want}" for r in range(n)], res.stdout
