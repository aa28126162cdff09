"""The memory-budget demo runs as a user runs it: one training step under nine plans on real
ranks, every category estimated equal to what the step holds, and the ZeRO paper's Fig. 1;
it ends with its OK line. A plan given on the command line is measured too."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


# slow: nine plans on 19 ranks; the default run keeps the one-plan command-line run below
@pytest.mark.slow
def test_memory_budget_demo_matches_every_plan_and_zero_figure_1():
    rc, out = run_demo("22_memory_budget.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 22 · memory budget · GPT 2 layers, C=32"), out[0]
    at = [i for i, line in enumerate(out) if len(line.split()) == 8
          and line.split()[1].isdigit()]
    assert len(at) == 10, text                   # 9 plans, the pipeline's 2 stages
    for i in at:                                 # each estimate, and under it the step's bytes
        estimate, measured = out[i].split()[2:], out[i + 1].split()
        assert measured[0] == "measured" and len(measured) == 7, out[i + 1]
        assert all(m in (e, "-") for e, m in zip(estimate, measured[1:])), out[i:i + 2]
    assert "stage 0 120.0, stage 1" in text and "31.4, stage 2 16.6, stage 3 1.9" in text
    assert out[-1] == ("OK: estimate = measured for 9 plans on 19 ranks, every category to "
                       "the byte; ZeRO's Fig. 1 too")


def test_memory_budget_demo_takes_plans_from_the_command_line():
    rc, out = run_demo("22_memory_budget.py", "--plans", "dp=3,zero=2,mb=2", "--batch", "6",
                       "--n-layer", "3")
    assert rc == 0, "\n".join(out)
    assert out[4].split()[:2] == ["dp=3,zero=2,mb=2", "0"], out[:5]
    assert out[-1].startswith("OK: estimate = measured for 1 plan on 3 ranks")
