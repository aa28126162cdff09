"""The schedule family: every pipeline schedule by name, what each needs, and what each
claims (bubble, activation memory, point-to-point volume), with its source.

    name         built by                    placement  B split  bubble    memory  p2p
    gpipe        schedules.gpipe             loop       no       1         M/P     1
    1f1b         schedules.one_f_one_b       loop       no       1         1       1
    interleaved  schedules.interleaved_1f1b  loop, V    no       1/V       > 1     V
    zb-h1        schedules.zero_bubble_h1    loop       yes      1/3       1       1
    zb-h2        schedules.zero_bubble_h2    loop       yes      0         2       1
    zb-1p        schedule_auto, memory P     loop       yes      1/3       1       1
    zb-2p        schedule_auto, memory 2P    loop       yes      0         2       1
    zbv          schedule_auto, memory P     v          yes      0         1       2
    v-half       controllable_memory         v          yes      1/2       1/2     2
    v-min        controllable_memory         v          yes      2/3       1/3     2
    dualpipe     dualpipe.dualpipe           dual       part     see below (P+1)/P 1
    dualpipev    dualpipe.dualpipe_v         v          part     see below (2P+1)/2P 2

bubble: the steady-state bubble rate (schedule_sim.Timeline.steady_bubble) at F = B = W
and M >= 2P, in units of 1F1B's (P-1)/M; memory: peak activations in units of 1F1B's
(P micro-batches of a stage); p2p: messages per micro-batch in units of 1F1B's. These are
the claims of Qi et al. (arXiv:2401.10241, Secs. 2-3; the zero-bubble repository's
table; arXiv:2405.15362 for ZBV, V-Half and V-Min); tests/parallel/pipeline/test_family.py
measures each against the simulator and says where this implementation falls short (ZBV:
its greedy leaves a small tail, 0.06-0.23 of 1F1B's bubble for P <= 8, where the paper
reports 0). V-Half's and V-Min's are the paper's limits for many stages: their building
blocks hold P + 2 (P + 1 for odd P) and about 2P/3 + 2 chunk activations (half a stage
each), so at P = 8
V-Half holds 5/8 of 1F1B's and V-Min 1/2, and 0.53 and 0.38 at P = 32; their one-step
bubbles stay under 1/2 and 2/3 of 1F1B's for every P tested.

DualPipe and DualPipeV (dualpipe.py) overlap a forward with a backward (FB actions) and
split only some backwards; their bubble is DeepSeek-V3's Table 2 formula, which
test_dualpipe.py checks; DualPipe also holds two copies of every parameter.

Every schedule but the DualPipes runs for any P >= 1 and M >= 1; the handcrafted ones
reach their bubble for M >= P (ZB-H2: M >= 2P-1), the automatic ones are searched for the
given P and M. DualPipe needs an even P and an even M >= 2P; DualPipeV an even M >= 2P.
Read next: schedules.py (the handcrafted generators), schedule_auto.py (the others).
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Mapping

from minidist.parallel.pipeline.controllable_memory import controllable_memory
from minidist.parallel.pipeline.dualpipe import dualpipe, dualpipe_v
from minidist.parallel.pipeline.schedule_auto import auto_schedule
from minidist.parallel.pipeline.schedules import (PipelineSchedule, gpipe, interleaved_1f1b,
                                                  one_f_one_b, pieces_of, zero_bubble_h1,
                                                  zero_bubble_h2)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zbv",
             "v-half", "v-min", "dualpipe", "dualpipev")
CHUNKS = {"interleaved": None, "zbv": 2, "v-half": 2, "v-min": 2, "dualpipe": 2,
          "dualpipev": 2}                                                # None: V; else 1
PLACEMENT = {"zbv": "v", "v-half": "v", "v-min": "v", "dualpipev": "v",
             "dualpipe": "dual"}                                         # else "loop"

# (bubble, memory, p2p) of the table above, as exact fractions (None: depends on V)
CLAIMS = {
    "1f1b": (Fraction(1), Fraction(1), Fraction(1)),
    "zb-h1": (Fraction(1, 3), Fraction(1), Fraction(1)),
    "zb-h2": (Fraction(0), Fraction(2), Fraction(1)),
    "zb-1p": (Fraction(1, 3), Fraction(1), Fraction(1)),
    "zb-2p": (Fraction(0), Fraction(2), Fraction(1)),
    "zbv": (Fraction(0), Fraction(1), Fraction(2)),
    "v-half": (Fraction(1, 2), Fraction(1, 2), Fraction(2)),
    "v-min": (Fraction(2, 3), Fraction(1, 3), Fraction(2)),
}


# the automatic ones: P -> (memory limit in activation units, placement)
AUTOMATIC = {"zb-1p": lambda P: (P, "loop"), "zb-2p": lambda P: (2 * P, "loop"),
             "zbv": lambda P: (P, "v")}


@functools.lru_cache(maxsize=64)
def _unit_cost(name: str, P: int, M: int) -> PipelineSchedule:
    """An automatic schedule at F = B = W = 1, searched once per (name, P, M)."""
    memory, placement = AUTOMATIC[name](P)
    return auto_schedule(P, M, memory, placement=placement, name=name)


# what a schedule needs of P and M, beyond P, M >= 1 (the generator says why otherwise)
NEEDS = {"dualpipe": ("even P, even M >= 2P", lambda P, M: P % 2 == 0 and M % 2 == 0
                      and M >= 2 * P),
         "dualpipev": ("even M >= 2P", lambda P, M: M % 2 == 0 and M >= 2 * P)}


def runs_on(name: str, P: int, M: int) -> bool:
    """Can the schedule `name` be made for P stages and M micro-batches?"""
    return name not in NEEDS or NEEDS[name][1](P, M)


def chunks_of(name: str, V: int = 2) -> int:
    """Model chunks per stage of the schedule `name` (V for interleaved)."""
    c = CHUNKS.get(name, 1)
    return V if c is None else c


def pieces(name: str, P: int, V: int = 2) -> int:
    """How many pieces the model is cut into under the schedule `name` on P stages."""
    return pieces_of(PLACEMENT.get(name, "loop"), P, chunks_of(name, V))


def make_schedule(name: str, P: int, M: int, V: int = 2,
                  costs: Mapping | None = None) -> PipelineSchedule:
    """The schedule called `name` (one of SCHEDULES) for P stages and M micro-batches. V is
    used by "interleaved" only; costs ({"F", "B", "W"}, default 1 each) by the automatic
    ones (zb-1p, zb-2p, zbv), which search for the best order under those costs."""
    if name == "gpipe":
        return gpipe(P, M)
    if name == "1f1b":
        return one_f_one_b(P, M)
    if name == "interleaved":
        return interleaved_1f1b(P, M, V)
    if name == "zb-h1":
        return zero_bubble_h1(P, M)
    if name == "zb-h2":
        return zero_bubble_h2(P, M)
    if name == "dualpipe":
        return dualpipe(P, M)
    if name == "dualpipev":
        return dualpipe_v(P, M)
    if name in ("v-half", "v-min"):
        return controllable_memory(name, P, M)
    if name in AUTOMATIC:
        if costs is None:
            return _unit_cost(name, P, M)
        memory, placement = AUTOMATIC[name](P)
        return auto_schedule(P, M, memory, placement=placement, costs=costs, name=name)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}, or "
                     "read your own with schedule_csv.from_csv.")
