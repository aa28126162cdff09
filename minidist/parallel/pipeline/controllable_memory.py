"""V-Half and V-Min: V-shaped schedules built from a repeated building block, whose
activation memory is set by the block (Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory", arXiv:2405.15362, Secs. 3-4).

The building block. On the V placement (two chunks per stage, down the stages and back up,
as ZBV) one micro-batch makes four passes on every stage: F down (chunk 0), F up (chunk
1), B down (chunk 1's backward) and B up (chunk 0's). A block gives, for stage s, the time
slot of each of the four for micro-batch 0; micro-batch m takes the same slots shifted by
6m (a stage's work per micro-batch is 6 chunk passes: 2 F, 2 B, 2 W), so if the four
slots and two more (for the Ws) are distinct modulo 6 on every stage, the repeated blocks
never collide and the steady state has no bubble. How long a micro-batch's activations
live on a stage, its first F to its last W, divided by the interval 6, is the memory the
stage holds: the block controls the memory. The paper's blocks (its public implementation),
stage s of P, slots of (F down, F up, B down, B up):
    V-Min    s,  2P-1-s,  2P+g+s,   4P+g-1-s     g = 2 if 3 | P, else 0
    V-Half   2s, 3P-2-s,  3P+g-1+2s, 6P+g-2-s    g = 3 if 2 | P, else 0
(g moves the backwards so that the six slots stay distinct modulo 6.) V-Min packs the
passes as tightly as the dependencies allow: about a third of 1F1B's memory, a bubble about
two thirds of 1F1B's; V-Half spreads them: half the memory, half the bubble.

From block to schedule, step by step:
    1. repeat: every pass of micro-batch m at its block slot + 6m
    2. Ws: each slot no pass uses takes a W whose B has run, chunk 1's first (its B came
       first), each chunk's in micro-batch order (`_put_w`)
    3. squeeze the warm-up and the cool-down (the paper's "squeeze"): visit the passes in
       slot order, and move each one of those before the first B up on stage 0 and of
       those after the last micro-batch's first F to the earliest free slot its
       dependencies allow, if that does not raise the stage's peak memory; the steady
       middle stays as the block made it. Once with the Ws, once more without them
       (cool-down only), then the Ws are put back (`_squeeze`)
    4. each stage runs its passes in slot order; the simulator, like the runtime, runs
       each as soon as its inputs are there
Costs: F = B = W (the block is in unit slots); uneven costs are only clocked, not planned
for. Shapes: none; schedules are data.
Read next: family.py (the names and their claims).
"""

from __future__ import annotations

from minidist.parallel.pipeline.schedules import Action, PipelineSchedule, check_sizes

INTERVAL = 6                      # chunk passes per micro-batch and stage: 2 F, 2 B, 2 W
# the four passes of a block, in the order `block` gives their slots:
# (kind, chunk): F down, F up, B down (chunk 1's backward), B up (chunk 0's)
PASSES = (("F", 0), ("F", 1), ("B", 1), ("B", 0))
_W = len(PASSES)                  # the index of the Ws' list in a stage's slots


def block(name: str, P: int) -> list[tuple[int, int, int, int]]:
    """Per stage, the slots of micro-batch 0's (F down, F up, B down, B up) (docstring)."""
    if name == "v-min":
        g = 2 if P % 3 == 0 else 0
        return [(s, 2 * P - 1 - s, 2 * P + g + s, 4 * P + g - 1 - s) for s in range(P)]
    if name == "v-half":
        g = 3 if P % 2 == 0 else 0
        return [(2 * s, 3 * P - 2 - s, 3 * P + g - 1 + 2 * s, 6 * P + g - 2 - s)
                for s in range(P)]
    raise ValueError(f"block: unknown building block {name!r}; use 'v-min' or 'v-half'.")


def controllable_memory(name: str, P: int, M: int) -> PipelineSchedule:
    """V-Min or V-Half (`name`) on P stages for M micro-batches (module docstring)."""
    check_sizes(name, P, M)
    slots = [[[t + INTERVAL * m for m in range(M)] for t in stage]
             for stage in block(name, P)]                       # 1. repeat
    slots = _squeeze([_put_w(st) for st in slots], with_w=True)   # 2., 3. with the Ws
    slots = _squeeze([st[:_W] for st in slots], with_w=False)      # 3. again, without
    rows = []
    for stage in (_put_w(st[:_W]) for st in slots):                # 2. the Ws back, 4.
        order = sorted((t, kind, m) for kind, times in enumerate(stage)
                       for m, t in enumerate(times))
        rows.append(tuple(_action(kind, m) for _, kind, m in order))
    placement = "v" if P > 1 else "loop"                           # one stage: the same
    return PipelineSchedule(name, P, M, tuple(rows), chunks=2, placement=placement)


def _action(kind: int, m: int) -> Action:
    """The Action of pass `kind` (an index of PASSES; _W, _W + 1: the W of chunk 1, 0) of
    micro-batch m."""
    if kind < _W:
        return Action(PASSES[kind][0], m, PASSES[kind][1])
    return Action("W", m, 1 if kind == _W else 0)


def _put_w(stage: list[list[int]]) -> list[list[int]]:
    """The stage's slots with two more lists, the Ws of chunk 1 and of chunk 0: each slot
    no pass uses, from the first on, takes one W whose B has run, chunk 1's first (its
    backward came first); the rest follow the last pass."""
    used = {t for times in stage for t in times}
    ws: list[list[int]] = [[], []]
    due = [0, 0]                                  # Bs run whose W has not, per chunk
    backs = sorted((t, i) for i, k in enumerate((2, 3)) for t in stage[k])
    for t in range(max(used) + 1):
        while backs and backs[0][0] < t:
            due[backs.pop(0)[1]] += 1
        if t not in used:
            for i in (0, 1):
                if due[i]:
                    due[i] -= 1
                    ws[i].append(t)
                    break
    t = max(used)
    for i in (0, 1):
        while len(ws[i]) < len(stage[0]):
            t += 1
            ws[i].append(t)
    return [list(x) for x in stage] + ws


def _memory(stage: list[list[int]]) -> int:
    """The most chunk activations the stage holds: +1 at each F, -1 at each W; without a
    W list, each free slot after a B runs one W (as _put_w would place it)."""
    events = sorted((t, k) for k, times in enumerate(stage) for t in times)
    held = peak = pending = 0
    has_w = len(stage) > _W
    last = -1
    for t, k in events:
        if not has_w:                     # the free slots since the last pass run Ws
            free = t - last - 1
            run = min(free, pending)
            held, pending = held - run, pending - run
        if k < 2:
            held += 1
        elif k < _W:
            pending += 1
        else:                             # a W (of either chunk)
            held -= 1
        peak = max(peak, held)
        last = t
    return peak


def _squeeze(slots: list[list[list[int]]], with_w: bool) -> list[list[list[int]]]:
    """Move the passes of the warm-up (before stage 0's first B up; only `with_w`) and of
    the cool-down (from the last micro-batch's F down on) to the earliest free slot their
    dependencies allow, without raising any stage's peak memory (module docstring, 3)."""
    slots = [[list(x) for x in st] for st in slots]
    M = len(slots[0][0])
    limit = max(_memory(st) for st in slots)
    occupied = [{t for times in st for t in times} for st in slots]
    todo = sorted((t, s, k, m) for s, st in enumerate(slots) for k, times in enumerate(st)
                  for m, t in enumerate(times))
    phase = 0                             # 0 warm-up, 1 steady (untouched), 2 cool-down
    for t, s, k, m in todo:
        if phase == 0 and s == 0 and k == 3:
            phase = 1
        if phase == 1:
            if k == 0 and m == M - 1:
                phase = 2
            continue
        if phase == 0 and not with_w:
            continue
        earliest = _ready(slots, s, k, m) + 1
        occupied[s].discard(t)
        for slot in range(earliest, t):
            if slot not in occupied[s]:
                slots[s][k][m] = slot
                if _memory(slots[s]) <= limit:
                    break
                slots[s][k][m] = t
        occupied[s].add(slots[s][k][m])
    return slots


def _ready(slots, s: int, k: int, m: int) -> int:
    """The latest slot of what pass k of micro-batch m on stage s waits for: the same
    pass on the stage it comes from (F down and B down from s-1, F up and B up from s+1),
    the pass before it of the same micro-batch, a W's backward, and the same pass of
    micro-batch m-1 (passes of a kind run in micro-batch order)."""
    P = len(slots)
    ready = -1
    if k in (0, 2) and s > 0:
        ready = max(ready, slots[s - 1][k][m])
    if k in (1, 3) and s < P - 1:
        ready = max(ready, slots[s + 1][k][m])
    if 0 < k < _W:
        ready = max(ready, slots[s][k - 1][m])
    if k >= _W:                           # W of chunk 1 (_W) or 0: after its own B
        ready = max(ready, slots[s][2 if k == _W else 3][m])
    if m > 0:
        ready = max(ready, slots[s][k][m - 1])
    return ready
