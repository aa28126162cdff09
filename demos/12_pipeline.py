"""Pipeline parallelism: four schedules drawn and timed, then a real pp=2 run vs 1 process.

What you will see: GPipe, 1F1B, interleaved 1F1B (V=2) and ZB-H1 for P=4 stages, M=8
micro-batches: each proven deadlock-free, played with unit costs, drawn one row per stage
(a timeline wider than 30 cells continues below), its bubble next to the papers' closed
form, its peak held activations per stage. Then a tiny float64 GPT on pp=2 ranks (M=4),
1F1B and ZB-H1: the last step's measured timeline under one simulated with the run's own
mean costs, both bubbles, the measured peaks, and the loss of every step next to the
1-process run. In those two drawings a cell shows the action that fills most of it, and
an action too short to win a cell still gets one near its midpoint: every action of the
step shows, in the order it ran (schedule_render.py).

Run:       python demos/12_pipeline.py [--P 4 --M 8 --V 2] [--run 1f1b,zb-h1 --pp 2 --run-m 4]
           (or python -m minidist demo pipeline)
Read with: minidist/parallel/pipeline/schedules.py, schedule_validate.py, schedule_sim.py,
           schedule_render.py, stage.py, minidist/train.py
Paper:     Huang et al. 2019, "GPipe", arXiv:1811.06965; Narayanan et al. 2021, arXiv:2104.04473,
           Sec. 2.2 (1F1B, interleaved); Qi et al. 2023, "Zero Bubble", arXiv:2401.10241 (ZB-H1)
"""

import argparse
from fractions import Fraction

import numpy as np

from minidist.baseline import train_single_process
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.parallel.pipeline.schedule_render import LEGEND, ascii, side_by_side
from minidist.parallel.pipeline.schedule_sim import (Timeline, bubble_closed_form,
                                                     peak_activations, simulate)
from minidist.parallel.pipeline.schedule_validate import validate
from minidist.parallel.pipeline.family import SCHEDULES, make_schedule
from minidist.parallel.pipeline.schedules import Action
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line) ---
P, M, V, PP, RUN_M, RUN, STEPS, GLOBAL_BATCH, LR, SEED = 4, 8, 2, 2, 4, "1f1b,zb-h1", 3, 16, 3e-3, 0
N_LAYER, N_EMBD, N_HEAD, LENGTH, COLUMNS = 4, 64, 4, 8, 30      # COLUMNS: cells in a row
# each number option's (low, high): the demo stays small
LIMITS = dict(P=(1, 16), M=(1, 32), V=(2, 4), pp=(2, 8), run_m=(1, 16), steps=(1, 10_000),
              global_batch=(1, 512), lr=(0.0, 1.0), seed=(0, 2 ** 32), n_layer=(1, 16),
              n_embd=(1, 256), n_head=(1, 64), length=(1, 16))
FORMULA = {"gpipe": "(P-1)/(M+P-1)", "1f1b": "(P-1)/(M+P-1)", "interleaved": "(P-1)/(V M+P-1)",
           "zb-h1": "(P-1)/(3 M+P-1)"}
NOTICE = {"gpipe": "all M forwards, then all M backwards: every stage holds all M micro-batches",
          "1f1b": "GPipe's bubble, but stage s runs a backward after P-s forwards: it holds P-s",
          "interleaved": "V chunks a stage, 1/V as long: fill and drain shrink V times; more "
                         "(smaller)\n  chunks held",
          "zb-h1": "B is the input gradient only (the stage before waits for it); the Ws wait "
                   "and fill\n  the cool-down"}


def expected_peak(name: str, P: int, M: int, V: int) -> tuple[list[int] | None, str]:
    """(the peak held activations per stage as stated, the statement); None: not checked."""
    if name == "gpipe":
        return [M] * P, "M on every stage"
    if name == "1f1b":
        return [min(P - s, M) for s in range(P)], "min(P-s, M) on stage s"
    if name == "zb-h1":
        return [min(P, M)] * P, "min(P, M), 1F1B's stage 0"
    if M % P:
        return None, "(M not a multiple of P: not checked)"
    return ([min(M * V, 2 * (P - 1 - s) + (V - 1) * P + 1) for s in range(P)],
            "2(P-1-s)+(V-1)P warm-up forwards + 1,\n    chunks of 1/V stage")


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=RUN, help=f"schedules run for real, from {SCHEDULES}")
    ap.add_numbers(dict(P=P, M=M, V=V, pp=PP, run_m=RUN_M, steps=STEPS,
                        global_batch=GLOBAL_BATCH, lr=LR, seed=SEED, n_layer=N_LAYER,
                        n_embd=N_EMBD, n_head=N_HEAD, length=LENGTH), LIMITS)
    args = ap.parse_args(argv)
    args.run = [s for s in args.run.split(",") if s]
    if not set(args.run) <= set(SCHEDULES):
        ap.error(f"--run takes names from {', '.join(SCHEDULES)}, comma-separated")
    if args.n_embd % args.n_head:
        ap.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.global_batch % args.run_m:
        ap.error(f"--global-batch {args.global_batch} must be a multiple of --run-m "
                 f"{args.run_m} (the micro-batches of a step)")
    data_cfg = DataConfig(task="sort", length=args.length, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head)
    try:
        for name in args.run:
            Plan(pp=args.pp, micro_batches=args.run_m, schedule=name).validate(
                cfg, args.global_batch, data_cfg.block_size)
    except ValueError as e:
        ap.error(f"--run {name}: {e}")
    return args


def draw(rows: list[str]) -> str:
    """Stage rows "stage 0 |F0 F1 .. |", COLUMNS cells at a time: a longer timeline goes on
    in a block below, after a line naming its first cell."""
    heads = [row[:row.index("|") + 1] for row in rows]              # "stage 0 |"
    cells = [row[len(h):-1] for h, row in zip(heads, rows)]          # 3 characters a cell
    n = max(map(len, cells), default=0) // 3
    lines = []
    for first in range(0, max(n, 1), COLUMNS):
        last = min(first + COLUMNS, n)
        if first:
            lines.append(f"  ... from cell {first}:")
        for head, c in zip(heads, cells):
            piece = c[3 * first:3 * last]
            lines.append(head + (piece + "|" if last == n else piece.rstrip()))
    return "\n".join(lines)


def show_schedules(P: int, M: int, V: int) -> list[str]:
    """Part 1: each schedule validated, simulated in unit costs, drawn; returns problems."""
    unit, problems = {k: Fraction(1) for k in "FBW"}, []
    print(f"== four schedules, P={P}, M={M}, unit costs F = B = W = 1 (a whole backward B+W "
          f"= 2) ==\n{LEGEND}")
    for name in SCHEDULES:
        schedule = make_schedule(name, P, M, V)
        validate(schedule)                    # raises ScheduleError naming the first problem
        tl = simulate(schedule, costs=unit)   # Fractions: exact times, exact bubble
        bubble, closed = tl.bubble_fraction(), bubble_closed_form(name, P, M, V)
        header, *rows = ascii(tl).splitlines()[:-1]          # less the legend, shown once
        print(f"\n{header}\n{draw(rows)}"
              "\n  validate: complete, each B after its F, channels in order, no deadlock")
        line = f"  bubble {bubble} = {100 * float(bubble):.1f}% | closed form {FORMULA[name]}"
        if name in ("gpipe", "1f1b") or M >= P:
            print(line + f" = {100 * closed:.1f}%, equal: {float(bubble) == closed}")
            problems += [f"{name}: bubble {bubble} != {closed}"] * (float(bubble) != closed)
        else:
            print(line + f" holds for M >= P only:\n  M={M} < P={P}, the pipeline never fills")
        peaks, (want, rule) = peak_activations(schedule), expected_peak(name, P, M, V)
        print(f"  peak activations held per stage: {' '.join(map(str, peaks))}   ({rule})")
        problems += [f"{name}: peaks {peaks} != {want}"] * (want is not None and peaks != want)
        print(f"  notice: {NOTICE[name]}")
    return problems


def rank_main(ctx, args, cfg, data_cfg, name: str):
    """Every pp rank trains its stage under schedule `name`; returns its RankResult."""
    plan = Plan(pp=ctx.world_size, micro_batches=args.run_m, schedule=name)
    return train_on_rank(ctx, cfg, data_cfg, plan,
                         RunConfig(steps=args.steps, global_batch=args.global_batch,
                                   seed=args.seed),
                         OptimizerConfig(lr=args.lr))


def show_run(name: str, runs, pp: int, M: int) -> list[str]:
    """Part 2: the last step's measured timeline beside a simulation with its own costs."""
    runs, schedule = sorted(runs, key=lambda r: r.pipeline["stage"]), make_schedule(name, pp, M)
    measured = Timeline.from_records([[(Action(k, m, c), t0, t1) for k, m, c, t0, t1 in
                                       r.pipeline["timeline"][-1]] for r in runs], name=name,
                                     chunks=schedule.chunks)
    mean = {k: [float(np.mean([sl.duration for sl in row if sl.action.kind == k] or [0.0]))
                for row in measured.stages] for k in "FBW"}     # seconds, per action and stage
    simulated = simulate(schedule, costs={k: [schedule.chunks * c for c in cs]  # per stage
                                          for k, cs in mean.items()})
    simulated.time_unit = "s"
    print(f"\n-- {name}, last step; mean ms per action, stage 0 .. {pp - 1}:\n   " + " | ".join(
        f"{k} " + " ".join(f"{1e3 * c:.2f}" for c in cs) for k, cs in mean.items() if any(cs)))
    print(side_by_side(simulated, measured, ("simulated with these costs", "measured"),
                       columns=COLUMNS).replace(LEGEND + "\n", "").replace("\n" + LEGEND, ""))
    unit = simulate(schedule).bubble_fraction()
    print(f"bubble: measured {100 * measured.bubble_fraction():.1f}% | simulated with these "
          f"costs {100 * simulated.bubble_fraction():.1f}% | unit costs {100 * unit:.1f}%\n"
          "  the simulator counts sends, receives and Python between actions as free, and uses"
          "\n  mean costs")
    held, want = [r.pipeline["held_peak"] for r in runs], peak_activations(schedule)
    print(f"peak activations held per stage: measured {held}, peak_activations {want}")
    return [] if held == want else [f"{name}: held {held} != {want}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"demo 12 · pipeline parallel · schedules for P={args.P}, M={args.M}, V={args.V}\n"
          f"real runs on pp={args.pp}, M={args.run_m}: {', '.join(args.run)}")
    problems = show_schedules(args.P, args.M, args.V)
    data_cfg = DataConfig(task="sort", length=args.length, seed=args.seed)
    cfg = model_config_for(data_cfg, n_layer=args.n_layer, n_embd=args.n_embd,
                           n_head=args.n_head, dtype="float64")
    print(f"\n== real runs: pp={args.pp}, M={args.run_m}, GPT {cfg.n_layer} layers, C="
          f"{cfg.n_embd}, global batch {args.global_batch}, float64, {args.steps} steps ==")
    base = train_single_process(cfg, data_cfg, steps=args.steps, global_batch=args.global_batch,
                                lr=args.lr, seed=args.seed)
    worst = 0.0
    for name in args.run:
        runs = spawn(args.pp, rank_main, args, cfg, data_cfg, name)
        problems += show_run(name, runs, args.pp, args.run_m)
        for s, (a, b) in enumerate(zip(runs[0].losses, base.losses)):   # every rank: the same
            print(f"step {s} | loss pp={args.pp} {name} {a:.15f} | 1 process {b:.15f} | "
                  f"|Δ| {abs(a - b):.1e}")
        worst = max(worst, *(abs(a - b) for r in runs for a, b in zip(r.losses, base.losses)))
    if worst > 1e-12 or problems:
        print(f"MISMATCH: {'; '.join(problems) or f'losses differ by {worst:.1e}'}")
        return 1
    print(f"OK: {len(SCHEDULES)} schedules valid, bubbles and peaks as stated; pp={args.pp} losses "
          f"= 1 process (max |Δ| = {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
