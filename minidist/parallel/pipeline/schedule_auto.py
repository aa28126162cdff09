"""The automatic zero-bubble scheduler: a schedule found by list scheduling under a memory
limit, for given F, B, W and communication costs.

The handcrafted schedules (schedules.py) assume F = B = W. Real stages are not that even,
and how much activation memory a stage may hold is a budget the user sets. Qi et al.
(arXiv:2401.10241, Sec. 3) answer both with a scheduler: play the pipeline forward in time
and, whenever a stage is free, pick what it runs next by a few rules; try the few binary
choices the rules leave open and keep the best. Their ZB-1p is this scheduler with the
memory limit at 1F1B's peak, ZB-2p at twice that. The same scheduler on the V placement
(two chunks per stage, down the stages and back up; Qi et al. 2024, arXiv:2405.15362)
gives ZBV at 1F1B's memory, V-Half at half of it and V-Min at a third.

Memory is counted in ACTIVATION UNITS: one micro-batch's activations of a whole stage's
layers (1/P of the model). A chunk of the V placement is half a stage, so one of its
micro-batches holds half a unit. 1F1B's stage 0 peaks at P units.

One stage's rules, when it is free at time t (the list scheduler, `_play`):
    candidates  F: the next forward of each chunk whose input has arrived by t
                   (virtual stage 0 needs none); B: the next backward of each chunk whose
                   F is done and whose gradient has arrived (the last virtual stage needs
                   none); W: the oldest weight gradient whose B is done
    1. F, if one is ready and fits: room for it within `limit` (on the V placement a new
       micro-batch also leaves one place for a chunk-1 forward, `_room`), and, for a new
       micro-batch, fewer than `ahead[s]` forwards ahead of the backwards (the warm-up:
       every forward that can arrive before the stage's first gradient, or 1F1B's P-s)
    2. else B, if one is ready (with "B first once warm", B goes before a ready F)
    3. else W, if one is waiting and: fill "eager"; or a ready forward has no room (W
       frees its micro-batch); or no input is known to be coming; or fill "fit" and none
       arrives before the W would end ("lazy" keeps the rest for the tail)
    4. else wait for the next arrival
    A chunk's candidates go in micro-batch order; between chunks, the one nearer the loss
    first (the V placement's chunk 1 for F; for B the smaller micro-batch, then chunk 1).
    Backwards never pass each other on a chunk, so each gradient accumulates in the single
    process's micro-batch order.
The open choices (the warm-up depth; Ws eager, fitted into gaps or only when memory is
full or nothing else will come; F or B first once warm) are tried in every combination,
beside the handcrafted ZB-H1 and ZB-H2 where they fit the limit (so the search is never
worse than those, and returns them on a tie: at F = B = W, ZB-1p is ZB-H1 and ZB-2p is
ZB-H2; with uneven costs it finds better, test_family.py); the schedule kept is the one
with the shortest makespan, then
the smallest steady-state bubble (schedule_sim.Timeline.steady_bubble: each stage's idle
time inside its own span, the bubble left when iterations overlap; Qi et al.'s measure).

What is left out: the paper then improves the greedy schedule with an integer program
(and ZBV with further passes); none of that is here. A local search that swaps
neighbouring actions was tried and found nothing better in the cases tested, so the
greedy result is what runs; family.py and its tests say how close it comes.

Costs: {"F": f, "B": b, "W": w} of a whole stage, as schedule_sim.simulate takes them (a
V chunk costs half); comm: the time a message takes. Times may be Fractions (exact).
Shapes: none; schedules are data.
Read next: family.py (every schedule by name, and what each claims).
"""

from __future__ import annotations

import heapq
import itertools
import math
from fractions import Fraction
from typing import Mapping

from minidist.parallel.pipeline.schedule_sim import simulate
from minidist.parallel.pipeline.schedules import (KINDS, Action, PipelineSchedule, check_sizes,
                                                  zero_bubble_h1,
                                                  zero_bubble_h2)


def auto_schedule(P: int, M: int, memory, *, placement: str = "loop",
                  costs: Mapping | None = None, comm=0, name: str = "auto"
                  ) -> PipelineSchedule:
    """The best schedule the list scheduler finds for P stages, M micro-batches and at
    most `memory` activation units held per stage (module docstring); placement "loop"
    (one chunk per stage) or "v" (two, in a V)."""
    check_sizes(name, P, M)
    if placement not in ("loop", "v"):
        raise ValueError(f"{name}: placement {placement!r}; use 'loop' or 'v'.")
    V = 2 if placement == "v" else 1
    if P == 1:                           # one stage: the V and the loop are the same cut
        placement = "loop"
    limit = math.ceil(Fraction(memory) * V)             # in chunk activations
    if limit < V:
        raise ValueError(f"{name}: a memory limit of {memory} activation units cannot hold "
                         f"one micro-batch's way through a stage ({V} chunk(s) of 1/{V} "
                         "unit each); give at least 1.")
    costs = dict(costs or {})
    unit = {k: Fraction(costs.get(k, 1)) if not isinstance(costs.get(k, 1), float)
            else costs.get(k, 1) for k in KINDS}
    tried = []                   # the handcrafted ones that fit first: on a tie, they win
    if V == 1:
        tried += [h(P, M).actions for h, held in ((zero_bubble_h2, 2 * P - 1),
                                                  (zero_bubble_h1, P))
                  if min(held, M) <= limit]
    for deep, fill, f_first in itertools.product((True, False), ("eager", "fit", "lazy"),
                                                (True, False)):
        ahead = [min(limit, _warmup(P, V, s) if deep else V * (P - s)) for s in range(P)]
        tried.append(_play(P, M, V, placement, limit, ahead, fill, f_first, unit, comm))
    scheduled = [PipelineSchedule(name, P, M, order, chunks=V, placement=placement)
                 for order in tried]
    return min(scheduled, key=lambda sched: _score(sched, unit, comm))


def _warmup(P: int, V: int, s: int) -> int:
    """Forwards stage s can run before its first gradient arrives, F = B = W: 2(P-1-s) + 1
    on the loop (1F1B's warm-up doubled: ZB-H2's), 2P chunk forwards on the V placement
    (every chunk-0 and chunk-1 forward of the first P micro-batches' way down and up)."""
    return 2 * (P - 1 - s) + 1 if V == 1 else 2 * P


def _score(schedule: PipelineSchedule, costs, comm) -> tuple:
    t = simulate(schedule, costs, comm)
    return (t.makespan, t.steady_bubble())


def _play(P, M, V, placement, limit, ahead, fill, f_first, costs, comm):
    """One run of the list scheduler (module docstring); returns each stage's actions."""
    probe = PipelineSchedule("probe", P, M, ((),) * P, chunks=V, placement=placement)
    dur = {k: costs[k] / V if V > 1 else costs[k] for k in KINDS}
    end: dict[tuple[int, Action], object] = {}
    order: list[list[Action]] = [[] for _ in range(P)]
    nf = [[0] * V for _ in range(P)]                     # next forward of each chunk
    nb = [[0] * V for _ in range(P)]                     # next backward of each chunk
    pending_w: list[list[Action]] = [[] for _ in range(P)]
    held = [0] * P
    queue = [(0, s) for s in range(P)]                   # (time the stage is free, stage)
    waiting: list[int] = []
    total = 3 * M * V

    def arrival(s, a):
        """When a's inputs are all there (its local need included), None if unknown."""
        t = 0
        need = probe.local_needs(a)
        if need is not None:
            if (s, need) not in end:
                return None
            t = end[s, need]
        for msg in probe.messages_in(s, a):
            k_src, kind = (msg.vstage - 1, "F") if msg.kind == "act" else (msg.vstage + 1, "B")
            src, chunk = probe.place(k_src)
            key = (src, Action(kind, msg.micro_batch, chunk))
            if key not in end:
                return None
            t = max(t, end[key] + (comm if src != s else 0))
        return t

    def candidates(s, kind):
        nxt = nf if kind == "F" else nb
        out = []
        for c in range(V):
            m = nxt[s][c]
            if m < M and (kind == "F" or m < nf[s][c]):
                a = Action(kind, m, c)
                out.append((arrival(s, a), a))
        return out

    while queue:
        t, s = heapq.heappop(queue)
        if len(order[s]) == total:
            continue
        fs = [(r, a) for r, a in candidates(s, "F") if r is not None]
        bs = [(r, a) for r, a in candidates(s, "B") if r is not None]
        admit = sum(nf[s]) - sum(nb[s]) < ahead[s]   # may a new micro-batch come in?
        ready_f = sorted((a for r, a in fs if r <= t and _room(held[s], nf[s], a, limit)
                          and (admit or a.chunk > 0)), key=lambda a: -probe.vstage(s, a.chunk))
        f_ok = bool(ready_f)
        ready_b = sorted((a for r, a in bs if r <= t), key=lambda a: (a.micro_batch, -a.chunk))
        pick = None
        if f_ok and ready_f and (f_first or not ready_b):
            pick = ready_f[0]
        elif ready_b:
            pick = ready_b[0]
        elif f_ok and ready_f:
            pick = ready_f[0]
        elif pending_w[s]:
            soon = [r for r, a in fs + bs if r > t and (a.kind == "B" or admit)]
            blocked = any(r <= t for r, a in fs) and not f_ok      # no room for a forward
            if fill == "eager" or blocked or not soon or (
                    fill == "fit" and min(soon) >= t + dur["W"]):
                pick = pending_w[s][0]
        if pick is None:
            later = [r for r, a in fs + bs if r > t and (a.kind == "B" or admit)]
            later = later or [e for e in end.values() if e > t]  # then look again
            if later:
                heapq.heappush(queue, (min(later), s))
            else:
                waiting.append(s)
            continue
        e = t + dur[pick.kind]
        end[s, pick] = e
        order[s].append(pick)
        if pick.kind == "F":
            nf[s][pick.chunk] += 1
            held[s] += 1
        elif pick.kind == "B":
            nb[s][pick.chunk] += 1
            pending_w[s].append(Action("W", pick.micro_batch, pick.chunk))
        else:
            pending_w[s].pop(0)
            held[s] -= 1
        heapq.heappush(queue, (e, s))
        for w in waiting:                                # a new end: look again then
            heapq.heappush(queue, (e, w))
        waiting = []
    if any(len(row) != total for row in order):          # never seen; a bug, not bad input
        raise RuntimeError(f"auto_schedule: the list scheduler stopped with "
                           f"{[len(r) for r in order]} of {total} actions per stage "
                           f"(P={P}, M={M}, V={V}, limit={limit}).")
    return tuple(map(tuple, order))


def _room(held: int, nf: list[int], a: Action, limit: int) -> bool:
    """May forward `a` run with `held` chunk activations held? On the V placement a new
    micro-batch (chunk 0) must leave one place free, for the chunk-1 forward of the
    oldest micro-batch still on its way down, or the stage could fill with micro-batches
    none of which can reach the loss: held + 2 <= limit. One is enough: that micro-batch
    reaches the loss, its backwards and Ws free its places, and the next one follows."""
    if len(nf) == 1 or a.chunk == 1:
        return held + 1 <= limit
    return held + 2 <= limit
