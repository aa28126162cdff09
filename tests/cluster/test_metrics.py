"""Metrics (cluster/metrics.py) against numbers worked out by hand for a 3-job FIFO run, and
the audit: silent on a correct run, loud on each kind of broken promise."""

import dataclasses

import numpy as np
import pytest

from minidist.cluster import metrics
from minidist.cluster.placement import Cluster
from minidist.cluster.scheduler import Costs, simulate
from minidist.cluster.traces import Job

# FIFO on 1 node x 4 GPUs: j1 runs 0..10, j2 10..15, j3 15..18 (test_policies: HOLE)
JOBS = [Job("j1", 0, 2, 10, "alice"), Job("j2", 1, 4, 5, "bob"), Job("j3", 2, 1, 3, "bob")]


def test_report_by_hand():
    r = metrics.summarise(simulate(JOBS, Cluster(1, 4), "fifo"))
    assert r.avg_jct == pytest.approx((10 + 14 + 16) / 3)
    assert r.p99_jct == pytest.approx(14 + 2 * 0.98)         # linear between 14 and 16
    assert r.avg_queue == pytest.approx((0 + 9 + 13) / 3)
    assert r.makespan == 18
    assert r.utilisation == pytest.approx((2 * 10 + 4 * 5 + 1 * 3) / (4 * 18))
    assert r.useful == r.utilisation and r.preemptions == 0
    assert r.slowdown == pytest.approx({"alice": 1.0, "bob": (14 / 5 + 16 / 3) / 2})
    x = np.array([1.0, (14 / 5 + 16 / 3) / 2])
    assert r.fairness == pytest.approx(x.sum() ** 2 / (2 * (x ** 2).sum()))


def test_jain_index_limits():
    assert metrics.jain([3, 3, 3]) == 1.0
    assert metrics.jain([1, 0, 0, 0]) == 0.25                # one user gets it all: 1/n


def test_useful_excludes_checkpoint_and_restore():
    jobs = [Job("long", 0, 1, 100), Job("short", 10, 1, 3)]
    r = metrics.summarise(simulate(jobs, Cluster(1, 1), "las", costs=Costs(1, 2),
                                   thresholds=(5,)))
    assert r.makespan == 106 and r.preemptions == 1
    assert r.utilisation == pytest.approx(106 / 106) and r.useful == pytest.approx(103 / 106)


def test_table_has_a_row_per_policy_in_a_readable_unit():
    reports = [metrics.summarise(simulate(JOBS, Cluster(1, 4), p)) for p in ("fifo", "easy")]
    rows = metrics.table(reports)
    assert rows[0].startswith("policy") and rows[0].endswith("(times in s)")
    assert rows[1].split()[:2] == ["fifo", "13.33"]            # (10 + 14 + 16) / 3
    assert rows[2].split()[:2] == ["easy", "9.00"]             # (10 + 14 + 3) / 3


def test_audit_is_silent_on_a_good_run_and_names_each_broken_promise():
    good = simulate(JOBS, Cluster(1, 4), "fifo")
    assert metrics.audit(good) == []
    s0, s1, s2 = good.segments

    def bad(*segments):
        return metrics.audit(dataclasses.replace(good, segments=segments))
    assert any("work" in p for p in bad(dataclasses.replace(s0, end=9), s1, s2))
    assert any("not a gang" in p for p in bad(s0, s1, dataclasses.replace(
        s2, placement=((0, 2),))))
    overlap = dataclasses.replace(s2, start=14, end=17)    # j3 before j2 leaves: 5 GPUs
    assert any("node 0 holds 5 GPUs > 4" in p for p in bad(s0, s1, overlap))
