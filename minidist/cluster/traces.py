"""Job traces: who asks for how many GPUs, when, for how long -- synthetic (Philly-like) or yours.

A trace is a list of jobs. Each job has an id, a submit time, a GPU count (its gang), a run
time on those GPUs (what it would take alone, uninterrupted), a user, and a user's
runtime estimate (what a user tells a backfilling scheduler; EASY and SJF read it, the
simulator never lets a job run longer or shorter than its true run time).

Where the synthetic numbers come from, and what is a choice made here:
    * The Philly cluster (Jeon et al. 2019, ATC'19) ran DNN training for many teams; its
      public trace (github.com/msr-fiddle/philly-traces) holds 117,325 jobs submitted
      2017-08-07 .. 2017-12-22, and its machine list has servers of 2 and of 8 GPUs
      (hence 8 GPUs per node by default). The paper's Fig. 2 plots the CDF of job run
      times in four groups by GPU count (1, 2-4, 5-8, >8): curves, not a closed form.
    * The closed form used here is the Philly-derived sampler in the simulator of Gavel
      (Narayanan et al. 2020, OSDI'20, arXiv:2008.09213; stanford-futuredata/gavel,
      scheduler/utils.py: "Sample ... from the Philly distribution"): GPUs 1, 2, 4, 8
      with probability 0.70, 0.10, 0.15, 0.05; run time 10^x minutes with x ~ U(1.5, 3)
      w.p. 0.8 and x ~ U(3, 4) w.p. 0.2 (32 min to 16.7 h for most jobs, 16.7 h to 6.9
      days for a fifth). It is a parametric fit, not Jeon et al.'s own numbers, and it
      draws GPU count and run time independently, where the paper plots a run-time curve
      per size group.
    * Choices made here, not from any paper: Poisson arrivals at the rate that makes the
      offered load (GPU-seconds asked per second / GPUs) equal `load`; users drawn with
      Zipf weights 1/k (a few heavy users, as in shared clusters); estimate = run time x
      U(1, 3) (users over-estimate; Philly logs no estimates); times rounded to seconds;
      a GPU count the cluster cannot place (more GPUs than it has) is clipped to the
      largest one it can.

File format (yours): CSV with a header naming at least id,submit,gpus,duration (seconds)
and optionally user,estimate; or JSON, a list of objects with the same keys (or
{"jobs": [...]}). `save_trace` writes CSV. Example:
    id,submit,gpus,duration,user,estimate
    a,0,4,3600,alice,7200
    b,60,1,600,bob,600

References: Jeon et al. 2019, "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN
Training Workloads", USENIX ATC'19, Fig. 2; Narayanan et al. 2020, arXiv:2008.09213.
Read next: cluster/policies.py
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from minidist.cluster.placement import Cluster
from minidist.reliability import confined

GPU_COUNTS = (1, 2, 4, 8)                       # Gavel's Philly fit (module docstring)
GPU_SHARES = (0.70, 0.10, 0.15, 0.05)
RUNTIME_MIX = ((0.8, 1.5, 3.0), (0.2, 3.0, 4.0))  # (probability, log10 minutes from, to)
ESTIMATE_FACTOR = (1.0, 3.0)                    # a choice: estimate = run time x U(1, 3)
FIELDS = ("id", "submit", "gpus", "duration", "user", "estimate")
MAX_TRACE_BYTES = 256 << 20                     # ~40 B a job: millions of jobs


@dataclass(frozen=True)
class Job:
    """One job of a trace; times in seconds. estimate defaults to the true duration."""

    id: str
    submit: float
    gpus: int
    duration: float
    user: str = "user"
    estimate: float = field(default=None)        # type: ignore[assignment]

    def __post_init__(self):
        if self.estimate is None:
            object.__setattr__(self, "estimate", self.duration)
        bad = [f"{k}={v!r}" for k, v in (("submit", self.submit), ("duration", self.duration),
                                         ("estimate", self.estimate))
               if not isinstance(v, (int, float)) or not math.isfinite(v)
               or v < 0 or (k != "submit" and v == 0)]
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            bad.append(f"gpus={self.gpus!r}")
        if bad:
            raise ValueError(f"job {self.id!r}: {', '.join(bad)}; need gpus an int >= 1, "
                             f"submit >= 0, duration and estimate > 0 (seconds)")


def mean_runtime() -> float:
    """E[run time] in seconds of the mixture: E[10^x] = (10^b - 10^a) / ((b - a) ln 10)
    minutes for x ~ U(a, b)."""
    return 60 * sum(p * (10 ** b - 10 ** a) / ((b - a) * math.log(10))
                    for p, a, b in RUNTIME_MIX)


def philly_trace(n: int, cluster: Cluster, *, load: float = 0.9, users: int = 8,
                 seed: int = 0) -> tuple[Job, ...]:
    """n jobs drawn as the module docstring says; the same arguments give the same trace.
    Arrival rate = load * capacity / (E[GPUs] E[run time]) (GPU count and run time are
    independent draws, so E[GPU-seconds] is the product)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"synthetic trace: need n >= 1 jobs, got {n!r}")
    if not (isinstance(load, (int, float)) and 0 < load < math.inf) or users < 1:
        raise ValueError(f"synthetic trace: load={load!r} must be > 0 and users={users!r} "
                         f">= 1")
    rng = np.random.default_rng(seed)
    gpus = rng.choice(GPU_COUNTS, size=n, p=GPU_SHARES)
    probs = [p for p, _, _ in RUNTIME_MIX]
    part = rng.choice(len(RUNTIME_MIX), size=n, p=probs)
    lo, hi = np.array([[a, b] for _, a, b in RUNTIME_MIX]).T[:, part]
    runtime = np.maximum(np.round(60 * 10 ** rng.uniform(lo, hi)), 1.0)        # (n,) s
    estimate = np.round(runtime * rng.uniform(*ESTIMATE_FACTOR, size=n))
    rate = load * cluster.capacity / (float(np.dot(GPU_COUNTS, GPU_SHARES)) * mean_runtime())
    gaps = rng.exponential(1 / rate, size=n)
    submit = np.round(np.cumsum(gaps) - gaps[0])                  # the first job at t = 0
    weights = 1 / np.arange(1, users + 1)
    who = rng.choice(users, size=n, p=weights / weights.sum())
    fits = _placeable(cluster)
    width = len(str(n))
    return tuple(Job(f"j{i:0{width}d}", float(submit[i]), _clip(int(gpus[i]), fits),
                     float(runtime[i]), f"u{who[i] + 1}", float(estimate[i]))
                 for i in range(n))


def _placeable(cluster: Cluster) -> list[int]:
    ok = []
    for g in GPU_COUNTS:
        try:
            cluster.check_fits("?", g)
            ok.append(g)
        except ValueError:
            pass
    return ok                                   # never empty: 1 GPU fits any cluster


def _clip(g: int, fits: list[int]) -> int:
    """g itself if the cluster can place it, else the largest count it can (1 always fits)."""
    return max(f for f in fits if f <= g)


def load_trace(path: str | os.PathLike) -> tuple[Job, ...]:
    """Read a CSV or JSON trace (module docstring); ValueError naming the file and row."""
    path = os.fspath(path)
    try:
        text = confined.read_named(path, MAX_TRACE_BYTES).decode()
    except confined.Refused as e:
        raise ValueError(f"trace {e}") from None
    except OSError as e:
        raise ValueError(f"trace {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"trace {path}: not UTF-8 text ({e.reason} at byte {e.start})") \
            from None
    rows, where = _json_rows(path, text) if path.endswith(".json") else _csv_rows(path, text)
    jobs = [_job(row, f"trace {path}, {w}") for row, w in zip(rows, where)]
    if not jobs:
        raise ValueError(f"trace {path}: holds no jobs")
    seen: set[str] = set()
    for j in jobs:
        if j.id in seen:
            raise ValueError(f"trace {path}: job id {j.id!r} appears twice; ids must differ")
        seen.add(j.id)
    return tuple(sorted(jobs, key=lambda j: j.submit))         # stable: ties keep file order


def _json_rows(path: str, text: str) -> tuple[list[dict], list[str]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"trace {path}: not valid JSON ({e})") from None
    rows = rows.get("jobs") if isinstance(rows, dict) else rows
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f'trace {path}: JSON must be a list of job objects, or {{"jobs": '
                         f'[...]}}')
    return rows, [f"job {i}" for i in range(len(rows))]


def _csv_rows(path: str, text: str) -> tuple[list[dict], list[str]]:
    reader = csv.DictReader(text.splitlines())
    rows = list(reader)
    missing = [k for k in FIELDS[:4] if k not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"trace {path}: the CSV header lacks {', '.join(missing)}; it "
                         f"needs id,submit,gpus,duration[,user,estimate]")
    return rows, [f"line {i + 2}" for i in range(len(rows))]


def _job(row: dict, where: str) -> Job:
    try:
        user = row.get("user") or "user"
        estimate = row.get("estimate")
        return Job(str(row["id"]), float(row["submit"]), _int(row["gpus"]),
                   float(row["duration"]), str(user),
                   None if estimate in (None, "") else float(estimate))
    except KeyError as e:
        raise ValueError(f"{where}: no {e.args[0]!r} field") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _int(value) -> int:
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"gpus={value!r} is not a whole number")
    return int(number)


def save_trace(jobs, path: str | os.PathLike) -> None:
    """Write jobs as the CSV format `load_trace` reads."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(FIELDS)
        for j in jobs:
            out.writerow([j.id, f"{j.submit:g}", j.gpus, f"{j.duration:g}", j.user,
                          f"{j.estimate:g}"])


# The simulation's time grows about with the square of the jobs (each event looks at the
# queue): 2,000 jobs take about 3 s on this project's machines, 20,000 about 6 minutes.
MAX_JOBS = 10_000


def from_spec(spec: str, cluster: Cluster, *, load: float = 0.9, users: int = 8,
              seed: int = 0) -> tuple[Job, ...]:
    """`synthetic:N` (philly_trace) or a path to a CSV/JSON trace; every job must fit, and
    a trace holds at most MAX_JOBS jobs."""
    if spec.startswith("synthetic:"):
        count = spec.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--trace {spec}: write synthetic:N with N >= 1 jobs, e.g. "
                             f"synthetic:200")
        if int(count) > MAX_JOBS:
            raise ValueError(f"--trace {spec}: at most synthetic:{MAX_JOBS} (the simulation "
                             "time grows with the square of the jobs: 2,000 take about 3 s, "
                             "20,000 about 6 minutes)")
        return philly_trace(int(count), cluster, load=load, users=users, seed=seed)
    jobs = load_trace(spec)
    if len(jobs) > MAX_JOBS:
        raise ValueError(f"--trace {spec}: {len(jobs)} jobs; at most {MAX_JOBS} (the "
                         "simulation time grows with the square of the jobs)")
    for j in jobs:
        cluster.check_fits(j.id, j.gpus)
    return jobs
