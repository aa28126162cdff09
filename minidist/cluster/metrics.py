"""Scheduling metrics: what a policy achieved on a trace, and an audit of what it must obey.

Per job j (submit s_j, first start f_j, end e_j, run time d_j, g_j GPUs):
    JCT (job completion time)   e_j - s_j              average and p99 over jobs
    queueing delay              f_j - s_j              (time to the first start)
    slowdown                    (e_j - s_j) / d_j      1 = never waited, never preempted
Per run (capacity M GPUs, makespan T = last end - first submit):
    utilisation   sum of GPU-seconds held / (M T)   (checkpoint and restore time included)
    useful        sum of g_j d_j / (M T)            (progress only: what the jobs needed)
    fairness      Jain's index over users of their mean slowdown x_u:
                  J = (sum x_u)^2 / (n sum x_u^2), in [1/n, 1]; 1 when every user's jobs
                  are slowed down alike (Jain, Chiu and Hawe 1984, DEC-TR-301, Sec. 3)
    preemptions   how many times a running job was stopped
p99 is numpy's percentile (linear interpolation between order statistics).

The audit re-derives the scheduler's promises from the recorded GPU holds alone, without
the simulator's state: every job ran exactly its work, paid C and R per preemption, held
exactly its gang (one node for g <= G, whole nodes above), and no node ever held more than
G GPUs (a sweep over all hold starts and ends). tests/cluster checks it independently too.

Plots (with the `plot` extra): the CDF of JCT per policy, and GPUs in use over time.
Read next: cluster/real.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from minidist.cluster.scheduler import Result

UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Report:
    policy: str
    jobs: int
    avg_jct: float
    p99_jct: float
    avg_queue: float
    p99_queue: float
    utilisation: float
    useful: float
    fairness: float
    preemptions: int
    makespan: float
    slowdown: dict                     # user -> mean slowdown


def jain(values) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2) of positive values."""
    x = np.asarray(values, dtype=float)
    return float(x.sum() ** 2 / (x.size * (x ** 2).sum()))


def summarise(result: Result) -> Report:
    """The Report of one simulated (or real) run."""
    recs = result.records
    submit = np.array([r.job.submit for r in recs])
    end = np.array([r.end for r in recs])
    first = np.array([r.first_start for r in recs])
    jct, queue = end - submit, first - submit
    slow: dict[str, list[float]] = {}
    for r, t in zip(recs, jct):
        slow.setdefault(r.job.user, []).append(t / r.job.duration)
    per_user = {u: float(np.mean(v)) for u, v in sorted(slow.items())}
    makespan = float(end.max() - submit.min())
    area = result.cluster.capacity * makespan
    held = sum((s.end - s.start) * sum(c for _, c in s.placement) for s in result.segments)
    work = sum(r.job.gpus * r.job.duration for r in recs)
    return Report(result.policy, len(recs), float(jct.mean()), float(np.percentile(jct, 99)),
                  float(queue.mean()), float(np.percentile(queue, 99)), held / area,
                  work / area, jain(list(per_user.values())),
                  sum(r.preemptions for r in recs), makespan, per_user)


def unit_for(reports) -> str:
    """A readable time unit for the table: h, min or s."""
    longest = max(r.avg_jct for r in reports)
    return "h" if longest > 2 * 3600 else "min" if longest > 120 else "s"


def table(reports, unit: str | None = None) -> list[str]:
    """One row per policy: JCT, queueing delay, utilisation, fairness, preemptions."""
    unit = unit or unit_for(reports)
    k = UNITS[unit]
    rows = [f"{'policy':<6} {'avg JCT':>9} {'p99 JCT':>9} {'avg queue':>9} {'p99 queue':>9} "
            f"{'util':>6} {'useful':>6} {'Jain':>6} {'preempt':>7}   (times in {unit})"]
    for r in reports:
        rows.append(f"{r.policy:<6} {r.avg_jct / k:9.2f} {r.p99_jct / k:9.2f} "
                    f"{r.avg_queue / k:9.2f} {r.p99_queue / k:9.2f} {r.utilisation:6.3f} "
                    f"{r.useful:6.3f} {r.fairness:6.3f} {r.preemptions:7d}")
    return rows


def audit(result: Result) -> list[str]:
    """Every broken promise of `result` as one line each; [] when all hold (module)."""
    g, c, r_cost = result.cluster.gpus_per_node, result.costs.checkpoint, result.costs.restore
    problems, by_job = [], {}
    for s in result.segments:
        by_job.setdefault(s.job, []).append(s)
    for rec in result.records:
        j, segs = rec.job, by_job.get(rec.job.id, [])
        tol = 1e-9 * max(1.0, rec.end)
        work = sum(s.work for s in segs)
        if len(segs) != rec.preemptions + 1 or abs(work - j.duration) > tol:
            problems.append(f"{j.id}: {len(segs)} holds, work {work!r} for a duration "
                            f"{j.duration!r} and {rec.preemptions} preemptions")
        paid = (sum(s.checkpoint for s in segs), sum(s.restore for s in segs))
        if any(abs(p - rec.preemptions * x) > tol for p, x in zip(paid, (c, r_cost))):
            problems.append(f"{j.id}: paid (checkpoint, restore) = {paid} for "
                            f"{rec.preemptions} preemptions")
        if segs and (segs[0].start < j.submit or segs[0].start != rec.first_start
                     or segs[-1].end != rec.end
                     or any(a.end > b.start for a, b in zip(segs, segs[1:]))):
            problems.append(f"{j.id}: holds {[(s.start, s.end) for s in segs]} do not run "
                            f"from its first start {rec.first_start} to its end {rec.end}")
        for s in segs:
            counts = [n for _, n in s.placement]
            if sum(counts) != j.gpus or (len(counts) > 1 if j.gpus <= g else set(counts) != {g}):
                problems.append(f"{j.id}: holds {s.placement}, not a gang of {j.gpus} GPUs "
                                f"placed by the rule (one node, or whole nodes of {g})")
    return problems + capacity(result)


def capacity(result: Result) -> list[str]:
    """[] if no node ever held more than G GPUs, else the first moment it did: a sweep
    over hold starts and ends in time order (ends first at equal times)."""
    g, use = result.cluster.gpus_per_node, [0] * result.cluster.nodes
    marks = sorted([(s.end, 0, s) for s in result.segments]
                   + [(s.start, 1, s) for s in result.segments], key=lambda m: m[:2])
    for t, starting, s in marks:
        for node, count in s.placement:
            use[node] += count if starting else -count
            if use[node] > g:
                return [f"t={t}: node {node} holds {use[node]} GPUs > {g}"]
    return []


def gpus_in_use(result: Result) -> tuple[np.ndarray, np.ndarray]:
    """(times, GPUs held from each time on): a step function over the run."""
    delta: dict[float, int] = {}
    for s in result.segments:
        n = sum(c for _, c in s.placement)
        delta[s.start] = delta.get(s.start, 0) + n
        delta[s.end] = delta.get(s.end, 0) - n
    times = np.array(sorted(delta))
    return times, np.cumsum([delta[t] for t in times])


def plot(results, folder: str) -> list[str]:
    """jct_cdf.png and gpus_in_use.png in `folder`; ImportError without matplotlib."""
    from matplotlib.figure import Figure                 # no pyplot: no global state
    unit = unit_for([summarise(r) for r in results])
    k = UNITS[unit]
    paths = [os.path.join(folder, n) for n in ("jct_cdf.png", "gpus_in_use.png")]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for r in results:
        jct = np.sort([(x.end - x.job.submit) / k for x in r.records])
        ax.step(jct, np.arange(1, jct.size + 1) / jct.size, where="post", label=r.policy)
    ax.set(xscale="log", xlabel=f"job completion time ({unit})", ylabel="fraction of jobs",
           title="CDF of job completion time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for r in results:
        times, used = gpus_in_use(r)
        ax.step(times / k, used, where="post", label=r.policy, lw=0.8)
    capacity = results[0].cluster.capacity
    ax.axhline(capacity, color="gray", ls=":", label=f"capacity {capacity}")
    ax.set(xlabel=f"time ({unit})", ylabel="GPUs held", title="GPUs in use")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    return paths

