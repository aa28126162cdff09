"""`python -m minidist cluster simulate`: run a trace under one policy or all, print the table.

    python -m minidist cluster simulate --policy all --trace synthetic:200 [--seed 0]
    python -m minidist cluster simulate --policy las --trace my_jobs.csv --nodes 4 \\
        --gpus-per-node 8 --checkpoint-cost 30 --restore-cost 60 --plot plots/
    python -m minidist cluster simulate --real --policy las [--slots 2]

Simulation (scheduler.py): prints the trace, one row of metrics per policy (metrics.py),
then the audit of every run (exact work, exact gangs, capacity never exceeded); exit 1 if
the audit finds anything. --real (real.py) runs tiny `minidist train` jobs as processes
instead and checks each against its uninterrupted run; exit 1 on a mismatch. Usage errors:
one `error:` line on stderr, exit 2.
Read with: cluster/scheduler.py, cluster/policies.py, cluster/real.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from minidist.cli import CliParser, at_least, cli_error, directory
from minidist.cluster import metrics, real, traces
from minidist.cluster.placement import Cluster
from minidist.cluster.policies import NAMES
from minidist.cluster.scheduler import DEFAULT_THRESHOLDS, Costs, simulate


def _arguments() -> CliParser:
    ap = CliParser(prog="python -m minidist cluster",
                   description="Job scheduling on a shared GPU cluster (minidist/cluster/).")
    sub = ap.add_subparsers(dest="command", required=True, metavar="simulate")
    p = sub.add_parser("simulate", help="run a trace under scheduling policies",
                       description=__doc__.split("\n\n")[2].replace("\n", " "))
    p.add_argument("--policy", default="all", choices=[*NAMES, "all"],
                   help="the policy, or all of them side by side (default all)")
    p.add_argument("--trace", default=None, metavar="T",
                   help="synthetic:N (Philly-like, traces.py) or a CSV/JSON file "
                        "(default synthetic:200; with --real the built-in 3-job trace)")
    p.add_argument("--nodes", type=at_least(1), default=None, help="nodes (default 8)")
    p.add_argument("--gpus-per-node", type=at_least(1), default=None, help="(default 8)")
    p.add_argument("--load", type=at_least(1e-9, float), default=0.9,
                   help="synthetic: GPU-seconds asked per second / GPUs (default 0.9)")
    p.add_argument("--users", type=at_least(1), default=8, help="synthetic: users (8)")
    p.add_argument("--seed", type=at_least(0), default=0, help="synthetic: seed (default 0)")
    p.add_argument("--checkpoint-cost", type=at_least(0.0, float), default=30.0,
                   metavar="S", help="seconds a preempted job saves (default 30)")
    p.add_argument("--restore-cost", type=at_least(0.0, float), default=60.0, metavar="S",
                   help="seconds a resumed job loads (default 60)")
    p.add_argument("--las-thresholds", default=None, metavar="X,Y",
                   help="las queue boundaries in GPU-seconds (default 3600,36000; with "
                        "--real 0.5 slot-seconds)")
    p.add_argument("--events", type=at_least(0), default=0, metavar="N",
                   help="print the first N scheduling events of each run")
    p.add_argument("--save-trace", metavar="CSV", help="write the trace used to this file")
    p.add_argument("--plot", type=directory, metavar="DIR",
                   help="write jct_cdf.png and gpus_in_use.png here")
    p.add_argument("--real", action="store_true",
                   help="run real `minidist train` jobs as processes (real.py)")
    p.add_argument("--slots", type=at_least(1), default=2, help="--real: slots (GPUs), 2")
    p.add_argument("--step-time", type=at_least(1e-6, float), default=0.01, metavar="S",
                   help="--real: trace seconds per training step (default 0.01)")
    p.add_argument("--workdir", metavar="DIR",
                   help="--real: keep checkpoints and logs here (default: a temporary dir)")
    return ap


def _thresholds(text: str | None, default) -> tuple[float, ...]:
    if text is None:
        return tuple(default)
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--las-thresholds {text!r}: write numbers separated by commas, "
                         f"e.g. 3600,36000") from None


def main(argv: list[str] | None = None) -> int:
    """The exit code of `python -m minidist cluster ARGV` (module docstring)."""
    a = _arguments().parse_args(argv)
    names = list(NAMES) if a.policy == "all" else [a.policy]
    try:
        if a.plot and not os.path.isdir(a.plot):
            raise ValueError(f"--plot {a.plot}: no such folder; create it first")
        if a.real:
            return _real(a, names)
        cluster = Cluster(a.nodes or 8, a.gpus_per_node or 8)
        spec = a.trace or "synthetic:200"
        jobs = traces.from_spec(spec, cluster, load=a.load, users=a.users, seed=a.seed)
        costs = Costs(a.checkpoint_cost, a.restore_cost)
        thresholds = _thresholds(a.las_thresholds, DEFAULT_THRESHOLDS)
        results = [simulate(jobs, cluster, n, costs=costs, thresholds=thresholds)
                   for n in names]
        if a.save_trace:
            try:
                traces.save_trace(jobs, a.save_trace)
            except OSError as e:
                raise ValueError(f"--save-trace {a.save_trace}: cannot write it "
                                 f"({e.strerror})") from None
    except ValueError as e:
        return cli_error(e)
    print("\n".join(_describe(spec, jobs, cluster, costs, thresholds, a)))
    return _report(results, a)


def _describe(spec, jobs, cluster, costs, thresholds, a) -> list[str]:
    gpus = [j.gpus for j in jobs]
    sizes = "/".join(f"{g}:{gpus.count(g)}" for g in sorted(set(gpus)))
    hours = np.array([j.duration for j in jobs]) / 3600
    what = f"Philly-like, seed {a.seed}, load {a.load:g}" if spec.startswith("synthetic:") \
        else "from file"
    return [f"trace {spec} ({what}): {len(jobs)} jobs of {len({j.user for j in jobs})} users,"
            f" GPUs per job {sizes}, run time median {np.median(hours):.2f} h, max "
            f"{hours.max():.1f} h, last submit at {max(j.submit for j in jobs) / 3600:.1f} h",
            f"cluster {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = "
            f"{cluster.capacity}; preemption: checkpoint {costs.checkpoint:g} s + restore "
            f"{costs.restore:g} s; las thresholds {', '.join(f'{t:g}' for t in thresholds)}"
            f" GPU-s"]


def _report(results, a) -> int:
    """The table, the events asked for, the audit, the plots; the exit code."""
    reports = [metrics.summarise(r) for r in results]
    print("\n".join(metrics.table(reports)))
    for r in results if a.events else []:
        print(f"first {a.events} events of {r.policy}: " + "; ".join(
            f"{t:g} {what} {job}" for t, what, job in r.events[:a.events]))
    check = metrics.capacity if a.real else metrics.audit
    problems = [f"{r.policy}: {p}" for r in results for p in check(r)]
    if problems:
        print("audit FAILED:\n  " + "\n  ".join(problems))
    elif a.real:
        print("audit: the slots held never exceeded the slots there are")
    else:
        print("audit: every job ran exactly its work, paid C + R per preemption, held "
              "exactly its gang, and no node ever held more than its GPUs")
    if a.plot:
        try:
            paths = metrics.plot(results, a.plot)
            print("plots: " + ", ".join(paths))
        except ImportError:
            print("--plot: matplotlib is not installed (pip install 'minidist[plot]'); no "
                  "plots written")
    return 1 if problems else 0


def _real(a, names) -> int:
    """--real: each policy on the trace with real processes; compare digests."""
    if a.nodes or a.gpus_per_node:
        raise ValueError("--real runs on this machine's --slots; --nodes and "
                         "--gpus-per-node are for the simulation")
    if a.trace and a.trace.startswith("synthetic:"):
        raise ValueError("--real: synthetic traces last days; give a small CSV/JSON trace "
                         "(times in seconds, a job trains duration / --step-time steps) or "
                         "none for the built-in one")
    jobs = traces.load_trace(a.trace) if a.trace else real.DEMO_TRACE
    used = [n for n in names if a.workdir and os.path.exists(os.path.join(a.workdir, n))]
    if used:
        raise ValueError(f"--workdir {a.workdir} already holds {used[0]}/ from an earlier "
                         f"run (its jobs would resume from its checkpoints); give a new one")
    cfg = real.RealConfig(a.slots, a.step_time, _thresholds(a.las_thresholds, (0.5,)))
    for j in jobs:
        if j.gpus > cfg.slots:
            raise ValueError(f"--real: job {j.id} needs {j.gpus} slots, but --slots is "
                             f"{cfg.slots}; give --slots {j.gpus} or more")
        if real.steps_of(j, cfg) > real.MAX_STEPS:
            raise ValueError(f"--real: job {j.id} would train {real.steps_of(j, cfg)} steps "
                             f"({j.duration:g} s / --step-time {cfg.step_time:g}); --real is "
                             f"for tiny jobs of at most {real.MAX_STEPS} steps")
    results, bad = [], 0
    with tempfile.TemporaryDirectory(prefix="minidist-cluster-") as tmp:
        for name in names:
            folder = os.path.join(a.workdir or tmp, name)
            print(f"== real run · policy {name} · {cfg.slots} slots · {len(jobs)} jobs "
                  f"(minidist train, checkpoint every step) · {folder}", flush=True)
            try:
                result, outcomes = real.run_real(jobs, name, folder, cfg)
            except RuntimeError as e:               # a job failed, or the run timed out
                print(f"error: {e}", file=sys.stderr)
                return 1
            results.append(result)
            bad += _real_rows(result, outcomes)
    print("real runs: times in wall-clock seconds; `useful` counts steps x --step-time, a "
          "nominal amount of work")
    code = _report(results, a)
    if bad:
        print(f"MISMATCH: {bad} job(s) ended with other parameters than their "
              f"uninterrupted runs")
        return 1
    total = sum(r.preemptions for res in results for r in res.records)
    print(f"OK: every real job ended with the params sha256 of its uninterrupted run "
          f"({len(jobs)} jobs x {len(names)} policies, {total} preemptions)")
    return code


def _real_rows(result, outcomes) -> int:
    """Print the events and one line per job; return how many digests differ."""
    print("events: " + "; ".join(f"{t:.2f} s {what} {job}" for t, what, job in result.events))
    print(f"  {'job':<6} {'slots':>5} {'steps':>5} {'submit':>6} {'start':>6} {'end':>6} "
          f"{'preempt':>7} {'redone':>6}  params sha256 (scheduled / uninterrupted)")
    for rec, o in zip(result.records, outcomes):
        same = "equal" if o.digest == o.reference else "DIFFERENT"
        print(f"  {o.job:<6} {rec.job.gpus:>5} {o.steps:>5} {rec.job.submit:6.2f} "
              f"{rec.first_start:6.2f} {rec.end:6.2f} {o.preemptions:>7} {o.redone:>6}  "
              f"{o.digest[:16]} / {o.reference[:16]} {same}")
    return sum(o.digest != o.reference for o in outcomes)


if __name__ == "__main__":
    sys.exit(main())
