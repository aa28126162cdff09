"""--real (cluster/real.py): real `minidist train` processes under a policy, preempted by
checkpoint (SIGTERM after the next committed save) and resumed from it; every job must end
with the params sha256 of the same job run start to end, and nothing may be left running.

Both tests train real jobs for seconds, so both are in the slow set; the default run keeps
the --real refusals (test_cli.py), the simulated preemptions (test_policies.py,
test_scheduler.py), and a bitwise resume from a checkpoint is in
tests/parallel/test_load_state.py."""

import re

import pytest

from minidist.cluster import metrics
from minidist.cluster.cli import main
from minidist.cluster.real import RealConfig, run_real
from minidist.cluster.traces import Job
from tests.helpers import child_pids

pytestmark = pytest.mark.multiproc


@pytest.mark.slow                                  # ~6 s: two real jobs, one preemption
def test_a_preempted_job_resumes_to_the_uninterrupted_parameters(tmp_path):
    # 1 slot, las with a 20-step threshold: b (10 steps) waits until a has done 20 of its
    # 60 steps, then preempts it; a resumes from its checkpoint when b is done.
    jobs = [Job("a", 0.0, 1, 0.6, "alice", 1.0), Job("b", 0.1, 1, 0.1, "bob", 1.0)]
    result, outcomes = run_real(jobs, "las", str(tmp_path),
                                RealConfig(slots=1, thresholds=(0.2,)))
    a, b = outcomes
    assert (a.steps, b.steps) == (60, 10)
    assert (a.preemptions, b.preemptions) == (1, 0)
    assert 0 <= a.redone <= 1                      # stopped right after a committed save
    for o in outcomes:
        assert re.fullmatch("[0-9a-f]{64}", o.digest) and o.digest == o.reference, o
    whats = [(what, job) for _, what, job in result.events if what != "submit"]
    assert whats == [("start", "a"), ("preempt", "a"), ("released", "a"), ("start", "b"),
                     ("finish", "b"), ("resume", "a"), ("finish", "a")]
    assert metrics.capacity(result) == []
    assert [len(list((tmp_path / j).glob("segment*.log"))) for j in "ab"] == [2, 1]
    assert child_pids() == []


# ~11 s (three real jobs, two preemptions): slow
@pytest.mark.slow
def test_cli_real_las_on_the_built_in_trace(capsys):
    assert main(["simulate", "--real", "--policy", "las"]) == 0
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split() for line in out.splitlines()
             if re.match(r"  [abc] ", line)}
    assert sorted(table) == ["a", "b", "c"]
    assert int(table["a"][6]) >= 1, out            # the long job was preempted
    assert all(row[-1] == "equal" for row in table.values()), out
    assert "audit: the slots held never exceeded the slots there are" in out
    assert out.rstrip().splitlines()[-1].startswith(
        "OK: every real job ended with the params sha256 of its uninterrupted run (3 jobs x "
        "1 policies")
    assert child_pids() == []
