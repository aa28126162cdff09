"""Job scheduling: a discrete-event simulator of a GPU cluster running a trace under a policy.

A shared cluster (N nodes x G GPUs) receives training jobs over time. Each job is a gang
(placement.py: all its GPUs at once, one node for g <= G, whole nodes above), runs for a
known amount of work, and leaves. A policy (policies.py) decides at every event who
starts and, for las, who is preempted. The simulator moves time from event to event --
nothing happens between two events but jobs making progress -- and records every hold of
GPUs (a `Segment`) so that the invariants can be checked afterwards and the metrics
(metrics.py) computed.

A job's life (phases), and what each costs:
    waiting --start--> running --work done--> finished
    waiting --start--> restoring (R seconds: load the checkpoint) --> running   [resumed]
    running --preempt--> checkpointing (C seconds: save) --> waiting
During restore and checkpoint the job holds its GPUs but makes no progress: each
preemption costs its gang C + R seconds. Conservation: a job holds GPUs for exactly
duration + preemptions x (C + R) seconds in all, and runs exactly `duration` of work.

One pass of the event loop (`_Sim.run`):
    1. t = the earliest next event: an arrival, a completion, the end of a restore or a
       checkpoint, or (las) a running job's attained service reaching a threshold;
    2. advance every running job to t (executed += t - now; its user's usage too);
    3. apply the events at t: arrivals queue up, restores turn into runs, finished jobs
       and finished checkpoints give their GPUs back;
    4. ask the policy for a Decision on the Snapshot at t, and apply it (preempted jobs
       start checkpointing; started jobs take their GPUs: restoring if resumed);
    5. check the books: per node, GPUs held + free = G, and every holder holds exactly its
       gang (a RuntimeError here would be a bug in this file or in a policy).

Time unit: seconds (any one unit works). Cost: O(active jobs) per event.
References: Gu et al. 2019, "Tiresias", NSDI'19 (preemption by checkpoint and restore);
Mu'alem and Feitelson 2001, IEEE TPDS 12(6) (event-driven simulation of backfilling).
Read next: cluster/metrics.py, then cluster/real.py (the same policies on real processes)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from minidist.cluster import policies
from minidist.cluster.placement import Cluster, Placement, give_back, take
from minidist.cluster.traces import Job

DEFAULT_THRESHOLDS = (3600.0, 36000.0)     # las queues: 1 and 10 GPU-hours (a choice)


@dataclass(frozen=True)
class Costs:
    """Seconds a preempted job spends saving (checkpoint) and a resumed one loading
    (restore), holding its GPUs and making no progress."""

    checkpoint: float = 0.0
    restore: float = 0.0

    def __post_init__(self):
        if not (self.checkpoint >= 0 and self.restore >= 0) or math.isinf(
                self.checkpoint + self.restore):
            raise ValueError(f"checkpoint={self.checkpoint!r} and restore={self.restore!r} "
                             f"must be finite seconds >= 0")


@dataclass(frozen=True)
class Segment:
    """One continuous hold of GPUs by a job: [start, end) on `placement`, of which the
    first `restore` and the last `checkpoint` seconds made no progress."""

    job: str
    start: float
    end: float
    placement: Placement
    restore: float = 0.0
    checkpoint: float = 0.0

    @property
    def work(self) -> float:
        return self.end - self.start - self.restore - self.checkpoint


@dataclass(frozen=True)
class JobRecord:
    job: Job
    first_start: float
    end: float
    preemptions: int


@dataclass(frozen=True)
class Result:
    """A simulated run: per job (trace order), every GPU hold (by start), and the event
    log (time, what, job id) with what in submit|start|preempt|released|resume|finish."""

    policy: str
    cluster: Cluster
    costs: Costs
    records: tuple[JobRecord, ...]
    segments: tuple[Segment, ...]
    events: tuple[tuple[float, str, str], ...]


def simulate(jobs, cluster: Cluster, policy: str, *, costs: Costs = Costs(),
             thresholds=DEFAULT_THRESHOLDS) -> Result:
    """Run `jobs` (traces.Job) on `cluster` under `policy` (policies.NAMES); see module."""
    jobs = tuple(jobs)
    if not jobs:
        raise ValueError("simulate: the trace holds no jobs")
    if len({j.id for j in jobs}) != len(jobs):
        raise ValueError("simulate: job ids must differ")
    for j in jobs:
        cluster.check_fits(j.id, j.gpus)
    return _Sim(jobs, cluster, policy, costs, policies.make(policy, thresholds),
                tuple(thresholds)).run()


@dataclass(eq=False)
class _Run:
    """The simulator's mutable state of one job."""

    job: Job
    phase: str = "pending"
    placement: Placement = ()
    executed: float = 0.0
    busy_until: float = 0.0
    first_start: float = math.nan
    end: float = math.nan
    preemptions: int = 0
    held_since: float = 0.0
    restore: float = 0.0
    segments: list = field(default_factory=list)


class _Sim:
    def __init__(self, jobs, cluster, name, costs, decide, thresholds):
        self.cluster, self.name, self.costs = cluster, name, costs
        self.decide, self.thresholds = decide, thresholds
        self.runs = sorted((_Run(j) for j in jobs), key=lambda r: r.job.submit)  # stable
        self.by_id = {r.job.id: r for r in self.runs}
        self.order = {j.id: i for i, j in enumerate(jobs)}          # trace order
        self.pending, self.active = list(reversed(self.runs)), []   # pop() = next arrival
        self.free = [cluster.gpus_per_node] * cluster.nodes
        self.usage: dict[str, float] = {}
        self.now, self.events = 0.0, []

    def run(self) -> Result:
        same, last = 0, -1.0
        while self.pending or self.active:
            t = self._next_time()
            same = same + 1 if t == last else 0
            if same > 10 * len(self.runs) + 100:
                raise RuntimeError(f"{self.name}: no progress at t={t} (a policy cycle)")
            self._advance(t)
            last = t
            self._events_at(t)
            self._apply(self.decide(self._snapshot()))
            self._check_books()
        segs = sorted((s for r in self.runs for s in r.segments), key=lambda s: s.start)
        recs = tuple(JobRecord(r.job, r.first_start, r.end, r.preemptions)
                     for r in sorted(self.runs, key=lambda r: self.order[r.job.id]))
        return Result(self.name, self.cluster, self.costs, recs, tuple(segs),
                      tuple(self.events))

    def _next_time(self) -> float:
        times = [self.pending[-1].job.submit] if self.pending else []
        for r in self.active:
            if r.phase == "running":
                times.append(self.now + r.job.duration - r.executed)
                nxt = policies.next_threshold(r.job.gpus * r.executed, self.thresholds) \
                    if self.name == "las" else None
                if nxt is not None:
                    times.append(self.now + (nxt - r.job.gpus * r.executed) / r.job.gpus)
            elif r.phase in ("restoring", "checkpointing"):
                times.append(r.busy_until)
        if not times:
            raise RuntimeError(f"{self.name}: jobs wait on an idle cluster at t={self.now}")
        return max(min(times), self.now)

    def _advance(self, t: float) -> None:
        for r in self.active:
            if r.phase == "running":
                step = min(t - self.now, r.job.duration - r.executed)
                r.executed += step
                self.usage[r.job.user] = self.usage.get(r.job.user, 0.0) + r.job.gpus * step
        self.now = t

    def _events_at(self, t: float) -> None:
        eps = 1e-9 * max(1.0, abs(t))
        while self.pending and self.pending[-1].job.submit <= t + eps:
            r = self.pending.pop()
            r.phase = "waiting"
            self.active.append(r)
            self.events.append((t, "submit", r.job.id))
        for r in list(self.active):
            if r.phase == "restoring" and r.busy_until <= t + eps:
                r.phase = "running"
            elif r.phase == "running" and r.job.duration - r.executed <= 1e-9 * max(
                    1.0, r.job.duration):
                r.executed, r.end, r.phase = r.job.duration, t, "done"
                self._release(r, t, 0.0, "finish")
                self.active.remove(r)
            elif r.phase == "checkpointing" and r.busy_until <= t + eps:
                r.phase = "waiting"
                self._release(r, t, self.costs.checkpoint, "released")

    def _release(self, r: _Run, t: float, checkpoint: float, what: str) -> None:
        give_back(self.free, r.placement, self.cluster.gpus_per_node)
        r.segments.append(Segment(r.job.id, r.held_since, t, r.placement, r.restore,
                                  checkpoint))
        r.placement = ()
        self.events.append((t, what, r.job.id))

    def _snapshot(self) -> policies.Snapshot:
        tasks = tuple(policies.Task(r.job, r.phase, r.placement, r.executed, r.busy_until)
                      for r in self.active)
        return policies.Snapshot(self.now, self.cluster, tuple(self.free), tasks,
                                 dict(self.usage))

    def _apply(self, d: policies.Decision) -> None:
        t = self.now
        for job_id in d.preempts:
            r = self.by_id[job_id]
            if r.phase != "running":
                raise RuntimeError(f"{self.name}: preempts {job_id}, which is {r.phase}")
            r.phase, r.busy_until = "checkpointing", t + self.costs.checkpoint
            r.preemptions += 1
            self.events.append((t, "preempt", job_id))
        for job_id, spot in d.starts:
            r = self.by_id[job_id]
            if r.phase != "waiting":
                raise RuntimeError(f"{self.name}: starts {job_id}, which is {r.phase}")
            take(self.free, spot)
            resumed = r.preemptions > 0
            r.placement, r.held_since = spot, t
            r.restore = self.costs.restore if resumed else 0.0
            r.phase = "restoring" if resumed and r.restore > 0 else "running"
            r.busy_until = t + r.restore
            if math.isnan(r.first_start):
                r.first_start = t
            self.events.append((t, "resume" if resumed else "start", job_id))

    def _check_books(self) -> None:
        g = self.cluster.gpus_per_node
        held = [0] * self.cluster.nodes
        for r in self.active:
            if (r.phase == "waiting") == bool(r.placement) or sum(
                    c for _, c in r.placement) not in (0, r.job.gpus):
                raise RuntimeError(f"{self.name}: {r.job.id} ({r.phase}, {r.job.gpus} GPUs) "
                                   f"holds {r.placement} at t={self.now}")
            for node, count in r.placement:
                held[node] += count
        if any(h + f != g for h, f in zip(held, self.free)):
            raise RuntimeError(f"{self.name}: at t={self.now} GPUs held {held} + free "
                               f"{self.free} != {g} per node")
