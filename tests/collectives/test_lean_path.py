"""The lean call path (collectives/prepared.py): a repeated signature skips
validation, yet gives the same bits, and mismatches, deadlines and the flight recorder
still work on it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from minidist import collectives as C
from minidist.runtime import RankFailure, call
from minidist.runtime.flight import DEPTH
from minidist.runtime.launch import spawn

pytestmark = pytest.mark.multiproc


def _plain_then_lean(ctx):
    g, rng = ctx.world, np.random.default_rng(ctx.rank)
    outs = []
    for dtype, shape, op in [(np.float32, (3,), "sum"), (np.float64, (2, 2), "avg"),
                             (np.int64, (), "max"), (np.float32, (1000,), "prod")]:
        x = rng.standard_normal(shape).astype(dtype) if dtype != np.int64 else \
            np.asarray(rng.integers(-9, 9), dtype)
        before = len(g.prepared)
        first = C.all_reduce(x, op=op, group=g)                 # plain path, then remembered
        assert len(g.prepared) == before + 1
        again = [C.all_reduce(x, op=op, group=g) for _ in range(3)]    # lean path
        assert len(g.prepared) == before + 1
        outs.append((first, again))
    return outs


def test_the_lean_path_gives_the_plain_paths_bits_and_new_arrays():
    for rank_outs in spawn(3, _plain_then_lean):
        for first, again in rank_outs:
            for a in again:
                assert a.dtype == first.dtype and a.shape == first.shape
                assert a.tobytes() == first.tobytes()
                assert a is not first and not np.shares_memory(a, first)


def _remembers(ctx):
    from minidist.collectives import cost
    g = ctx.world
    C.all_reduce(np.ones(4, np.float32), group=g)             # auto -> direct by cost.rule
    C.all_reduce(np.ones(8192, np.float32), group=g)          # auto by the formulas
    C.all_reduce(np.ones(8192, np.float32), group=g, algo="ring")        # explicit
    C.all_reduce(np.ones(4, np.float32), group=g, async_op=True).wait()  # async: no
    keys = sorted(((k[2], k[4]) for k in g.prepared), key=str)
    with_constants = [k[4] for k, run in g.prepared.items()
                      if run.constants is cost.constants(2)]
    return keys, with_constants


def test_synchronous_calls_are_remembered_and_formula_choices_with_their_constants():
    keys, with_constants = spawn(2, _remembers)[0]
    assert keys == [("auto", (4,)), ("auto", (8192,)), ("ring", (8192,))]
    assert with_constants == [(8192,)]                 # the formulas' choice: keyed by them


def _lean_then_errors(ctx):
    g, x = ctx.world, np.ones(3, np.float32)
    for _ in range(3):
        C.all_reduce(x, group=g)
    for _ in range(3):
        C.all_reduce(x, op="max", group=g)
    out = C.all_reduce(x[::-1][::-1].copy()[::1], group=g)           # same signature
    strided = np.ones(6, np.float32)[::2]                               # not contiguous
    assert np.array_equal(C.all_reduce(strided, group=g), [2, 2, 2])
    with pytest.raises(ValueError, match="unknown op"):
        C.all_reduce(x, op=["sum"], group=g)                            # unhashable: plain
    return out.tolist()


def test_a_strided_input_or_a_bad_argument_after_warm_up_takes_the_plain_path():
    assert spawn(2, _lean_then_errors) == [[2.0, 2.0, 2.0]] * 2


def _mismatch_on_the_lean_path(ctx, what):
    g, x = ctx.world, np.ones(3, np.float32)
    for op in ("sum", "max"):                   # both signatures warmed up on both ranks
        for _ in range(3):
            C.all_reduce(x, op=op, group=g)
    for _ in range(3):
        C.all_reduce(np.ones(5, np.float32), group=g)
    if what == "op":
        C.all_reduce(x, op="max" if ctx.rank == 1 else "sum", group=g)
    else:
        C.all_reduce(np.ones(5 if ctx.rank == 1 else 3, np.float32), group=g)


@pytest.mark.parametrize("what", ["op", "shape"])
def test_a_mismatch_on_the_lean_path_names_both_calls(what):
    with pytest.raises(RankFailure) as info:
        spawn(2, _mismatch_on_the_lean_path, what)
    text = str(info.value)
    assert "CollectiveMismatch" in text and "all_reduce #10 on 'world'" in text
    if what == "op":
        assert "op sum" in text and "op max" in text
    else:
        assert "float32 (3,)" in text and "float32 (5,)" in text


def _hang_on_the_lean_path(ctx):
    x = np.ones(2, np.float32)
    for _ in range(5):
        C.all_reduce(x)
    if ctx.rank == 1:
        time.sleep(30)                          # hung: never makes call #6
    C.all_reduce(x)


# slow: it asserts the wall time of the failure (< 4 s), which a loaded machine can exceed;
# hung-rank reports stay in the default run through tests/runtime/, a timed-out receive
# through test_p2p.py
@pytest.mark.slow
def test_a_deadline_on_the_lean_path_names_the_hung_rank_and_its_last_calls():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(2, _hang_on_the_lean_path, collective_timeout=1.0)
    assert time.monotonic() - t0 < 1.0 + 3.0
    e, text = info.value, str(info.value)
    assert e.rank == 1 and text.startswith("rank 1 of 2 is hung")
    assert "all_reduce #6 on 'world' (float32 (2,), op sum, algo direct) waited 1 s" in text
    assert "flight recorder" in text and "started" in text


def _flight(ctx):
    g, x = ctx.world, np.ones(2, np.float32)
    for _ in range(DEPTH + 3):
        C.all_reduce(x, group=g)
    recs = g.records.recorder.last(ctx.rank, 3)
    return [(call.describe(r, g.group_names), int(r[call.STATE]), r[call.T_END] >= r[call.T_START])
            for r in recs]


def test_the_flight_recorder_keeps_every_lean_call():
    rows = spawn(2, _flight)[0]                 # calls #1 .. #DEPTH+3: the last three
    assert [r[0] for r in rows] == [f"all_reduce #{DEPTH + 1 + i} on 'world' (float32 (2,), "
                                    "op sum, algo direct)" for i in range(3)]
    assert all(state == call.DONE and ordered for _, state, ordered in rows)
