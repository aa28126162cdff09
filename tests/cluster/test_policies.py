"""Each policy on hand-made traces whose right answer is worked out by hand (or by brute
force): FIFO blocks behind its head, EASY starts a short job in the hole without delaying
the head, SJF's order minimises the mean completion time, fair share alternates users, and
Tiresias' LAS preempts the long job, pays C + R, and moves jobs between queues."""

import itertools

import pytest

from minidist.cluster import policies
from minidist.cluster.placement import Cluster
from minidist.cluster.scheduler import Costs, simulate
from minidist.cluster.traces import Job


def times(result) -> dict[str, tuple[float, float]]:
    """job id -> (first start, end)."""
    return {r.job.id: (r.first_start, r.end) for r in result.records}


# 1 node of 4 GPUs. j1 holds 2 GPUs for 10 s; j2 wants all 4 at t=1: it cannot start
# before j1 ends (t=10), leaving a 2-GPU hole from t=1 to 10. j3 (1 GPU, 3 s) arrives at 2.
HOLE = [Job("j1", 0, 2, 10), Job("j2", 1, 4, 5), Job("j3", 2, 1, 3)]


def test_fifo_blocks_behind_the_head():
    assert times(simulate(HOLE, Cluster(1, 4), "fifo")) == {
        "j1": (0, 10), "j2": (10, 15), "j3": (15, 18)}


def test_easy_backfills_the_short_job_into_the_hole():
    # the head j2's reservation is t=10 (j1's estimate); j3 ends at 5 <= 10: backfilled
    assert times(simulate(HOLE, Cluster(1, 4), "easy")) == {
        "j1": (0, 10), "j2": (10, 15), "j3": (2, 5)}


def test_easy_does_not_backfill_a_job_that_would_delay_the_head():
    # j3 now runs 20 s: it would still hold a GPU at t=10, when j2 needs all four
    jobs = HOLE[:2] + [Job("j3", 2, 1, 20)]
    assert times(simulate(jobs, Cluster(1, 4), "easy")) == {
        "j1": (0, 10), "j2": (10, 15), "j3": (15, 35)}


def test_easy_trusts_the_estimate_not_the_true_run_time():
    # j3 runs 3 s but its user says 20 s: EASY must refuse it, as above
    jobs = HOLE[:2] + [Job("j3", 2, 1, 3, estimate=20)]
    assert times(simulate(jobs, Cluster(1, 4), "easy"))["j3"] == (15, 18)


def test_easy_backfills_a_long_job_onto_gpus_the_head_will_not_need():
    # j1 holds 3 of 4 GPUs until 10; the head j2 needs 2, so at t=10 two GPUs are extra:
    # j3 (1 GPU, 100 s) may take one of them although it ends long after the reservation
    jobs = [Job("j1", 0, 3, 10), Job("j2", 1, 2, 5), Job("j3", 2, 1, 100)]
    assert times(simulate(jobs, Cluster(1, 4), "easy")) == {
        "j1": (0, 10), "j2": (10, 15), "j3": (2, 102)}
    assert times(simulate(jobs, Cluster(1, 4), "fifo"))["j3"] == (10, 110)


def test_sjf_runs_shortest_first_and_that_minimises_mean_jct():
    durations = [8, 2, 5, 1, 7, 3]
    jobs = [Job(f"j{i}", 0, 1, d) for i, d in enumerate(durations)]
    got = simulate(jobs, Cluster(1, 1), "sjf")
    order = sorted(got.records, key=lambda r: r.first_start)
    assert [r.job.duration for r in order] == sorted(durations)
    mean = sum(r.end for r in got.records) / len(jobs)
    best = min(sum(itertools.accumulate(p)) for p in itertools.permutations(durations))
    assert mean == best / len(jobs)                       # brute force over 720 orders


def test_fifo_runs_in_submit_order_with_its_closed_form():
    durations = [8, 2, 5, 1, 7, 3]
    jobs = [Job(f"j{i}", i * 0.5, 1, d) for i, d in enumerate(durations)]
    ends = [r.end for r in simulate(jobs, Cluster(1, 1), "fifo").records]
    assert ends == list(itertools.accumulate(durations))


def test_fair_share_alternates_users_where_fifo_serves_them_in_turn():
    jobs = [Job(f"a{i}", 0, 1, 1, "alice") for i in range(3)] + \
        [Job(f"b{i}", 0, 1, 1, "bob") for i in range(3)]
    def order(policy):
        return [r.job.id for r in sorted(simulate(jobs, Cluster(1, 1), policy).records,
                                         key=lambda r: r.first_start)]
    assert order("fifo") == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert order("fair") == ["a0", "b0", "a1", "b1", "a2", "b2"]
    # with two GPUs free at once, the second goes to the other user too
    two = [r.job.id for r in simulate(jobs, Cluster(1, 2), "fair").records
           if r.first_start == 0]
    assert two == ["a0", "b0"]


def test_las_preempts_the_long_job_and_pays_checkpoint_and_restore():
    # 1 GPU, threshold 5 GPU-s, C = 1 s, R = 2 s. At t=10 the long job has 10 GPU-s (queue
    # 1); the new short job has 0 (queue 0): long checkpoints 10..11, short runs 11..14,
    # long restores 14..16 and runs its remaining 90 s: ends at 106.
    jobs = [Job("long", 0, 1, 100), Job("short", 10, 1, 3)]
    got = simulate(jobs, Cluster(1, 1), "las", costs=Costs(1, 2), thresholds=(5,))
    assert times(got) == {"long": (0, 106), "short": (11, 14)}
    assert [r.preemptions for r in got.records] == [1, 0]
    assert [(s.job, s.start, s.end, s.checkpoint, s.restore) for s in got.segments] == [
        ("long", 0, 11, 1, 0), ("short", 11, 14, 0, 0), ("long", 14, 106, 0, 2)]
    # FIFO lets the short job wait 90 s
    assert times(simulate(jobs, Cluster(1, 1), "fifo"))["short"] == (100, 103)


def test_las_waits_for_the_demotion_not_the_arrival():
    # threshold 50 GPU-s: at t=3 the long job has 3, so both are in queue 0, FIFO inside:
    # no preemption then. At t=50 the long job reaches queue 1 and the short one takes over.
    jobs = [Job("long", 0, 1, 100), Job("short", 3, 1, 3)]
    got = simulate(jobs, Cluster(1, 1), "las", thresholds=(50,))
    assert times(got) == {"long": (0, 103), "short": (50, 53)}


def test_las_demotion_is_an_event_and_queues_are_fifo_inside():
    # A reaches 5 GPU-s at t=5 (queue 1): B (queue 0) preempts it; B reaches 5 at t=10:
    # now both are in queue 1 and A came first, so A preempts B and finishes at 25.
    jobs = [Job("A", 0, 1, 20), Job("B", 1, 1, 20)]
    got = simulate(jobs, Cluster(1, 1), "las", thresholds=(5,))
    assert times(got) == {"A": (0, 25), "B": (5, 40)}
    assert [(t, what, j) for t, what, j in got.events if what in ("preempt", "resume")] == [
        (5, "preempt", "A"), (10, "preempt", "B"), (10, "resume", "A"), (25, "resume", "B")]


def test_las_preempts_only_the_victims_it_needs():
    # One pass of las on a snapshot: 2 nodes x 2 GPUs, node 0 runs r0 and r4, node 1 runs
    # r2 and r3, all in queue 1 (threshold 20 GPU-s); a 2-GPU job waits in queue 0.
    # Releasing victims lowest priority first (r4, r3, r2: later submits rank lower) makes
    # the gang fit only after r2; r4, on the other node, did not help and is kept.
    run = [("r0", 0, 0), ("r2", 1, 1), ("r3", 2, 1), ("r4", 3, 0)]
    tasks = tuple(policies.Task(Job(j, t, 1, 100), "running", ((node, 1),), executed=30)
                  for j, t, node in run) + (policies.Task(Job("big", 40, 2, 5), "waiting"),)
    snap = policies.Snapshot(40.0, Cluster(2, 2), (0, 0), tasks, {})
    decision = policies.las(snap, (20.0,))
    assert sorted(decision.preempts) == ["r2", "r3"]
    assert decision.starts == ()                   # big waits for their checkpoints
    # with r2 and r3 checkpointing, the next pass promises big their node: no new victims
    leaving = tuple(policies.Task(t.job, "checkpointing", t.placement, 30)
                    if t.job.id in ("r2", "r3") else t for t in tasks)
    again = policies.las(policies.Snapshot(40.0, Cluster(2, 2), (0, 0), leaving, {}), (20.,))
    assert again == policies.Decision()


def test_policy_names_and_thresholds_are_checked():
    with pytest.raises(ValueError, match="choose one of fifo, easy, sjf, fair, las"):
        policies.make("srtf")
    with pytest.raises(ValueError, match="must be > 0 and increasing"):
        policies.make("las", (10, 5))
    assert policies.level(5 - 1e-12, (5, 50)) == 1 and policies.level(4.9, (5, 50)) == 0
    assert policies.next_threshold(60, (5, 50)) is None
