"""bench/predict.py: the local truth runs each layout for real and prints it beside the
model's prediction for the same layout (no timing is asserted: the figures are the bench's
output, not a test's)."""

import re

import pytest

from minidist.__main__ import main as cli
from minidist.bench import predict as bench


def test_every_layout_is_a_valid_plan_of_at_most_two_ranks_and_covers_every_axis():
    from minidist.train import Plan
    plans = [Plan(**fields) for _, fields, _ in bench.LAYOUTS]
    assert all(p.world_size <= 2 for p in plans)                  # this project's 2 cores
    covered = {axis for p in plans for axis in ("dp", "tp", "pp", "cp", "ep")
               if getattr(p, axis) > 1}
    assert covered == {"dp", "tp", "pp", "cp", "ep"} and any(p.zero == 3 for p in plans)
    assert len(plans) - 1 >= 8                                     # besides one process


def test_the_table_has_a_measured_and_a_predicted_step_per_layout(capsys):
    assert cli(["bench", "predict", "--repeats", "1", "--steps", "1", "--warmup", "0",
                "--only", "1 process,tp=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [re.match(r"  (.+?) +([\d.]+) +\d+-\d+ +([\d.]+) +([+-][\d.]+)%   ", line)
            for line in out]
    rows = [m.groups() for m in rows if m]
    assert [r[0] for r in rows] == ["1 process", "tp=2"], out
    for _, measured, predicted, error in rows:
        assert float(error) == pytest.approx(100 * (float(measured) / float(predicted) - 1),
                                             abs=0.1)
    assert out[-1].endswith("%)") and " of 2 layouts within +-25%" in out[-1]
    assert all(len(line) <= 100 for line in out)


def test_an_unknown_layout_is_one_error_line(capsys):
    assert cli(["bench", "predict", "--only", "dp=9"]) == 2
    err = capsys.readouterr().err
    assert "unknown layouts ['dp=9']" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["cp=2 ring", "MoE, dp=2 ep=2"])
def test_the_prediction_of_each_layout_runs_on_this_machine_s_profile(name):
    from dataclasses import replace
    from minidist.hardware import profiles
    from minidist.hardware.predict import predict
    from minidist.train import Plan
    _, dense, moe = bench.models()
    fields, is_moe = next((f, m) for n, f, m in bench.LAYOUTS if n == name)
    p = predict(moe if is_moe else dense, replace(Plan(**fields), check_placements=False), 8,
                profiles.this_machine(measure=False), fmt="fp32", memory=False)
    assert p.step_s > 0 and p.breakdown["cp exposed" if "cp" in name else "ep exposed"] >= 0
