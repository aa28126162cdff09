"""Scheduling policies: given the cluster now, which waiting jobs start and which running stop.

A policy is a pure function of a `Snapshot` (time, free GPUs per node, every submitted
unfinished job with its phase, placement and progress, each user's usage so far) to a
`Decision` (jobs to start now, with their placements; jobs to preempt). It keeps no state
between calls, so the simulator (scheduler.py) and the --real driver (real.py) call the
same functions, at every event: an arrival, a completion, the end of a checkpoint or
restore, or (LAS) a job crossing a priority threshold.

The five policies, one scheduling pass each:
    fifo  start jobs in submit order while the oldest fits; it blocks everyone behind it.
    easy  FIFO, plus EASY backfilling: when the oldest job (the head) does not fit, find
          its reservation -- the earliest time it fits if running jobs end when their
          user estimates say (the shadow time) -- and start any later job that fits now
          and does not delay that: it ends (by its estimate) before the shadow time, or
          it only uses GPUs the head will not need then. EASY trusts the estimates: a
          backfilled job that overruns its own can delay the head (a batch system would
          kill it at its time limit; here it runs on).
    sjf   shortest (user-estimated) job first; every job that fits starts, in that order.
    fair  fair share between users: the next job comes from the user holding the fewest
          GPUs now, ties to the least GPU-seconds used so far, then submit order; equal
          shares, no decay of past usage (Slurm decays it with a half-life).
    las   Tiresias' discretized 2D-LAS: a job's attained service is GPUs x seconds run;
          thresholds cut it into K queues, queue 0 (least served) first, FIFO by submit
          inside a queue. A waiting job may preempt running jobs of a strictly lower
          priority when that makes it fit; they checkpoint, release their GPUs, and later
          resume after a restore. Only jobs making progress are preempted (not ones
          checkpointing or restoring). No starvation guard (Tiresias' PROMOTEKNOB).
All but fifo and easy are work-conserving: a job that does not fit is skipped, not waited
for, so big jobs can starve under sjf, fair and las.

One pass, as a policy sees it:
    1. copy `free` (a policy changes nothing; it returns a Decision);
    2. walk the waiting jobs in the policy's order;
    3. `placement.place` each (one node for g <= G, whole nodes above): start it, skip it,
       or (fifo, easy's head) stop;
    4. easy: find the head's reservation and test each backfill candidate against it;
       las: for a job that does not fit, release victims lowest priority first until it
       fits, then keep running every victim that was not needed.

References:
    EASY: Lifka 1995, "The ANL/IBM SP scheduling system", JSSPP, LNCS 949; Mu'alem and
        Feitelson 2001, IEEE TPDS 12(6) (backfilling with user runtime estimates).
    LAS: Gu et al. 2019, "Tiresias: A GPU Cluster Manager for Distributed Deep
        Learning", NSDI'19, Sec. 3.2 (2D attained service, priority discretization).
Read next: cluster/scheduler.py
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import takewhile
from typing import Callable, Mapping, Sequence

from minidist.cluster.placement import Cluster, Placement, give_back, place, take
from minidist.cluster.traces import Job

NAMES = ("fifo", "easy", "sjf", "fair", "las")


@dataclass(frozen=True)
class Task:
    """A submitted, unfinished job as a policy sees it. phase: waiting, restoring, running
    or checkpointing; executed: seconds of progress so far; busy_until: when the current
    restore or checkpoint ends (else 0)."""

    job: Job
    phase: str
    placement: Placement = ()
    executed: float = 0.0
    busy_until: float = 0.0

    @property
    def attained(self) -> float:
        """Attained service, GPU-seconds (Tiresias' 2D measure: GPUs x time run)."""
        return self.job.gpus * self.executed


@dataclass(frozen=True)
class Snapshot:
    """The cluster at time `now`: free GPUs per node, tasks in submit order, and each
    user's GPU-seconds of progress so far (finished jobs included)."""

    now: float
    cluster: Cluster
    free: tuple[int, ...]
    tasks: tuple[Task, ...]
    usage: Mapping[str, float]


@dataclass(frozen=True)
class Decision:
    starts: tuple[tuple[str, Placement], ...] = ()
    preempts: tuple[str, ...] = ()


Policy = Callable[[Snapshot], Decision]


def make(name: str, thresholds: Sequence[float] = ()) -> Policy:
    """The policy `name` (one of NAMES); `thresholds` (GPU-seconds, increasing) are las's
    queue boundaries."""
    if name not in NAMES:
        raise ValueError(f"policy {name!r} is unknown; choose one of {', '.join(NAMES)}")
    t = tuple(float(x) for x in thresholds)
    if any(x <= 0 for x in t) or list(t) != sorted(set(t)):
        raise ValueError(f"las thresholds {list(thresholds)} must be > 0 and increasing "
                         f"(GPU-seconds where a job drops to the next queue), e.g. 3600,36000")
    if name == "las":
        return lambda snap: las(snap, t)
    return {"fifo": fifo, "easy": easy, "sjf": sjf, "fair": fair}[name]


def level(attained: float, thresholds: Sequence[float]) -> int:
    """las queue of a job: how many thresholds its attained service has reached (within a
    relative 1e-9, so that a job advanced to a threshold's time counts as there)."""
    return bisect.bisect_right(thresholds, attained + 1e-9 * max(1.0, attained))


def next_threshold(attained: float, thresholds: Sequence[float]) -> float | None:
    """The next threshold above `attained` (None past the last): a las event."""
    k = level(attained, thresholds)
    return thresholds[k] if k < len(thresholds) else None


def _waiting(snap: Snapshot) -> list[Task]:
    return [t for t in snap.tasks if t.phase == "waiting"]


def _greedy(snap: Snapshot, order: list[Task], blocking: bool) -> Decision:
    """Start jobs in `order` while (blocking) or whenever (not) they fit."""
    free, starts, g = list(snap.free), [], snap.cluster.gpus_per_node
    for t in order:
        spot = place(free, t.job.gpus, g)
        if spot is None:
            if blocking:
                break
            continue
        take(free, spot)
        starts.append((t.job.id, spot))
    return Decision(tuple(starts))


def fifo(snap: Snapshot) -> Decision:
    return _greedy(snap, _waiting(snap), blocking=True)


def sjf(snap: Snapshot) -> Decision:
    waiting = _waiting(snap)
    order = sorted(range(len(waiting)), key=lambda i: (waiting[i].job.estimate, i))
    return _greedy(snap, [waiting[i] for i in order], blocking=False)


def fair(snap: Snapshot) -> Decision:
    """Repeatedly start the first fitting job of the user with the fewest GPUs held now
    (then the least usage, then the oldest job); stop when no user's job fits."""
    free, g = list(snap.free), snap.cluster.gpus_per_node
    held: dict[str, int] = {}
    for t in snap.tasks:
        if t.placement:
            held[t.job.user] = held.get(t.job.user, 0) + t.job.gpus
    queues: dict[str, list[tuple[int, Task]]] = {}
    for i, t in enumerate(_waiting(snap)):
        queues.setdefault(t.job.user, []).append((i, t))
    starts = []
    while True:
        best = None
        for user, queue in queues.items():
            pick = next(((i, t, s) for i, t in queue
                         if (s := place(free, t.job.gpus, g)) is not None), None)
            if pick is not None:
                key = (held.get(user, 0), snap.usage.get(user, 0.0), pick[0])
                best = min(best, (key, user, pick)) if best else (key, user, pick)
        if best is None:
            return Decision(tuple(starts))
        _, user, (i, t, spot) = best
        take(free, spot)
        starts.append((t.job.id, spot))
        held[user] = held.get(user, 0) + t.job.gpus
        queues[user].remove((i, t))


def estimated_end(t: Task, now: float) -> float:
    """When `t` should release its GPUs if it runs as long as its user estimated."""
    if t.phase == "checkpointing":
        return t.busy_until
    restore = max(t.busy_until - now, 0.0) if t.phase == "restoring" else 0.0
    return now + restore + max(t.job.estimate - t.executed, 0.0)


def easy(snap: Snapshot) -> Decision:
    """FIFO while the head fits; then the head's reservation, and backfill (see module)."""
    free, g, now = list(snap.free), snap.cluster.gpus_per_node, snap.now
    waiting, starts = _waiting(snap), []
    ends = [(estimated_end(t, now), t.placement) for t in snap.tasks if t.placement]
    while waiting and (spot := place(free, waiting[0].job.gpus, g)) is not None:
        take(free, spot)
        starts.append((waiting[0].job.id, spot))
        ends.append((now + waiting.pop(0).job.estimate, spot))
    if not waiting:
        return Decision(tuple(starts))
    head, at_shadow, shadow = waiting[0].job, list(free), None
    for end, spot in sorted(ends):
        if shadow is not None and end > shadow:
            break
        give_back(at_shadow, spot, g)            # release everything ending by the shadow
        if shadow is None and place(at_shadow, head.gpus, g) is not None:
            shadow = end                         # the head's reservation time
    for t in waiting[1:]:
        spot = place(free, t.job.gpus, g)
        if spot is None:
            continue
        if now + t.job.estimate > shadow:        # still running at the shadow time: it may
            trial = list(at_shadow)              # only use GPUs the head will not need
            take(trial, spot)
            if place(trial, head.gpus, g) is None:
                continue
            at_shadow = trial
        take(free, spot)
        starts.append((t.job.id, spot))
    return Decision(tuple(starts))


def las(snap: Snapshot, thresholds: tuple[float, ...]) -> Decision:
    """Discretized 2D-LAS with preemption (module docstring). `virt` is the free map once
    every job now checkpointing has left, minus what this pass has promised."""
    g = snap.cluster.gpus_per_node
    rank = {t.job.id: (level(t.attained, thresholds), i) for i, t in enumerate(snap.tasks)}
    free, virt = list(snap.free), list(snap.free)
    for t in snap.tasks:
        if t.phase == "checkpointing":
            give_back(virt, t.placement, g)
    running = sorted((t for t in snap.tasks if t.phase == "running"),
                     key=lambda t: rank[t.job.id], reverse=True)   # lowest priority first
    starts, preempts = [], []
    for w in sorted(_waiting(snap), key=lambda t: rank[t.job.id]):
        if not any(virt) and (not running or rank[running[0].job.id] < rank[w.job.id]):
            break                                 # nothing free, nobody left to preempt
        spot = place(virt, w.job.gpus, g)
        if spot is None:
            victims = list(takewhile(lambda v: rank[v.job.id] > rank[w.job.id], running))
            if sum(virt) + sum(v.job.gpus for v in victims) < w.job.gpus:
                continue                          # cannot fit even so: it waits
            virt_after, chosen = _victims(virt, victims, w.job.gpus, g, rank)
            if not chosen:
                continue
            virt = virt_after
            preempts += [v.job.id for v in chosen]
            running = [v for v in running if v.job.id not in preempts]
            spot = place(virt, w.job.gpus, g)
        take(virt, spot)                          # promised to w in the virtual map
        if all(free[node] >= count for node, count in spot):
            take(free, spot)                      # ... and free right now: start it
            starts.append((w.job.id, spot))
    return Decision(tuple(starts), tuple(preempts))


def _victims(virt: list[int], victims: list[Task], gpus: int, g: int, rank: dict
             ) -> tuple[list[int], list[Task]]:
    """Release victims (lowest priority first) until a gang of `gpus` fits; then keep
    back every victim not needed, trying the highest priority first. Returns (the free
    map with the chosen victims gone, the victims); (virt, []) if even all of them do not
    make the gang fit."""
    trial, chosen = list(virt), []
    for v in victims:
        give_back(trial, v.placement, g)
        chosen.append(v)
        if place(trial, gpus, g) is not None:
            break
    else:
        return virt, []
    for v in sorted(chosen, key=lambda v: rank[v.job.id]):
        test = list(trial)
        take(test, v.placement)
        if place(test, gpus, g) is not None:
            trial = test
            chosen.remove(v)
    return trial, chosen
