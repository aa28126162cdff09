"""The memory-budget demo runs as a user runs it: one training step under nine plans on real
ranks, every category's estimate printed with what the step measured under it, equal to the
byte, and the ZeRO paper's Fig. 1; it ends with its OK line. A plan given on the command
line is measured too."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


def _rows(out: list[str]) -> list[tuple[list[str], list[str]]]:
    """(est row, meas row) pairs of the table, each split into words."""
    i = next(i for i, line in enumerate(out) if line.startswith("plan "))
    pairs = []
    for est, meas in zip(out[i + 1::2], out[i + 2::2]):
        if len(est.split()) < 8 or meas.split()[:1] != ["meas"]:
            break
        pairs.append((est.split(), meas.split()))
    return pairs


# slow: nine plans on 19 ranks; the default run keeps the one-plan command-line run below
@pytest.mark.slow
def test_memory_budget_demo_matches_every_plan_and_zero_figure_1():
    rc, out = run_demo("22_memory_budget.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 22 · memory budget · GPT 2 layers, C=32"), out[0]
    rows = _rows(out)
    assert len(rows) == 10, text                 # 9 plans, the pipeline's 2 stages
    assert "!" not in "".join(" ".join(meas) for _, meas in rows), text
    for est, meas in rows:                                   # every category, ZeRO-3's too
        assert meas[1:] == est[-6:], (est, meas)
    assert "stage 0 120.0, stage 1 31.4, stage 2 16.6, stage 3 1.9" in text
    assert out[-1] == ("OK: estimated bytes = measured, to the byte, for 9 plans on 19 ranks; "
                       "ZeRO's Fig. 1 = the paper's")


def test_memory_budget_demo_shows_the_measured_bytes_of_a_plan_from_the_command_line():
    rc, out = run_demo("22_memory_budget.py", "--plans", "dp=3,zero=2,mb=2", "--batch", "6",
                       "--n-layer", "3")
    assert rc == 0, "\n".join(out)
    [(est, meas)] = _rows(out)
    assert est[:3] == ["dp=3,zero=2,mb=2", "0", "est"], est
    assert meas[0] == "meas" and meas[1:] == est[3:], (est, meas)       # measured = estimated
    assert int(meas[1].replace(",", "")) > 0                            # params: real bytes
    assert out[-1].startswith("OK: estimated bytes = measured, to the byte, for 1 plan on 3 "
                              "ranks")


def test_memory_budget_demo_refuses_a_plan_it_cannot_measure_in_one_line():
    rc, out = run_demo("22_memory_budget.py", "--plans", "dp=2,precision=bf16")
    assert rc == 2 and len(out) == 1 and out[0].startswith(
        "error: --plans: dp=2,precision=bf16: precision=bf16 is estimated only"), out
