"""Pipeline schedule simulator: play a schedule on P stages and measure its bubble.

A schedule (schedules.py) fixes only the ORDER in which each stage runs its actions. How
long a step takes follows from that order, the cost of each action, and one rule: an
action waits for its inputs. A forward waits for the activation of the previous virtual
stage; a backward for its own forward and for the gradient of the next virtual stage; a
weight gradient W for its B. This module plays a schedule by that rule and returns a
Timeline, when each action ran on each stage. The bubble is the idle share of it,

    bubble = 1 - sum_s busy_s / (P * makespan),

idle time over total time, all stages, from the first start to the last end. For uniform
costs and free communication it equals the papers' closed forms (`bubble_closed_form`);
the tests check that exactly. A Timeline can also be built from a real run's records
(`Timeline.from_records`), so a measured step and a simulated one are drawn by the same
renderers (schedule_render.py).

The simulation, step by step:
    1. stage s keeps a cursor into actions[s] and the time free_s when it is next idle
    2. the action a under a cursor may run once every action it depends on has run:
           local   schedule.local_needs(a) on the same stage (B after F, W after B)
           remote  for each message of schedule.messages_in(s, a), the action that sends it
       it starts at  max(free_s, end of the local need, end of each sender + comm)
       and ends at   start + cost(a)
    3. sweep the stages, moving each cursor as far as it can; repeat until all are done.
       A sweep that moves no cursor is a deadlock: ValueError.
    The simulator never reorders: the schedule is the policy, the simulator only clocks it.

Costs: {"F": f, "B": b, "W": w}, each one number or P numbers (one per stage): the cost of
a stage's whole share of layers (1/P of the model). Chunk c of an interleaved or V
schedule is 1/V of that share, so its actions cost f/V, ...; a chunk of the dual placement
(DualPipe) is a whole share. A B whose W the stage does not run is the whole backward and
costs b + w; a split B (zero bubble) is the input gradient, b, and W the weight gradient,
w. An overlapped FB (DualPipe's F&B) costs costs["FB"] when given, else the longer of its
F and its B: a perfect overlap. Default 1 each: a backward costs two forwards (dX and dW
each cost about a forward). Times keep the type of the costs: pass fractions.Fraction
costs for exact arithmetic.

Closed forms, unit costs (F = B = W = 1, comm = 0), bubble = idle / total time:
    GPipe, 1F1B                (P-1) / (M+P-1)        any M >= 1
    interleaved 1F1B, V chunks (P-1) / (V M + P-1)    M >= P (Megatron: M a multiple of P)
    ZB-H1, ZB-1p, ZB-H2, ZB-2p (P-1) / (3 M + P-1)    M >= P (ZB-H2: M >= 2P-1)
With overlapping iterations (steady_bubble, Qi et al.'s rate): 1F1B (P-1)/M, ZB-H1 and
ZB-1p (P-1)/(3M), ZB-H2 and ZB-2p 0.
For M < P the last two never fill the pipeline and their bubble is larger.
Shapes: none; times are plain numbers in time units (simulated) or seconds (recorded).

References:
    GPipe -- Huang et al. 2019, arXiv:1811.06965, Sec. 2 and Fig. 2c.
    1F1B (PipeDream-Flush) -- Narayanan et al. 2021, arXiv:2006.09503 (PipeDream-2BW paper).
    1F1B, interleaved 1F1B -- Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2.1, 2.2.2
        (they state the bubble over the ideal time, (P-1)/M and (P-1)/(V M); over the
        total time, as here, that is (P-1)/(M+P-1) and (P-1)/(V M+P-1)).
    Zero bubble (ZB-H1) -- Qi et al. 2023, arXiv:2401.10241, "Memory efficient schedule"
        (Sec. 2.1 of the arXiv text): bubble (P-1)(T_F+T_B-T_W) against 1F1B's
        (P-1)(T_F+T_B+T_W).
Read next: parallel/pipeline/schedule_render.py (draw a Timeline as text, a trace or a PNG).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from minidist.parallel.pipeline.schedules import FB, KINDS, Action, PipelineSchedule


@dataclass(frozen=True)
class Slot:
    """Action `action` ran from `start` to `end` on one stage."""

    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """stages[s]: the slots stage s ran, in order. time_unit: "unit" (simulated) or "s"
    (recorded); renderers use it to scale time."""

    stages: list[list[Slot]]
    schedule_name: str = ""
    chunks: int = 1
    time_unit: str = "unit"

    def slots(self) -> list[Slot]:
        """Every slot of every stage."""
        return [slot for row in self.stages for slot in row]

    @property
    def origin(self) -> float:
        """The first start over all stages (0 for an empty timeline)."""
        return min((sl.start for sl in self.slots()), default=0)

    @property
    def makespan(self) -> float:
        """Last end minus first start, over all stages."""
        return max((sl.end for sl in self.slots()), default=0) - self.origin

    @property
    def micro_batches(self) -> int:
        """M: one more than the largest micro-batch index."""
        return 1 + max((sl.action.micro_batch for sl in self.slots()), default=-1)

    def busy(self, stage: int) -> float:
        """Time stage `stage` spent running actions."""
        return sum((sl.duration for sl in self.stages[stage]), 0)

    def idle(self, stage: int) -> float:
        """Time stage `stage` spent idle between the timeline's first start and last end."""
        return self.makespan - self.busy(stage)

    def bubble_fraction(self) -> float:
        """1 - sum_s busy_s / (P makespan): idle time over total time, all stages.

        Computed as idle / total, two sums of the times and one division, so that times
        which are exact binary fractions give the correctly rounded closed form."""
        total = len(self.stages) * self.makespan
        if total == 0:
            return 0.0
        return (total - sum(self.busy(s) for s in range(len(self.stages)))) / total

    def span(self, stage: int) -> float:
        """Stage `stage`'s own span: its last end minus its first start."""
        row = self.stages[stage]
        return row[-1].end - row[0].start if row else 0

    def steady_bubble(self) -> float:
        """The bubble rate left when iterations overlap: max_s span_s / busy - 1.

        A synchronous step ends at the last end of all stages (bubble_fraction). When the
        optimizer step needs no all-stage synchronisation before it (Qi et al.'s optimizer
        post-validation), stage s starts the next iteration as soon as it ends this one,
        so iterations overlap and repeat every max_s span_s; the idle time inside that
        period, over the useful time, is the rate Qi et al. report: (P-1)/M for 1F1B,
        (P-1)/(3M) for ZB-1p, 0 for ZB-2p and ZBV (F = B = W). Every stage is assumed to
        have the same busy time (the largest is used otherwise)."""
        busy = max((self.busy(s) for s in range(len(self.stages))), default=0)
        if busy == 0:
            return 0.0
        return max(self.span(s) for s in range(len(self.stages))) / busy - 1

    @classmethod
    def from_records(cls, records: Sequence[Sequence[tuple[Action, float, float]]],
                     name: str = "", chunks: int = 1) -> "Timeline":
        """A Timeline from a real run: records[s] = stage s's (Action, start_s, end_s), on a
        clock all stages share. Times are shifted so that the earliest start is 0."""
        flat = [float(r[1]) for row in records for r in row]
        t0 = min(flat, default=0.0)
        stages = []
        for s, row in enumerate(records):
            slots = []
            for a, start, end in row:
                if not end >= start:
                    raise ValueError(f"Timeline.from_records: stage {s}'s {a} ends at {end} "
                                     f"s, before it starts at {start} s. Record start and "
                                     "end with the same clock, start first.")
                slots.append(Slot(a, float(start) - t0, float(end) - t0))
            stages.append(sorted(slots, key=lambda sl: (sl.start, sl.end)))
        return cls(stages, name, chunks, time_unit="s")


# --- the simulator ------------------------------------------------------------------------

def _costs(costs: Mapping[str, float | Sequence[float]] | None, P: int) -> dict[str, list]:
    """{kind: [cost of stage 0, ..., cost of stage P-1]}, checked; "FB" only if given."""
    costs = dict(costs or {})
    unknown = sorted(set(costs) - set(KINDS) - {FB})
    if unknown:
        raise ValueError(f"simulate: unknown cost keys {unknown}; use 'F', 'B', 'W' (and "
                         "'FB' for an overlapped forward and backward).")
    out = {}
    for k in KINDS + (FB,):
        if k == FB and k not in costs:
            continue
        c = costs.get(k, 1)
        per_stage = list(c) if isinstance(c, (list, tuple)) else [c] * P
        if len(per_stage) != P:
            raise ValueError(f"simulate: costs[{k!r}] has {len(per_stage)} values for {P} "
                             f"stages; give one number or exactly {P}.")
        if any(not x >= 0 for x in per_stage):
            raise ValueError(f"simulate: costs[{k!r}] = {per_stage} has a negative (or NaN) "
                             "cost; every cost must be >= 0.")
        out[k] = per_stage
    return out


def _duration(schedule: PipelineSchedule, cost: dict[str, list], s: int, a: Action):
    """Cost of action `a` on stage s: the stage's cost of its kind, / V for one chunk (a
    chunk of the dual placement is a whole stage's share: no division). A B whose W the
    stage does not run is the whole backward, b + w. An FB: costs["FB"] if given (a chunk's
    overlapped F and whole B), else the longer of the two, the overlap being perfect."""
    if a.kind == FB:
        f, b = (_duration(schedule, cost, s, part) for part in a.parts())
        return _scaled(schedule, cost[FB][s]) if FB in cost else max(f, b)
    c = cost[a.kind][s]
    if a.kind == "B" and not schedule.is_split(s, a.micro_batch, a.chunk):
        c = c + cost["W"][s]                      # a whole backward
    return _scaled(schedule, c)


def _scaled(schedule: PipelineSchedule, c):
    """A stage's cost c for one chunk: c / V (c under "dual"), in c's own type."""
    n = schedule.chunk_share.denominator
    return c / n if n > 1 else c


def _deps(schedule: PipelineSchedule, s: int, a: Action) -> list[tuple[tuple, bool]]:
    """[((stage, action), crosses_stages)]: the actions `a` of stage s must wait for."""
    need = schedule.local_needs(a)
    deps = [((s, need), False)] if need is not None else []
    for msg in schedule.messages_in(s, a):
        # an activation is sent by the F of virtual stage k-1, a gradient by the B of k+1
        k_src, kind = (msg.vstage - 1, "F") if msg.kind == "act" else (msg.vstage + 1, "B")
        src, chunk = schedule.place(k_src, msg.micro_batch)
        deps.append(((src, Action(kind, msg.micro_batch, chunk)), src != s))
    return deps


def _check_actions(schedule: PipelineSchedule) -> None:
    for s, row in enumerate(schedule.actions):
        parts = [part for a in row for part in a.parts()]
        if len(set(parts)) != len(parts):
            dup = next(a for a in parts if parts.count(a) > 1)
            raise ValueError(f"simulate: stage {s} of {schedule.name!r} runs {dup} twice.")
        for a in parts:
            if a.kind not in KINDS or not 0 <= a.chunk < schedule.chunks:
                raise ValueError(
                    f"simulate: stage {s} of {schedule.name!r} has action {a!r}: kind must "
                    f"be F, B, W or FB and chunk in 0..{schedule.chunks-1}.")


def simulate(schedule: PipelineSchedule, costs: Mapping | None = None,
             comm: float = 0.0) -> Timeline:
    """Timeline of `schedule` with each action as early as its order and inputs allow.

    start(a) = max(free time of its stage, end of local_needs(a), end of every sender of a
    message in messages_in + comm); end(a) = start(a) + cost(a) (see the module docstring
    for costs). A hand-over inside one stage (the V's turn) costs no comm. ValueError if
    the schedule cannot progress (a deadlock)."""
    P = schedule.stages
    if len(schedule.actions) != P:
        raise ValueError(f"simulate: {schedule.name!r} has {len(schedule.actions)} rows of "
                         f"actions for {P} stages.")
    _check_actions(schedule)
    cost = _costs(costs, P)
    end: dict[tuple[int, Action], float] = {}
    rows: list[list[Slot]] = [[] for _ in range(P)]
    free: list = [0] * P
    cursor = [0] * P
    while any(cursor[s] < len(schedule.actions[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while cursor[s] < len(schedule.actions[s]):
                a = schedule.actions[s][cursor[s]]
                deps = _deps(schedule, s, a)
                if any(key not in end for key, _ in deps):
                    break                                 # an input is not there yet
                ready = [end[key] + comm if remote and comm else end[key]
                         for key, remote in deps]
                start = max([free[s], *ready])
                free[s] = start + _duration(schedule, cost, s, a)
                for part in a.parts():
                    end[(s, part)] = free[s]
                rows[s].append(Slot(a, start, free[s]))
                cursor[s] += 1
                moved = True
        if not moved:
            raise ValueError(_deadlock(schedule, cursor, end))
    return Timeline(rows, schedule.name, schedule.chunks)


def _deadlock(schedule: PipelineSchedule, cursor: list[int], end: dict) -> str:
    """Say which stage waits at which action for what."""
    lines = []
    for s, row in enumerate(schedule.actions):
        if cursor[s] < len(row):
            a = row[cursor[s]]
            missing = [f"{act} of stage {src}" for (src, act), _ in _deps(schedule, s, a)
                       if (src, act) not in end]
            lines.append(f"  stage {s} waits at action #{cursor[s]} ({a}) for "
                         + ", ".join(missing))
    return (f"simulate: schedule {schedule.name!r} (P={schedule.stages}, "
            f"M={schedule.micro_batches}) cannot progress: every unfinished stage waits for "
            "an action that has not run (it comes later in its stage's order, or is missing):\n"
            + "\n".join(lines) + "\nRun schedule_validate.validate(schedule) for a diagnosis.")


# --- memory and closed forms --------------------------------------------------------------

def peak_activations(schedule: PipelineSchedule) -> list[int]:
    """Per stage, the most (micro-batch, chunk) activations held at once: scan the stage's
    actions in order, +1 at F, -1 at the action that frees them (B, or W when split).
    An FB's F comes in before its B goes (both are held while they overlap).
    Order-based, so independent of costs. GPipe: M on every stage; 1F1B: min(P-s, M)."""
    peaks = []
    for s, row in enumerate(schedule.actions):
        held = peak = 0
        for a in row:
            for part in a.parts():      # an FB: its F comes in, then its B lets one go
                held += (part.kind == "F") - _releases(schedule, s, part)
                peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _releases(schedule: PipelineSchedule, s: int, a: Action) -> bool:
    """Does `a` free its micro-batch's activations: W, or a B whose W is not run."""
    return a.kind == "W" or (a.kind == "B" and not schedule.is_split(s, a.micro_batch, a.chunk))


def bubble_closed_form(name: str, P: int, M: int, V: int = 1) -> float:
    """The papers' bubble (idle / total time) for unit costs F = B = W = 1 and comm = 0.

    "gpipe", "1f1b": (P-1)/(M+P-1), for any M >= 1 and any uniform costs: the fill and the
    drain each take P-1 forwards (backwards) per stage (Huang et al. 2019, Sec. 2;
    Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.2.1).
    "interleaved": (P-1)/(V M+P-1): each chunk is 1/V of the stage, so fill and drain
    shrink V times (arXiv:2104.04473, Sec. 2.2.2, for M a multiple of P; the schedule in
    schedules.py meets it for every M >= P).
    "zb-h1": (P-1)/(3M+P-1): bubble (P-1)(T_F+T_B-T_W) against 1F1B's (P-1)(T_F+T_B+T_W)
    (Qi et al. 2023, arXiv:2401.10241, Sec. 2.1), for M >= P.
    "zb-h2", "zb-1p", "zb-2p": the same for one synchronous step: stage P-1 cannot start
    before P-1 forwards and has 3M units of work, so 3M + P-1 is the least makespan, and
    they reach it (M >= P; zb-h2 M >= 2P-1). What ZB-H2 and ZB-2p gain is the idle time
    inside each stage's span, which only overlapping iterations recover: steady_bubble."""
    key = name.lower().replace("_", "-")
    if P < 1 or M < 1 or V < 1:
        raise ValueError(f"bubble_closed_form: need P, M, V >= 1, got P={P}, M={M}, V={V}.")
    if key in ("gpipe", "1f1b", "one-f-one-b"):
        return (P - 1) / (M + P - 1)
    if key in ("interleaved", "interleaved-1f1b"):
        return (P - 1) / (V * M + P - 1)
    if key in ("zb-h1", "zero-bubble-h1", "zbh1", "zb-h2", "zb-1p", "zb-2p"):
        return (P - 1) / (3 * M + P - 1)
    raise ValueError(f"bubble_closed_form: no closed form for schedule {name!r}; known: "
                     "'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-h2', 'zb-1p', 'zb-2p'.")
