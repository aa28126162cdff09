"""The simulator (cluster/scheduler.py) on Philly-like traces, checked from the outside: at
every event no node holds more than G GPUs and every holder holds exactly its gang,
placed by the rule; every job runs exactly its work and holds its GPUs for exactly
duration + preemptions x (C + R); runs are deterministic; bad input is refused.

The default run checks each policy once, on the two clusters in turn (las, the one that
preempts, on 4x8; three on 3x4, where 8-GPU jobs span nodes); the other five runs of the
policy x cluster grid are in the slow set."""

import math

import pytest

from minidist.cluster import metrics
from minidist.cluster.placement import Cluster
from minidist.cluster.policies import NAMES
from minidist.cluster.scheduler import Costs, simulate
from minidist.cluster.traces import Job, philly_trace

CLUSTERS = [Cluster(4, 8), Cluster(3, 4)]       # 8-GPU jobs on whole 4-GPU nodes too
COSTS = Costs(checkpoint=30, restore=60)


def holders_at(result, t: float) -> list:
    """The holds covering time t (a hold is [start, end))."""
    return [s for s in result.segments if s.start <= t < s.end]


def check_gangs_and_capacity(result, jobs):
    """An independent check at every event time (and just after it)."""
    g, gpus = result.cluster.gpus_per_node, {j.id: j.gpus for j in jobs}
    times = sorted({t for t, _, _ in result.events})
    for t in times:
        used = [0] * result.cluster.nodes
        holding = holders_at(result, t)
        assert len({s.job for s in holding}) == len(holding), f"t={t}: a job holds twice"
        for s in holding:
            counts = [c for _, c in s.placement]
            assert sum(counts) == gpus[s.job], f"t={t}: {s.job} holds {s.placement}"
            if gpus[s.job] <= g:
                assert len(counts) == 1, f"t={t}: {s.job} spread over nodes {s.placement}"
            else:
                assert set(counts) == {g}, f"t={t}: {s.job} not on whole nodes"
            for node, c in s.placement:
                used[node] += c
        assert max(used) <= g, f"t={t}: GPUs per node {used} > {g}"


def check_conservation(result, jobs, costs):
    by_job = {j.id: [] for j in jobs}
    for s in result.segments:
        by_job[s.job].append(s)
    for rec in result.records:
        segs, j = by_job[rec.job.id], rec.job
        held = sum(s.end - s.start for s in segs)
        expect = j.duration + rec.preemptions * (costs.checkpoint + costs.restore)
        assert held == pytest.approx(expect, rel=1e-12, abs=1e-6), j.id
        assert sum(s.work for s in segs) == pytest.approx(j.duration, rel=1e-12), j.id
        assert len(segs) == rec.preemptions + 1
        assert rec.first_start >= j.submit and rec.end == segs[-1].end


DEFAULT_RUNS = {("fifo", "3x4"), ("easy", "3x4"), ("sjf", "3x4"), ("fair", "4x8"),
                ("las", "4x8")}


@pytest.mark.parametrize("policy, cluster", [
    pytest.param(policy, cluster, id=f"{policy}-{cid}",
                 marks=() if (policy, cid) in DEFAULT_RUNS else pytest.mark.slow)
    for policy in NAMES for cluster, cid in zip(CLUSTERS, ["4x8", "3x4"])])
def test_gang_capacity_and_conservation_on_a_philly_trace(policy, cluster):
    jobs = philly_trace(120, cluster, load=1.2, seed=7)
    result = simulate(jobs, cluster, policy, costs=COSTS, thresholds=(1800.0, 18000.0))
    assert [r.job for r in result.records] == list(jobs)
    assert all(math.isfinite(r.end) for r in result.records)
    check_gangs_and_capacity(result, jobs)
    check_conservation(result, jobs, COSTS)
    assert metrics.audit(result) == []                    # the module's own audit agrees
    if policy != "las":
        assert all(r.preemptions == 0 for r in result.records)


def test_las_does_preempt_on_a_loaded_trace_and_zero_costs_change_nothing_else():
    cluster = Cluster(4, 8)
    jobs = philly_trace(120, cluster, load=1.2, seed=7)
    result = simulate(jobs, cluster, "las", costs=Costs(), thresholds=(1800.0,))
    assert sum(r.preemptions for r in result.records) > 0
    check_conservation(result, jobs, Costs())


def test_same_input_same_schedule():
    cluster = Cluster(4, 8)
    jobs = philly_trace(80, cluster, seed=1)
    for policy in NAMES:
        assert simulate(jobs, cluster, policy, costs=COSTS) == \
            simulate(jobs, cluster, policy, costs=COSTS)


def test_an_idle_gap_in_the_trace_is_crossed():
    jobs = [Job("a", 0, 1, 5), Job("b", 1000, 2, 5)]
    assert [(r.first_start, r.end) for r in simulate(jobs, Cluster(1, 2), "fifo").records] \
        == [(0, 5), (1000, 1005)]


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="holds no jobs"):
        simulate([], Cluster(1, 1), "fifo")
    with pytest.raises(ValueError, match="ids must differ"):
        simulate([Job("a", 0, 1, 1), Job("a", 1, 1, 1)], Cluster(1, 1), "fifo")
    with pytest.raises(ValueError, match="needs 4 GPUs, but the cluster has only 1 x 2"):
        simulate([Job("a", 0, 4, 1)], Cluster(1, 2), "fifo")
    with pytest.raises(ValueError, match="must be finite seconds >= 0"):
        Costs(checkpoint=-1)
    with pytest.raises(ValueError, match="gpus=0"):
        Job("a", 0, 0, 1)
