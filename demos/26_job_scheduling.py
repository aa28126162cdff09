"""Job scheduling: five policies on one Philly-like trace of training jobs, side by side.

What you will see: a synthetic trace (GPU counts and run times from the Philly fit, Poisson
arrivals at the asked load) run on an 8 x 8-GPU cluster under FIFO, EASY backfilling,
shortest-job-first, fair share and Tiresias' LAS with preemption (30 s checkpoint + 60 s
restore per preemption). A table compares average and p99 job completion time (JCT),
queueing delay, utilisation, Jain's fairness and preemptions; a second one splits the JCT
into short and long jobs: FIFO makes short jobs wait behind long ones, EASY lets them
into the holes, SJF and LAS put them first -- LAS without knowing any run time. Then every
run is audited: each job ran exactly its work, paid its preemptions, held exactly its gang.

Run:       python demos/26_job_scheduling.py [--jobs 300 --load 1.2 --seed 0]
Read with: minidist/cluster/placement.py, traces.py, policies.py, scheduler.py, metrics.py
Real jobs: python -m minidist cluster simulate --real --policy las   (cluster/real.py)
Paper:     Jeon et al. 2019, "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN
           Training Workloads", ATC'19 (Philly); Gu et al. 2019, "Tiresias", NSDI'19,
           Sec. 3.2 (2D-LAS); Mu'alem and Feitelson 2001, IEEE TPDS 12(6) (EASY)
"""

import argparse

import numpy as np

from minidist.cli import CliParser
from minidist.cluster import metrics
from minidist.cluster.placement import Cluster
from minidist.cluster.policies import NAMES
from minidist.cluster.scheduler import DEFAULT_THRESHOLDS, Costs, simulate
from minidist.cluster.traces import GPU_COUNTS, GPU_SHARES, philly_trace

# --- settings (each can be overridden on the command line) ---
JOBS, NODES, GPUS_PER_NODE, LOAD, SEED, CHECKPOINT, RESTORE = 300, 8, 8, 1.2, 0, 30.0, 60.0
SHORT, LONG = 2 * 3600, 100 * 3600             # GPU-seconds: short < 2, long > 100 GPU-h
WHAT = {"fifo": "submit order; the oldest job blocks everyone behind it",
        "easy": "FIFO + backfill jobs that do not delay the oldest one's reservation",
        "sjf": "shortest user estimate first (big and long jobs can starve)",
        "fair": "next job from the user holding the fewest GPUs now",
        "las": "least attained GPU-time first, in queues; preempts (C + R per preemption)"}


# each number option's (low, high): the simulation stays a few seconds
LIMITS = dict(jobs=(1, 5000), nodes=(1, 256), gpus_per_node=(1, 16), load=(0.01, 10.0),
              seed=(0, 2 ** 32), checkpoint=(0.0, 86400.0), restore=(0.0, 86400.0))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(jobs=JOBS, nodes=NODES, gpus_per_node=GPUS_PER_NODE, load=LOAD,
                        seed=SEED, checkpoint=CHECKPOINT, restore=RESTORE), LIMITS)
    a = ap.parse_args(argv)
    return a


def describe(jobs) -> None:
    """The trace against the fit it was drawn from."""
    gpus = np.array([j.gpus for j in jobs])
    hours = np.array([j.duration for j in jobs]) / 3600
    shares = "  ".join(f"{g} GPU: {np.mean(gpus == g):.2f} ({p:.2f})"
                       for g, p in zip(GPU_COUNTS, GPU_SHARES))
    print(f"jobs per GPU count, drawn (fit):\n  {shares}")
    q = np.percentile(hours, [10, 50, 90, 99])
    print(f"run time: p10 {q[0]:.2f} h, median {q[1]:.2f} h, p90 {q[2]:.1f} h, p99 "
          f"{q[3]:.1f} h\n  (fit: 10^U(1.5,3) min w.p. 0.8, 10^U(3,4) min w.p. 0.2); "
          f"{len({j.user for j in jobs})} users; last submit at "
          f"{jobs[-1].submit / 3600:.0f} h")


def by_size(results) -> dict[str, tuple[float, float]]:
    """policy -> (avg JCT of short jobs, of long jobs), hours; sizes in GPU-seconds."""
    out = {}
    for r in results:
        jct = {k: [x.end - x.job.submit for x in r.records
                   if (x.job.gpus * x.job.duration < SHORT if k == "short"
                       else x.job.gpus * x.job.duration > LONG)] for k in ("short", "long")}
        out[r.policy] = tuple(np.mean(jct[k]) / 3600 if jct[k] else float("nan")
                              for k in ("short", "long"))
    return out


def verdict(results, reports, sizes) -> int:
    """The audit of every run and the expected orderings: the OK line, or MISMATCH."""
    problems = [f"{r.policy}: {p}" for r in results for p in metrics.audit(r)]
    print(f"\naudit of {len(results)} runs x {len(results[0].records)} jobs: "
          + ("no broken promise" if not problems else f"{len(problems)} problems"))
    checks = {
        "every run passes the audit (work, C + R per preemption, gangs, capacity)":
            not problems,
        "EASY's average queueing delay <= FIFO's":
            reports["easy"].avg_queue <= reports["fifo"].avg_queue,
        "LAS's short jobs finish no later on average than under FIFO":
            sizes["las"][0] <= sizes["fifo"][0] or np.isnan(sizes["fifo"][0]),  # none short
        "only LAS preempts": all(reports[n].preemptions == 0 for n in NAMES if n != "las"),
    }
    failed = [k for k, ok in checks.items() if not ok]
    if failed or problems:
        print("MISMATCH: " + "; ".join(failed + problems[:5]))
        return 1
    print(f"as expected: EASY's average queue {reports['easy'].avg_queue / 3600:.2f} <= FIFO's "
          f"{reports['fifo'].avg_queue / 3600:.2f} h; LAS's short-job JCT "
          f"{sizes['las'][0]:.2f} <= FIFO's {sizes['fifo'][0]:.2f} h")
    print("OK: every policy keeps the gang and capacity rules and each job's exact work; EASY, "
          "LAS as expected")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    cluster, costs = Cluster(a.nodes, a.gpus_per_node), Costs(a.checkpoint, a.restore)
    jobs = philly_trace(a.jobs, cluster, load=a.load, seed=a.seed)
    print(f"demo 26 · job scheduling · {a.jobs} jobs on {a.nodes} x {a.gpus_per_node} = "
          f"{cluster.capacity} GPUs · offered load {a.load:g} · seed {a.seed}")
    describe(jobs)
    print(f"preemption costs C = {a.checkpoint:g} s + R = {a.restore:g} s; las queues at "
          f"{', '.join(f'{t / 3600:g}' for t in DEFAULT_THRESHOLDS)} GPU-hours\n")
    for name in NAMES:
        print(f"  {name:<5} {WHAT[name]}")
    results = [simulate(jobs, cluster, name, costs=costs) for name in NAMES]
    reports = {r.policy: r for r in map(metrics.summarise, results)}
    print("\n" + "\n".join(metrics.table(list(reports.values()), "h")))
    sizes = by_size(results)
    n_short = sum(j.gpus * j.duration < SHORT for j in jobs)
    n_long = sum(j.gpus * j.duration > LONG for j in jobs)
    print(f"\naverage JCT (h) of the {n_short} short jobs (< {SHORT // 3600} GPU-h) and the "
          f"{n_long} long ones (> {LONG // 3600} GPU-h):")
    for name, (short, long) in sizes.items():
        print(f"  {name:<5} short {short:8.2f}   long {long:8.2f}")
    print("Jain's index is over users' mean slowdown (JCT / run time): fair share equalises "
          "GPUs held,\nnot slowdowns, so a heavy user's jobs still wait longer under it.")
    return verdict(results, reports, sizes)


if __name__ == "__main__":
    raise SystemExit(main())
