"""The job-scheduling demo runs as a user runs it: five policies on one Philly-like trace,
the comparison tables, and the OK line (audit clean, EASY and LAS ordered as expected);
its settings can be overridden from the command line.

The default run keeps the cheaper command-line run (60 jobs on 4 nodes, the same code path and
OK line); the full 300-job comparison is in the slow set."""

import pytest

from tests.helpers import run_demo

POLICIES = ("fifo", "easy", "sjf", "fair", "las")


@pytest.mark.slow
def test_job_scheduling_demo_compares_policies_and_ends_ok():
    rc, out = run_demo("26_job_scheduling.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0] == ("demo 26 · job scheduling · 300 jobs on 8 x 8 = 64 GPUs · offered load "
                      "1.2 · seed 0"), out[0]
    table = [line.split() for line in out if line.split()[:1] and line.split()[0] in POLICIES
             and len(line.split()) == 9]
    assert [row[0] for row in table] == list(POLICIES), text
    assert [int(row[-1]) > 0 for row in table] == [False] * 4 + [True]   # only las preempts
    assert "audit of 5 runs x 300 jobs: no broken promise" in text
    assert out[-1].startswith("OK: every policy keeps the gang and capacity rules"), text


def test_job_scheduling_demo_takes_its_settings_from_the_command_line():
    rc, out = run_demo("26_job_scheduling.py", "--jobs", "60", "--nodes", "4", "--seed", "2")
    assert rc == 0, "\n".join(out)
    assert out[0].startswith("demo 26 · job scheduling · 60 jobs on 4 x 8 = 32 GPUs"), out[0]
    assert out[-1].startswith("OK: "), out[-1]
