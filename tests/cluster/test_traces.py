"""Traces (cluster/traces.py): the synthetic Philly-like generator against the distribution
it claims (shares, run-time mixture, its closed-form mean, the offered load), its seeding,
and the CSV/JSON format with its error messages."""

import json
import math
import os

import numpy as np
import pytest

from minidist.cluster import traces
from minidist.cluster.placement import Cluster
from minidist.cluster.traces import GPU_COUNTS, GPU_SHARES, Job

BIG = Cluster(8, 8)


def test_same_seed_same_trace_other_seed_other_trace():
    a = traces.philly_trace(300, BIG, seed=3)
    assert a == traces.philly_trace(300, BIG, seed=3)
    assert a != traces.philly_trace(300, BIG, seed=4)
    assert a[0].submit == 0 and all(x.submit <= y.submit for x, y in zip(a, a[1:]))


def test_gpu_shares_and_runtime_mixture_follow_the_published_fit():
    n = 20000
    jobs = traces.philly_trace(n, BIG, seed=0)
    gpus = np.array([j.gpus for j in jobs])
    for g, p in zip(GPU_COUNTS, GPU_SHARES):           # binomial counts: 5 sigma
        assert abs((gpus == g).sum() - n * p) < 5 * math.sqrt(n * p * (1 - p)), g
    minutes = np.array([j.duration for j in jobs]) / 60
    assert minutes.min() >= 10 ** 1.5 - 1 and minutes.max() <= 10 ** 4 + 1
    long = (minutes > 1000).mean()                      # the U(3, 4) part: 0.2 of jobs
    assert abs(long - 0.2) < 5 * math.sqrt(0.2 * 0.8 / n)
    # closed form of E[10^x] for the mixture, against the sample mean
    assert np.mean(minutes * 60) == pytest.approx(traces.mean_runtime(), rel=0.05)
    assert traces.mean_runtime() / 60 == pytest.approx(
        0.8 * (1000 - 10 ** 1.5) / (1.5 * math.log(10)) + 0.2 * 9000 / math.log(10))
    est = np.array([j.estimate / j.duration for j in jobs])
    assert est.min() >= 1 - 1e-3 and est.max() <= 3 + 1e-3


def test_offered_load_is_what_was_asked():
    jobs = traces.philly_trace(20000, BIG, load=0.7, seed=1)
    asked = sum(j.gpus * j.duration for j in jobs)
    span = jobs[-1].submit
    assert asked / (BIG.capacity * span) == pytest.approx(0.7, rel=0.08)


def test_users_follow_zipf_weights():
    jobs = traces.philly_trace(20000, BIG, users=4, seed=2)
    share = {u: sum(j.user == u for j in jobs) / len(jobs) for u in ("u1", "u2", "u3", "u4")}
    h = 1 + 1 / 2 + 1 / 3 + 1 / 4
    for k in range(1, 5):
        assert share[f"u{k}"] == pytest.approx(1 / k / h, abs=0.015)


def test_gpu_counts_a_small_cluster_cannot_place_are_clipped():
    jobs = traces.philly_trace(2000, Cluster(1, 4), seed=0)
    assert {j.gpus for j in jobs} == {1, 2, 4}
    assert sum(j.gpus == 4 for j in jobs) == pytest.approx(2000 * 0.2, rel=0.15)


def test_csv_and_json_round_trip(tmp_path):
    jobs = traces.philly_trace(40, BIG, seed=5)
    path = tmp_path / "t.csv"
    traces.save_trace(jobs, path)
    assert traces.load_trace(path) == jobs
    rows = [dict(id=j.id, submit=j.submit, gpus=j.gpus, duration=j.duration, user=j.user,
                 estimate=j.estimate) for j in jobs]
    (tmp_path / "t.json").write_text(json.dumps({"jobs": rows}))
    assert traces.load_trace(tmp_path / "t.json") == jobs


def test_minimal_csv_defaults_user_and_estimate_and_sorts_by_submit(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,submit,gpus,duration\nb,60,1,600\na,0,4,3600\n")
    assert traces.load_trace(path) == (Job("a", 0.0, 4, 3600.0, "user", 3600.0),
                                       Job("b", 60.0, 1, 600.0, "user", 600.0))


@pytest.mark.parametrize("text, message", [
    ("id,submit,duration\na,0,5\n", "the CSV header lacks gpus"),
    ("id,submit,gpus,duration\na,0,1.5,5\n", "line 2: gpus='1.5' is not a whole number"),
    ("id,submit,gpus,duration\na,0,1,5\nb,0,0,5\n", "line 3: job 'b': gpus=0"),
    ("id,submit,gpus,duration\na,0,1,-5\n", "duration=-5.0"),
    ("id,submit,gpus,duration\na,0,1,5\na,1,1,5\n", "job id 'a' appears twice"),
    ("id,submit,gpus,duration\n", "holds no jobs"),
])
def test_bad_csv_says_where_and_what(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        traces.load_trace(path)


def test_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="write synthetic:N"):
        traces.from_spec("synthetic:0", BIG)
    with pytest.raises(ValueError, match="cannot read it"):
        traces.from_spec(str(tmp_path / "missing.csv"), BIG)
    path = tmp_path / "t.csv"
    path.write_text("id,submit,gpus,duration\nx,0,12,5\n")
    with pytest.raises(ValueError, match="job x needs 12 GPUs"):
        traces.from_spec(str(path), BIG)


@pytest.mark.parametrize("make, why", [
    (lambda p: "/dev/zero", "is a character device, not a regular file"),
    (lambda p: (os.mkfifo(p / "fifo.csv"), p / "fifo.csv")[1], "is a FIFO"),
    (lambda p: (p / "bad.csv").write_bytes(b"id,submit\n\xff\xfe\n") and p / "bad.csv",
     "not UTF-8 text"),
])
def test_a_trace_that_is_a_device_a_fifo_or_not_text_is_one_line(tmp_path, make, why):
    """A trace the user names is read bounded and never blocks (issue: every reader of a
    user's file ends in one line, not a hang, an unbounded read or a traceback)."""
    with pytest.raises(ValueError, match=why) as info:
        traces.load_trace(make(tmp_path))
    assert "\n" not in str(info.value)
