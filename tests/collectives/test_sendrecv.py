"""Public sendrecv: a shift around the group, numbered like any call, that cannot deadlock at
any message size (also queued on the async worker), whose header the receiver checks, and
that runs over MPI too."""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minidist import collectives as C
from minidist.runtime import RankFailure
from minidist.runtime import call
from minidist.runtime.launch import spawn
from tests.helpers import mpiexec_or_skip, value_errors

BIG = 100_000            # float64: 800 kB, far more than a mailbox holds (runtime/p2p.py)


def _shifts(ctx):
    """Every shift s = 1..W-1, synchronous and then all queued at once on the worker."""
    g = ctx.world
    r, W = g.rank, g.size
    mine = [np.arange(BIG, dtype=float) + 1000 * r + s for s in range(W)]
    got = [C.sendrecv(mine[s], (r + s) % W, (r - s) % W, group=g, tag=s)[:2].tolist()
           for s in range(1, W)]
    before = g.stats["bytes_sent"]
    works = [C.sendrecv(mine[s], (r + s) % W, (r - s) % W, out=np.empty(BIG), group=g,
                        async_op=True) for s in range(1, W)]
    got += [w.wait()[:2].tolist() for w in works]
    return got, g.stats["bytes_sent"] - before


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2, 3])
def test_shifts_deliver_the_peers_x_at_any_size_sync_and_queued(W):
    for r, (got, sent) in enumerate(spawn(W, _shifts)):
        want = [[1000 * ((r - s) % W) + s + k for k in (0, 1)] for s in range(1, W)]
        assert got == want + want, f"rank {r}"
        assert sent == (W - 1) * BIG * 8, f"rank {r}: bytes of the queued shifts"


def _another_tag(ctx):
    g = ctx.world
    C.sendrecv(np.ones(3), 1 - g.rank, 1 - g.rank, group=g, tag=g.rank)   # 0 vs 1


@pytest.mark.multiproc
def test_a_shift_with_another_tag_is_a_mismatch_naming_both_calls():
    with pytest.raises(RankFailure) as info:
        spawn(2, _another_tag)
    text = str(info.value)
    assert "CollectiveMismatch" in text
    for r in (0, 1):
        assert (f"sendrecv #1 on 'world' (float64 (3,), from group rank {1 - r}, to group "
                f"rank {1 - r}, tag {r})") in text


def _bad_arguments(ctx):
    g = ctx.world
    if g.rank == 1:
        return []
    return value_errors(
        lambda: C.sendrecv(np.ones(2), 0, 1, group=g),
        lambda: C.sendrecv(np.ones(2), 1, 2, group=g),
        lambda: C.sendrecv(np.ones(2), 1, 1, group=g, tag=-1),
        lambda: C.sendrecv(np.ones(2), 1, 1, out=np.ones(3), group=g),
        lambda: C.sendrecv(np.ones(2), 1, 1, out=np.ones(2, np.float32), group=g))


@pytest.mark.multiproc
def test_bad_peers_tags_and_buffers_are_refused_before_anything_is_sent():
    errors = spawn(2, _bad_arguments)[0]
    assert len(errors) == 5
    assert "dst=0 must be another rank" in errors[0] and "src=2" in errors[1]
    assert "tag" in errors[2] and "(3,)" in errors[3] and "float32" in errors[4]


def test_the_ends_of_one_shift_have_one_identity_and_another_tag_does_not():
    x = np.zeros((2, 3))
    at_1 = call.pack(5, 7, "sendrecv", x, p2p=(0, 2, 1))    # rank 1 of 3: from 0, to 2
    at_2 = call.pack(5, 7, "sendrecv", x, p2p=(1, 0, 1))    # rank 2: from 1, to 0
    assert call.same_call(at_1, at_2)
    assert not call.same_call(at_1, call.pack(5, 7, "sendrecv", x, p2p=(1, 0, 2)))
    assert not call.same_call(at_1, call.pack(5, 7, "send", x, p2p=(1, 2, 1)))
    assert call.describe(at_1, {5: "tp"}) == \
        "sendrecv #7 on 'tp' (float64 (2, 3), from group rank 0, to group rank 2, tag 1)"


MPI_SCRIPT = textwrap.dedent("""
    import numpy as np
    import minidist
    from minidist import collectives as C
    ctx = minidist.init()
    g = ctx.world
    r, W = g.rank, g.size
    x = np.arange(50_000.0) + 1000 * r
    y = C.sendrecv(x, (r + 1) % W, (r - 1) % W, group=g, tag=1)
    works = [C.sendrecv(x + s, (r + s) % W, (r - s) % W, group=g, async_op=True)
             for s in range(1, W)]
    got = [w.wait()[0] for w in works]
    assert y[0] == 1000 * ((r - 1) % W), y[0]
    assert got == [1000 * ((r - s) % W) + s for s in range(1, W)], got
    print(f"rank {r} ok", flush=True)
""")


@pytest.mark.mpi
def test_shifts_over_mpi(tmp_path):
    exe = mpiexec_or_skip()
    script = tmp_path / "sendrecv.py"
    script.write_text(MPI_SCRIPT)
    res = subprocess.run([exe, "-n", "3", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    # (mpiexec may interleave the ranks' lines: look for each report anywhere)
    assert sorted(re.findall(r"rank \d ok", res.stdout)) == [f"rank {r} ok" for r in range(3)], \
        res.stdout
