"""The checkpoint interval (reliability/interval.py): Young's and Daly's optima from their
closed forms and Daly's own numbers, the expected-time model against its limits and its
optimum, the simulation against the model, the Llama 3 MTBF, and the CLI.

In the slow set: the simulation's slowest case (M = 15 min, ~0.4 s), the wall-clock bound on
the simulation (timing-dependent), `python -m minidist interval` in a subprocess and the
matplotlib plot; the CLI is run in-process by default."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist.reliability import interval as iv
from minidist.reliability import interval_cli

MIN, HOUR = 60.0, 3600.0


def test_young_is_sqrt_2cm():
    assert iv.young_interval(30, 3 * HOUR) == math.sqrt(2 * 30 * 3 * HOUR)
    assert iv.young_interval(2, 9) == 6.0
    assert iv.young_interval(5 * MIN, 24 * HOUR) == 2 * HOUR       # sqrt(2 * 1/12 h * 24 h)


@pytest.mark.parametrize("mtbf, minutes", [(24 * HOUR, 117), (6 * HOUR, 57), (15 * MIN, 9.1)])
def test_daly_matches_the_papers_own_numbers(mtbf, minutes):
    # Daly 2006, Figs. 3-5: delta = 5 min, R = 10 min; "the new model predicts tau_opt = ..."
    got = iv.daly_interval(5 * MIN, mtbf) / MIN
    assert round(got, 0 if minutes > 10 else 1) == minutes


def test_daly_reduces_to_young_when_c_is_small():
    m = 3 * HOUR
    for ratio in (1e-2, 1e-4, 1e-6):
        c = ratio * m
        rel = iv.daly_interval(c, m) / iv.young_interval(c, m) - 1
        # the series: -sqrt(C/2M) + sqrt(C/2M)/3 + ... = -(2/3) sqrt(C/2M) to first order
        assert rel == pytest.approx(-2 / 3 * math.sqrt(ratio / 2), rel=0.1)
    assert abs(iv.daly_interval(1e-6 * m, m) / iv.young_interval(1e-6 * m, m) - 1) < 1e-3
    assert iv.daly_interval(2 * m, m) == m and iv.daly_interval(5 * m, m) == m   # C >= 2M


def test_segment_time_limits():
    t, c, r, m = 600.0, 30.0, 120.0, 3 * HOUR
    # no failures (M -> infinity): a segment takes exactly T + C
    assert iv.segment_time(t, c, r, 1e12) == pytest.approx(t + c, rel=1e-6)
    # C = R = 0: the expected time to see T uninterrupted, M (e^(T/M) - 1)
    assert iv.segment_time(t, 0, 0, m) == pytest.approx(m * math.expm1(t / m), rel=1e-14)
    # to first order in 1/M: wall/work = (1 + C/T)(1 + (R + (T+C)/2)/M), Young's picture;
    # the neglected terms are of order ((T + C + R)/M)^2, so 10x the MTBF cuts them 100x
    for mm in (m, 10 * m):
        first = (t + c) / t * (1 + (r + (t + c) / 2) / mm)
        err = 1 / iv.efficiency(t, c, r, mm) / first - 1
        assert 0 < err < ((t + c + r) / mm) ** 2
    # whole segments: the run's expected time is n segments; a partial last one is cheaper
    assert iv.expected_wall_time(10 * t, t, c, r, m) == pytest.approx(
        10 * iv.segment_time(t, c, r, m), rel=1e-14)
    part = iv.expected_wall_time(10.5 * t, t, c, r, m)
    assert part == pytest.approx(10 * iv.segment_time(t, c, r, m)
                                 + iv.segment_time(t / 2, c, r, m), rel=1e-14)


@pytest.mark.parametrize("c, r, m", [(30, 120, 3 * HOUR), (5 * MIN, 10 * MIN, 6 * HOUR),
                                     (5 * MIN, 10 * MIN, 24 * HOUR), (60, 0, 1 * HOUR),
                                     (5 * MIN, 10 * MIN, 15 * MIN)])
def test_efficiency_peaks_at_daly(c, r, m):
    daly, exact = iv.daly_interval(c, m), iv.exact_interval(c, m)
    grid = np.geomspace(daly / 4, min(4 * daly, 5 * m), 20001)
    best = grid[np.argmax(iv.efficiency(grid, c, r, m))]
    assert best == pytest.approx(exact, rel=1e-3)               # the model's own optimum
    assert best == pytest.approx(daly, rel=0.03)                # Daly's series: within 3%
    # the optimality condition e^((T+C)/M) (1 - T/M) = 1 holds at `exact`
    assert math.exp((exact + c) / m) * (1 - exact / m) == pytest.approx(1, abs=1e-12)
    # R scales E[segment] by e^(R/M): the optimum does not move
    assert grid[np.argmax(iv.efficiency(grid, c, 0, m))] == best


@pytest.mark.parametrize("work, c, r, m, intervals", [
    (500 * HOUR, 30, 120, 3 * HOUR, [5 * MIN, 13.09 * MIN, 40 * MIN]),
    (500 * HOUR, 5 * MIN, 10 * MIN, 6 * HOUR, [20 * MIN, 57 * MIN, 3 * HOUR]),
    pytest.param(100 * HOUR, 5 * MIN, 10 * MIN, 15 * MIN, [5 * MIN, 9.1 * MIN, 20 * MIN],
                 marks=pytest.mark.slow),                   # ~0.4 s: the others cover it
    (1 * HOUR, 60, 600, 2 * HOUR, [7 * MIN, 2 * HOUR]),     # partial last; one segment > W
])
def test_simulation_agrees_with_the_model(work, c, r, m, intervals):
    # The model is exact, so the simulated estimate is off by sampling error alone. With 11
    # points at 95% one would expect one outside by chance; each must lie within its 99% CI
    # (the reported 95% half-width * 2.576/1.960). Over seeds 0-9 the largest |z| seen was
    # 3.25 (seed 1, once in 110 points), the rest <= 2.26: the z-scores look N(0, 1).
    sim = iv.simulate(work, intervals, c, r, m, runs=400, seed=0)
    wall = iv.expected_wall_time(work, intervals, c, r, m)
    ci99 = sim.ci95 * 2.576 / 1.960
    assert np.all(np.abs(sim.efficiency - work / wall) <= ci99), (sim.efficiency, work / wall)
    # failures are a Poisson process in wall time, so E[failures] = E[wall] / M (Wald)
    se = sim.failures.std(axis=1, ddof=1) / math.sqrt(sim.failures.shape[1])
    assert np.all(np.abs(sim.failures.mean(axis=1) - wall / m) <= 2.576 * se)


def test_weibull_gaps_have_the_mtbf_as_mean_and_shape_1_is_the_exponential():
    assert iv.weibull_scale(3 * HOUR, 1.0) == 3 * HOUR
    assert iv.weibull_scale(3 * HOUR, 0.5) == pytest.approx(1.5 * HOUR)   # Gamma(3) = 2
    rng = np.random.default_rng(0)
    gaps = iv.weibull_scale(HOUR, 0.7) * rng.weibull(0.7, 200_000)
    assert abs(gaps.mean() - HOUR) < 4 * gaps.std() / math.sqrt(gaps.size)
    # the renewal closed form at k = 1 is Daly's segment time (checks the integration)
    for length, r in [(20 * MIN, 0.0), (50 * MIN, 10 * MIN), (3 * HOUR, 2 * MIN)]:
        assert iv.one_segment_time(length, r, HOUR) == pytest.approx(
            float(iv.segment_time(length, 0.0, r, HOUR)), rel=1e-7)
    default = iv.simulate(10 * HOUR, [20 * MIN], 30, 60, HOUR, runs=50, seed=3)
    assert np.array_equal(default.wall, iv.simulate(10 * HOUR, [20 * MIN], 30, 60, HOUR,
                                                    runs=50, seed=3, shape=1.0).wall)
    with pytest.raises(ValueError, match="shape must be > 0"):
        iv.simulate(HOUR, [60], 1, 0, HOUR, shape=-1)


@pytest.mark.parametrize("shape", [0.5, 0.7, 1.5])
def test_weibull_simulation_of_one_segment_matches_the_renewal_closed_form(shape):
    # One segment (T >= W): the run needs one failure-free window of W + C (after a failure,
    # R + W + C), so E[wall] = one_segment_time(W + C, R, M, k) exactly; within the 99% CI.
    work, c, r, m = 40 * MIN, 2 * MIN, 5 * MIN, HOUR
    sim = iv.simulate(work, [work], c, r, m, runs=4000, seed=1, shape=shape)
    want = iv.one_segment_time(work + c, r, m, shape)
    se = sim.wall.std(ddof=1) / math.sqrt(sim.wall.size)
    assert abs(sim.wall.mean() - want) <= 2.576 * se, (sim.wall.mean(), want, se)
    exponential = float(iv.segment_time(work, c, r, m))
    assert abs(want - exponential) > 4 * se            # the shape matters here: not k = 1


@pytest.mark.slow                      # asserts a wall-clock bound: not on a loaded machine
def test_simulation_is_seeded_and_fast():
    grid = np.geomspace(3 * MIN, 50 * MIN, 30)
    t0 = time.perf_counter()
    a = iv.simulate(500 * HOUR, grid, 30, 120, 3 * HOUR, runs=200, seed=7)
    assert time.perf_counter() - t0 < 5.0                       # the brief: 30 x 200 < 5 s
    b = iv.simulate(500 * HOUR, grid, 30, 120, 3 * HOUR, runs=200, seed=7)
    c = iv.simulate(500 * HOUR, grid, 30, 120, 3 * HOUR, runs=200, seed=8)
    assert np.array_equal(a.wall, b.wall) and not np.array_equal(a.wall, c.wall)
    with pytest.raises(ValueError, match="failures per run"):
        iv.simulate(1000 * HOUR, [3 * HOUR], 3 * HOUR, 0, 60)
    with pytest.raises(ValueError, match="runs must be >= 2"):
        iv.simulate(HOUR, [60], 1, 0, HOUR, runs=1)


def test_llama3_mtbf_scaling():
    assert iv.llama3_mtbf(16384) == pytest.approx(54 * 24 * HOUR / 466)      # ~2.78 h
    assert iv.llama3_mtbf(1024) == pytest.approx(16 * 54 * 24 * HOUR / 466)  # ~44.5 h
    assert iv.llama3_mtbf(1) == 16384 * iv.llama3_mtbf(16384)
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="n_gpus"):
            iv.llama3_mtbf(bad)


def test_recommend_from_measured_seconds():
    m = 3 * HOUR
    rec = iv.recommend([28.0, 30.0, 32.0], mtbf=m, restart=120)
    assert rec.checkpoint_cost == 30.0
    assert rec.young == iv.young_interval(30, m) and rec.daly == iv.daly_interval(30, m)
    assert rec.efficiency_exact >= rec.efficiency_daly >= rec.efficiency_young
    assert rec.efficiency_daly == pytest.approx(float(iv.efficiency(rec.daly, 30, 120, m)))
    assert iv.recommend(30, mtbf=m) == iv.recommend([30], mtbf=m)
    for bad in ([], [30, -1], [float("nan")], 0):
        with pytest.raises(ValueError, match="checkpoint_seconds"):
            iv.recommend(bad, mtbf=m)


def test_parse_duration():
    cases = {"30s": 30, "5m": 300, "90min": 5400, "3h": 10800, "1.5h": 5400, "2d": 172800,
             " 120 s ": 120, "0s": 0, ".5m": 30}
    for text, seconds in cases.items():
        assert iv.parse_duration(text) == seconds
    for bad in ("30", "3x", "", "h", "-5m", "5 m s"):
        with pytest.raises(ValueError, match="as a duration"):
            iv.parse_duration(bad)


FAST = ["--runs", "50", "--points", "6", "--work", "100h"]


def test_cli_prints_the_optima_and_the_table(capsys):
    code = interval_cli.main(["--checkpoint-cost", "30s", "--restart", "120s", "--mtbf", "3h"]
                             + FAST)
    out = capsys.readouterr().out
    assert code == 0
    assert f"= {iv.format_duration(iv.young_interval(30, 3 * HOUR)):>10}" in out   # 13.42 min
    assert "Young 1974" in out and "Daly 2006" in out and "13.09 min" in out
    rows = re.findall(r"^ +[\d.]+ (?:s|min|h|d) +0\.\d{4} +0\.\d{4} ± 0\.\d{4} ", out, re.M)
    assert len(rows) == 6 + 2                                   # the grid, Young and Daly
    assert out.count("best analytic") == 1 and out.count("best simulated") == 2  # + summary
    assert "13.09 min    0.9171" in out                     # Daly's row, analytic column


def test_cli_llama3(capsys):
    code = interval_cli.main(["--checkpoint-cost", "30s", "--restart", "2m", "--gpus", "1024",
                    "--llama3"] + FAST)
    out = capsys.readouterr().out
    assert code == 0 and "M = 44.50 h (MTBF)" in out and "16384 / 1024 GPUs = 44.50 h" in out


@pytest.mark.parametrize("argv, says", [
    (["--checkpoint-cost", "30", "--mtbf", "3h"], "cannot read '30' as a duration"),
    (["--checkpoint-cost", "30s"], "either as --mtbf"),
    (["--checkpoint-cost", "30s", "--mtbf", "3h", "--llama3", "--gpus", "8"], "either as"),
    (["--checkpoint-cost", "30s", "--mtbf", "3h", "--gpus", "8"], "go together"),
    (["--checkpoint-cost", "0s", "--mtbf", "3h"], "--checkpoint-cost must be > 0"),
    (["--checkpoint-cost", "30s", "--mtbf", "3h", "--plot", "/no/such/dir/x.png"],
     "does not exist"),
    (["--mtbf", "3h"], "required: --checkpoint-cost"),
    (["--checkpoint-cost", "3h", "--mtbf", "1m", "--work", "1000d"], "failures per run"),
    (["--checkpoint-cost", "30s", "--mtbf", "3h", "--weibull-shape", "0"], "shape must be > 0"),
])
def test_cli_usage_errors_are_one_line(argv, says, capsys):
    try:
        code = interval_cli.main(argv)
    except SystemExit as e:                                     # argparse's own errors
        code = e.code
    res = capsys.readouterr()
    assert code == 2 and res.out == ""
    assert res.err.count("\n") == 1 and res.err.startswith("error: ") and says in res.err


def test_cli_weibull_shape_says_what_the_columns_assume(capsys):
    code = interval_cli.main(["--checkpoint-cost", "30s", "--restart", "120s", "--mtbf", "3h",
                    "--weibull-shape", "0.7"] + FAST)
    out = capsys.readouterr().out
    assert code == 0 and "failures Weibull of shape 0.7" in out and "best simulated" in out


@pytest.mark.slow                      # a subprocess; the CLI itself runs in-process above
def test_cli_as_a_module():
    run = subprocess.run([sys.executable, "-m", "minidist", "interval",
                          "--checkpoint-cost", "30s", "--mtbf", "3x"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.startswith("error: cannot read '3x'")


@pytest.mark.slow                      # ~0.5 s of matplotlib
def test_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "interval.png"
    code = interval_cli.main(["--checkpoint-cost", "30s", "--mtbf", "3h", "--plot", str(out)]
                             + FAST)
    assert code == 0 and f"plot written to {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)            # import now raises ImportError
    out = tmp_path / "interval.png"
    code = interval_cli.main(["--checkpoint-cost", "30s", "--mtbf", "3h", "--plot", str(out)]
                             + FAST)
    res = capsys.readouterr()
    assert code == 1 and not out.exists() and "best analytic" in res.out
    assert res.err.count("\n") == 1 and "matplotlib is not installed" in res.err
