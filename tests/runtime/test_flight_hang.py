"""The hang in one sentence (runtime/flight.py, hang_sentence and FlightRecorder.diagnose):
exact sentences for hand-made flight records, and the sentence that leads a real timeout's
report, right under the launcher's headline.

The real timeouts run under -m slow only: their exact sentence depends on timing. All the
waiting ranks share the 1 s deadline, so one of them may time out and end its call while
the first one writes the report, and a waiting rank starved of CPU for 0.5 s (the
heartbeat's STALE) reads as hung. A rank whose wait ended in its own timeout is still "in"
its call (its record says FAILED, not DONE), so only the starved rank's case differs."""

import os
import re
import signal
import time

import numpy as np
import pytest

import minidist.collectives as C
from minidist.runtime import RankFailure, call, spawn
from minidist.runtime.flight import _current, hang_sentence

NAMES = {0: "world", 3: "tp1"}


def rec(op: str, gid: int, seq: int, running: bool = True, state: int | None = None):
    r = call.pack(gid, seq, op, np.zeros(4))
    r[call.STATE] = state if state is not None else call.STARTED if running else call.DONE
    return r


def test_the_issue_example():
    now = {0: rec("all_reduce", 3, 18), 1: rec("all_reduce", 3, 18),
           2: rec("all_reduce", 3, 17), 3: rec("all_reduce", 3, 18)}
    assert hang_sentence(now, NAMES, hung=(2,)) == \
        "rank 2 is stuck in all_reduce #17 on 'tp1'; ranks 0, 1, 3 are in #18."


@pytest.mark.parametrize("now, hung, sentence", [
    ({0: rec("barrier", 0, 1), 1: None, 2: rec("barrier", 0, 1)}, (1,),
     "rank 1 has made no collective call; ranks 0, 2 are in barrier #1 on 'world'."),
    ({0: rec("all_reduce", 0, 3), 1: rec("all_reduce", 0, 2, running=False)}, (1,),
     "rank 1 finished all_reduce #2 on 'world' and has made no call since; rank 0 is in #3."),
    ({0: rec("all_reduce", 3, 5), 1: rec("all_reduce", 3, 5), 2: rec("barrier", 0, 9)}, (0, 1),
     "ranks 0, 1 are stuck in all_reduce #5 on 'tp1'; rank 2 is in barrier #9 on 'world'."),
    ({r: rec("all_gather", 7, 4) for r in range(8) if r != 5} | {5: None}, (5,),
     "rank 5 has made no collective call; ranks 0-4, 6, 7 are in all_gather #4 on 'group#7'."),
    ({0: rec("send", 3, 1), 1: rec("recv", 3, 1)}, (),
     "rank 0 is in send #1 on 'tp1'; rank 1 is in recv #1 on 'tp1'."),
    ({0: None, 1: None}, (), "ranks 0, 1 have made no collective call."),
    # rank 2 timed out too while rank 0 wrote the report: its call FAILED, it never left it
    ({0: rec("barrier", 0, 2), 1: rec("barrier", 0, 1, running=False),
      2: rec("barrier", 0, 2, state=call.FAILED)}, (1,),
     "rank 1 finished barrier #1 on 'world' and has made no call since; ranks 0, 2 are in #2."),
])
def test_sentences_from_hand_made_records(now, hung, sentence):
    assert hang_sentence(now, NAMES, hung) == sentence


def test_a_running_async_call_wins_over_a_newer_finished_one():
    ring = [rec("all_reduce", 1, 4), rec("all_reduce", 3, 9, running=False)]
    assert _current(ring) is ring[0]
    assert _current([ring[1]]) is ring[1] and _current([]) is None


def _sleeps_in_tp(ctx):
    """tp groups (0, 1) and (2, 3); rank 2 sleeps after its first tp all-reduce."""
    tp = [ctx.new_group([0, 1], name="tp0"), ctx.new_group([2, 3], name="tp1")][ctx.rank // 2]
    C.all_reduce(np.ones(4), group=tp)
    if ctx.rank == 2:
        time.sleep(30)
    C.all_reduce(np.ones(4), group=tp)
    C.barrier(group=ctx.world)


def _leading_sentence(fn, *args) -> str:
    with pytest.raises(RankFailure) as info:
        spawn(4, fn, *args, collective_timeout=1.0)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("rank ") and " of 4 is hung: " in lines[0], lines[0]
    m = re.fullmatch(r"  CollectiveTimeout: \[rank \d/4\] (.*)", lines[1])
    assert m, lines[1]
    return m.group(1)


@pytest.mark.slow                  # timing: see the module docstring
@pytest.mark.multiproc
def test_a_real_hang_on_a_subgroup_is_said_in_one_sentence():
    # world's calls #1, #2 made the two tp groups; the barrier is #3
    assert _leading_sentence(_sleeps_in_tp) == (
        "rank 2 finished all_reduce #1 on 'tp1' and has made no call since; ranks 0, 1 are in "
        "barrier #3 on 'world'; rank 3 is in all_reduce #2 on 'tp1'.")


def _stops_inside_a_barrier(ctx):
    g = ctx.world
    C.all_reduce(np.ones(4), group=g)
    if ctx.rank == 1:                       # enters barrier #2, then stops inside it
        with g.collective("barrier", None):
            os.kill(os.getpid(), signal.SIGSTOP)
    C.barrier(group=g)


@pytest.mark.slow                  # timing: see the module docstring
@pytest.mark.multiproc
def test_a_rank_stopped_inside_a_call_is_stuck_in_it():
    assert _leading_sentence(_stops_inside_a_barrier) == \
        "rank 1 is stuck in barrier #2 on 'world'; ranks 0, 2, 3 are in #2."
