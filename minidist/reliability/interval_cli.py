"""The command line of reliability/interval.py: the optima, a simulated sweep, a plot.

    python -m minidist interval --checkpoint-cost 30s --restart 120s --mtbf 3h
    python -m minidist interval --checkpoint-cost 30s --restart 2m --gpus 1024 --llama3
    python -m minidist interval ... --weibull-shape 0.7   (failures not memoryless)

It prints Young's, Daly's and the exact optimum, then a table of intervals from T_Daly/4
to 4 T_Daly with the analytic efficiency (exponential failures) beside the simulated one
(exponential, or Weibull with --weibull-shape), marking the best of each; --plot draws
both curves (the `plot` extra).
Read with: reliability/interval.py (the model and the simulation).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import numpy as np

from minidist.cli import CliParser, at_least, cli_error, file_path
from minidist.reliability.interval import (LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS,
                                           Recommendation, Simulation, _positive, efficiency,
                                           format_duration, llama3_mtbf, parse_duration,
                                           recommend, simulate)


def _sweep_table(rec: Recommendation, sim: Simulation) -> list[str]:
    """The table rows: interval, analytic and simulated efficiency, failures, marks. The
    analytic column is the steady state T / E[segment]; the simulated runs also pay for
    their shorter last segment, a difference of at most (C + R)/W, far inside the CI."""
    analytic = efficiency(sim.intervals, rec.checkpoint_cost, rec.restart, rec.mtbf)
    marks = {i: [] for i in range(sim.intervals.size)}
    for name, t in (("Young", rec.young), ("Daly", rec.daly)):
        marks[int(np.argmin(abs(sim.intervals - t)))].append(name)
    marks[int(np.argmax(analytic))].append("best analytic")
    marks[int(np.argmax(sim.efficiency))].append("best simulated")
    rows = [f"{'interval':>11}  {'analytic':>8}  {'simulated ± 95% CI':>18}  "
            f"{'failures/run':>12}"]
    for i, t in enumerate(sim.intervals):
        note = f"  <- {', '.join(marks[i])}" if marks[i] else ""
        rows.append(f"{format_duration(t):>11}  {analytic[i]:8.4f}  {sim.efficiency[i]:9.4f} "
                    f"± {sim.ci95[i]:.4f}  {sim.failures[i].mean():12.1f}{note}")
    i, b = int(np.argmin(abs(sim.intervals - rec.daly))), int(np.argmax(sim.efficiency))
    rows.append(f"at Daly's T: analytic {analytic[i]:.4f}, simulated {sim.efficiency[i]:.4f} ± "
                f"{sim.ci95[i]:.4f}; best simulated {sim.efficiency[b]:.4f} ± {sim.ci95[b]:.4f} "
                f"at {format_duration(sim.intervals[b])}")
    return rows


def _plot(path: str, rec: Recommendation, sim: Simulation) -> None:
    """Analytic curve, simulated points with 95% CIs, and the optima; minutes on a log x."""
    from matplotlib.figure import Figure                 # no pyplot: no global backend state
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    dense = np.geomspace(sim.intervals[0], sim.intervals[-1], 400)
    curve = efficiency(dense, rec.checkpoint_cost, rec.restart, rec.mtbf)
    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    ax.plot(dense / 60, curve, label="analytic: T / E[segment]")
    ax.errorbar(sim.intervals / 60, sim.efficiency, yerr=sim.ci95, fmt="o", ms=3,
                capsize=2, label=f"simulated ({sim.wall.shape[1]} runs, 95% CI)")
    for name, t, style in (("Young", rec.young, ":"), ("Daly", rec.daly, "--")):
        ax.axvline(t / 60, color="gray", ls=style, label=f"{name}: {format_duration(t)}")
    ax.set(xscale="log", xlabel="checkpoint interval T (minutes)",
           ylabel="useful fraction of wall time",
           title=f"C = {format_duration(rec.checkpoint_cost)}, R = "
                 f"{format_duration(rec.restart)}, MTBF = {format_duration(rec.mtbf)}")
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _arguments():
    ap = CliParser(prog="python -m minidist interval",
                   description="Young's and Daly's optimal checkpoint intervals, and the "
                               "efficiency of a sweep of intervals: analytic and simulated. "
                               "Durations are a number and a unit: 30s, 5m, 3h, 2d.")
    ap.add_argument("--checkpoint-cost", required=True, metavar="DUR", help="time of one save")
    ap.add_argument("--restart", default="0s", metavar="DUR",
                    help="time from a failure to training again: relaunch + load (default 0s)")
    ap.add_argument("--mtbf", metavar="DUR", help="mean time between failures of the job")
    ap.add_argument("--llama3", action="store_true",
                    help="MTBF scaled from Llama 3's 466 interruptions in 54 days on 16384 "
                         "GPUs to --gpus (instead of --mtbf)")
    ap.add_argument("--gpus", type=at_least(1), metavar="N", help="GPUs of the job (--llama3)")
    ap.add_argument("--work", default="500h", metavar="DUR",
                    help="training time of the run without failures (default 500h)")
    ap.add_argument("--runs", type=at_least(2), default=200, help="simulated runs per interval")
    ap.add_argument("--points", type=at_least(2), default=30,
                    help="intervals in the sweep, from T_Daly/4 to 4 T_Daly (default 30)")
    ap.add_argument("--seed", type=at_least(0), default=0,
                    help="seed of the simulation (default 0)")
    ap.add_argument("--weibull-shape", type=float, default=1.0, metavar="K",
                    help="simulate gaps between failures as a Weibull of shape K and mean "
                         "MTBF (default 1: exponential; field data fit K < 1, a decreasing "
                         "hazard). The analytic column stays exponential")
    ap.add_argument("--plot", type=file_path, metavar="PNG",
                    help="draw both curves and the optima here")
    return ap


def _settings(a) -> tuple[float, float, float, float]:
    """(C, R, M, W) in seconds from the parsed options; ValueError for a usage error."""
    if a.llama3 == (a.mtbf is not None):
        raise ValueError("give the MTBF either as --mtbf DUR or as --llama3 --gpus N")
    if (a.gpus is not None) != a.llama3:
        raise ValueError("--gpus and --llama3 go together (the MTBF scales with the GPUs)")
    if a.plot and not os.path.isdir(os.path.dirname(os.path.abspath(a.plot))):
        raise ValueError(f"--plot {a.plot}: its folder does not exist")
    mtbf = llama3_mtbf(a.gpus) if a.llama3 else _positive("--mtbf", parse_duration(a.mtbf))
    return (_positive("--checkpoint-cost", parse_duration(a.checkpoint_cost)),
            _positive("--restart", parse_duration(a.restart), zero_ok=True), mtbf,
            _positive("--work", parse_duration(a.work)))


def _header(a, rec: Recommendation, work: float) -> list[str]:
    """The settings, the three optima and what the table's columns mean."""
    d = format_duration
    lines = [f"checkpoint interval: C = {d(rec.checkpoint_cost)} (save), R = {d(rec.restart)} "
             f"(restart), M = {d(rec.mtbf)} (MTBF), W = {d(work)} (work)"]
    if a.llama3:
        lines.append(f"M from Llama 3 (Dubey et al. 2024, Sec. 3.3.4): {LLAMA3_DAYS} d * 24 h / "
                     f"{LLAMA3_INTERRUPTIONS} interruptions * {LLAMA3_GPUS} / {a.gpus} GPUs "
                     f"= {d(rec.mtbf)}")
    for name, formula, t, e in (
            ("Young 1974", "sqrt(2CM)", rec.young, rec.efficiency_young),
            ("Daly 2006", "sqrt(2CM)(1 + sqrt(C/2M)/3 + C/18M) - C", rec.daly, rec.efficiency_daly),
            ("exact", "the root of e^((T+C)/M) (1 - T/M) = 1", rec.exact, rec.efficiency_exact)):
        lines.append(f"{name:<11} T = {formula:<40} = {d(t):>10}  (efficiency {e:.4f})")
    lines += ["efficiency = useful / wall time. analytic: T / E[segment], E[segment] = "
              "M e^(R/M) (e^((T+C)/M) - 1);",
              f"simulated: W / mean(wall) over {a.runs} runs per interval (seed {a.seed})"
              + ("" if a.weibull_shape == 1 else
                 f", failures Weibull of shape {a.weibull_shape:g} (a renewal process; the "
                 f"analytic column and the optima assume shape 1)")]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the optima and the sweep table; exit 2 (one line) on a usage error."""
    a = _arguments().parse_args(argv)
    try:
        c, r, mtbf, work = _settings(a)
        rec = recommend(c, mtbf=mtbf, restart=r)
        grid = np.geomspace(rec.daly / 4, rec.daly * 4, a.points)
        sim = simulate(work, np.union1d(grid, [rec.young, rec.daly]), c, r, mtbf,
                       runs=a.runs, seed=a.seed, shape=a.weibull_shape)
    except ValueError as e:
        return cli_error(e)
    print("\n".join(_header(a, rec, work) + _sweep_table(rec, sim)))
    if a.plot:
        try:
            _plot(a.plot, rec, sim)
        except ImportError:
            print("--plot: matplotlib is not installed (pip install 'minidist[plot]'), "
                  "so no plot was written", file=sys.stderr)
            return 1
        print(f"plot written to {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
