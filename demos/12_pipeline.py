"""Pipeline parallelism: the schedule family drawn and timed, then real pp=2 runs vs 1 process.

What you will see: every schedule for P=4 stages, M=8 micro-batches (GPipe, 1F1B,
interleaved 1F1B V=2, ZB-H1, ZB-H2, ZB-1p, ZB-2p, ZBV, V-Half, V-Min, DualPipe, DualPipeV):
each proven deadlock-free, played with unit costs, drawn one row per stage (a timeline
wider than 30 cells continues below), its bubble next to the papers' closed form if any,
its peak held activations per stage. Then the family side by side: one step's bubble, the
bubble left when iterations overlap (in units of 1F1B's), peak memory and messages, next
to what the papers claim (--png plots memory against bubble). Then a tiny float64 GPT on
pp=2 ranks (M=4) under 1F1B, ZB-H1 and DualPipe: the last step's measured timeline under
one simulated with the run's own median costs, both bubbles, the measured peaks, and the
loss of every step next to the 1-process run. In those drawings a cell shows the action
that fills most of it, and an action too short to win a cell still gets one near its
midpoint: every action of the step shows, in the order it ran (schedule_render.py);
DualPipe's "X3 &0" is a forward of micro-batch 3 overlapped with the backward of 0.

Run:       python demos/12_pipeline.py [--P 4 --M 8 --V 2] [--png tradeoff.png]
                  [--run 1f1b,zb-h1,dualpipe --pp 2 --run-m 4]
           (or python -m minidist demo pipeline)
Read with: minidist/parallel/pipeline/schedules.py, family.py, schedule_validate.py,
           schedule_sim.py, schedule_auto.py, controllable_memory.py, dualpipe.py,
           schedule_render.py, stage.py,
           minidist/train.py
Paper:     Huang et al. 2019, "GPipe", arXiv:1811.06965; Narayanan et al. 2021, arXiv:2104.04473,
           Sec. 2.2 (1F1B, interleaved); Qi et al. 2023, "Zero Bubble", arXiv:2401.10241
           (ZB-H1, ZB-H2, ZB-1p, ZB-2p); Qi et al. 2024, arXiv:2405.15362 (ZBV, V-Half,
           V-Min); DeepSeek-AI
           2024, "DeepSeek-V3", arXiv:2412.19437, Sec. 3.2.1 (DualPipe)
"""

import argparse
from fractions import Fraction

from minidist.baseline import train_single_process
from minidist.bench.pipeline import measured_costs, p2p_formula
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.parallel.pipeline.schedule_render import FB_LEGEND, LEGEND, ascii, side_by_side
from minidist.parallel.pipeline.schedule_sim import (Timeline, bubble_closed_form,
                                                     peak_activations, simulate)
from minidist.parallel.pipeline.schedule_validate import validate
from minidist.parallel.pipeline.family import CLAIMS, NEEDS, SCHEDULES, make_schedule, runs_on
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line) ---
P, M, V, PP, RUN_M, STEPS, GLOBAL_BATCH, LR, SEED = 4, 8, 2, 2, 4, 3, 16, 3e-3, 0
RUN = "1f1b,zb-h1,dualpipe"
N_LAYER, N_EMBD, N_HEAD, LENGTH, COLUMNS = 4, 64, 4, 8, 30      # COLUMNS: cells in a row
# each number option's (low, high): the demo stays small
LIMITS = dict(P=(1, 16), M=(1, 32), V=(2, 4), pp=(2, 8), run_m=(1, 16), steps=(1, 10_000),
              global_batch=(1, 512), lr=(0.0, 1.0), seed=(0, 2 ** 32), n_layer=(1, 16),
              n_embd=(1, 256), n_head=(1, 64), length=(1, 16))
FORMULA = {"gpipe": "(P-1)/(M+P-1)", "1f1b": "(P-1)/(M+P-1)", "interleaved": "(P-1)/(V M+P-1)",
           "zb-h1": "(P-1)/(3 M+P-1)", "zb-h2": "(P-1)/(3 M+P-1)", "zb-1p": "(P-1)/(3 M+P-1)",
           "zb-2p": "(P-1)/(3 M+P-1)"}
NOTICE = {"gpipe": "all M forwards, then all M backwards: every stage holds all M micro-batches",
          "1f1b": "GPipe's bubble, but stage s runs a backward after P-s forwards: it holds P-s",
          "interleaved": "V chunks a stage, 1/V as long: fill and drain shrink V times; more "
                         "(smaller)\n  chunks held",
          "zb-h1": "B is the input gradient only (the stage before waits for it); the Ws wait "
                   "and fill\n  the cool-down",
          "zb-h2": "twice the warm-up: no stage waits for its first B, the Ws fill the tail; "
                   "each stage\n  busy from its first action to its last (a parallelogram)",
          "zb-1p": "found by the list scheduler under 1F1B's memory (schedule_auto.py)",
          "zb-2p": "the same search with twice the memory",
          "zbv": "two chunks per stage in a V: down the stages and back up; stage 0 holds the "
                 "embedding\n  and the loss, the turn at stage P-1 stays on its rank",
          "v-half": "one micro-batch's passes as a block repeated every 6 slots, spread "
                    "out: half 1F1B's\n  memory (for many stages) for half its bubble",
          "v-min": "the block packed as tightly as the dependencies allow: a third of 1F1B's "
                   "memory\n  (for many stages), two thirds of its bubble",
          "dualpipe": "half the micro-batches enter at each end; stage s holds its piece and "
                      "its mirror's\n  (two copies); X/& cells: a forward overlapped with a "
                      "backward",
          "dualpipev": "DualPipe cut in half: one copy of each piece, in a V, with the "
                       "overlapped pairs"}


# their claims are limits for many stages: the bubble at most the claim, memory the block's
LIMITS_ONLY = ("v-half", "v-min")


def expected_peak(name: str, P: int, M: int, V: int) -> tuple[list[int] | None, str]:
    """(the peak held activations per stage as stated, the statement); None: not checked
    (the searched schedules: at most their limit, checked in show_schedules)."""
    if name == "gpipe":
        return [M] * P, "M on every stage"
    if name == "1f1b":
        return [min(P - s, M) for s in range(P)], "min(P-s, M) on stage s"
    if name == "zb-h1":
        return [min(P, M)] * P, "min(P, M), 1F1B's stage 0"
    if name == "zb-h2":
        return [min(2 * P - 1, M)] * P, "min(2P-1, M)"
    if name == "dualpipe":
        return [P + 1] * P, "P+1 pieces on every stage: DeepSeek-V3's Table 2"
    if name == "dualpipev":
        return [2 * P + 1] * P, "2P+1 chunks of half a stage: Table 2's PP+1, PP = 2P"
    if name in ("zb-1p", "zb-2p", "zbv"):
        return None, "at most its memory limit"
    if name == "v-half" and M >= 2 * P:
        return [P + 2 - P % 2] * P, "P + 2 halves of a stage (P + 1 for an odd P)"
    if name in ("v-half", "v-min"):
        return None, "its building block's"
    if M % P:
        return None, "(M not a multiple of P: not checked)"
    return ([min(M * V, 2 * (P - 1 - s) + (V - 1) * P + 1) for s in range(P)],
            "2(P-1-s)+(V-1)P warm-up forwards + 1,\n    chunks of 1/V stage")


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=RUN, help=f"schedules run for real, from {SCHEDULES}")
    ap.add_argument("--png", default=None, help="also plot memory against bubble into this "
                    "PNG file (needs matplotlib)")
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


def show_schedules(P: int, M: int, V: int, png: str | None) -> list[str]:
    """Part 1: each schedule validated, simulated in unit costs, drawn; then the family's
    trade-off table (and plot); returns problems."""
    unit, problems, rows_out = {k: Fraction(1) for k in "FBW"}, [], []
    names = [n for n in SCHEDULES if runs_on(n, P, M)]
    print(f"== the schedule family, P={P}, M={M}, unit costs F = B = W = 1 (a whole backward "
          f"B+W = 2;\n   an overlapped F&B costs the longer of the two) ==\n{LEGEND}\n"
          f"{FB_LEGEND}")
    skipped = [n for n in SCHEDULES if n not in names]
    if skipped:
        print(f"(not drawn: {', '.join(skipped)}: {'; '.join(NEEDS[n][0] for n in skipped)})")
    one = simulate(make_schedule("1f1b", P, M), costs=unit)
    for name in names:
        schedule = make_schedule(name, P, M, V)
        validate(schedule)                    # raises ScheduleError naming the first problem
        tl = simulate(schedule, costs=unit)   # Fractions: exact times, exact bubble
        bubble = tl.bubble_fraction()
        header, *rows = [r for r in ascii(tl).splitlines() if r.startswith(("stage", name))]
        print(f"\n{header}\n{draw(rows)}"
              "\n  validate: complete, each B after its F, channels in order, no deadlock")
        line = f"  bubble {bubble} = {100 * float(bubble):.1f}%"
        if name not in FORMULA:
            print(line + " (searched or DualPipe's own order: no closed form for one step)")
        elif name in ("gpipe", "1f1b") or M >= (2 * P - 1 if name == "zb-h2" else P):
            closed = bubble_closed_form(name, P, M, V)
            print(line + f" | closed form {FORMULA[name]} = {100 * closed:.1f}%, equal: "
                  f"{float(bubble) == closed}")
            problems += [f"{name}: bubble {bubble} != {closed}"] * (float(bubble) != closed)
        else:
            print(line + f" | closed form {FORMULA[name]} holds for M >= P only:\n  M={M} < "
                  f"P={P}, the pipeline never fills")
        peaks, (want, rule) = peak_activations(schedule), expected_peak(name, P, M, V)
        print(f"  peak activations held per stage: {' '.join(map(str, peaks))}   ({rule})")
        problems += [f"{name}: peaks {peaks} != {want}"] * (want is not None and peaks != want)
        if name in CLAIMS and M >= 2 * P and name not in LIMITS_ONLY:
            memory = max(peaks) * schedule.chunk_share
            problems += [f"{name}: memory {memory} > {CLAIMS[name][1]} x {P}"] * (
                memory > CLAIMS[name][1] * P)
        print(f"  notice: {NOTICE[name]}")
        messages = sum(p2p_formula(schedule, 1))   # over links: the V's turn stays local
        rows_out.append((name, tl, max(peaks) * schedule.chunk_share, messages))
    return problems + trade_off(rows_out, one, P, M, png)


def trade_off(rows: list, one: Timeline, P: int, M: int, png: str | None) -> list[str]:
    """The family side by side: one step's bubble, the bubble when iterations overlap
    (steady_bubble, in units of 1F1B's), peak memory and messages in units of 1F1B's."""
    problems, unit_steady = [], one.steady_bubble()
    base_mem, base_p2p = next((r[2], r[3]) for r in rows if r[0] == "1f1b")
    print(f"\n== the trade-off, P={P}, M={M}: what each buys with memory and messages ==\n"
          f"{'schedule':<12}{'bubble':>8}{'steady':>9}{'x 1F1B':>8}{'memory':>8}{'x 1F1B':>8}"
          f"{'p2p':>6}{'x 1F1B':>8}  claim (x 1F1B, M >= 2P)")
    for name, tl, mem, p2p in rows:
        steady = Fraction(tl.steady_bubble()).limit_denominator(10 ** 6)
        ratio = steady / Fraction(unit_steady).limit_denominator(10 ** 6) if unit_steady else 0
        claim = CLAIMS.get(name)
        said = ", ".join(str(c) for c in claim) if claim is not None else \
            "Table 2 (DeepSeek-V3)" if name.startswith("dualpipe") else "-"
        print(f"{name:<12}{100 * float(tl.bubble_fraction()):>7.1f}%{100 * float(steady):>8.1f}%"
              f"{float(ratio):>8.2f}{str(mem):>8}{float(mem / base_mem):>8.2f}{p2p:>6}"
              f"{p2p / base_p2p:>8.2f}  {said}")
        if claim is not None and M >= 2 * P and name != "zbv" and (
                ratio > claim[0] if name in LIMITS_ONLY else ratio != claim[0]):
            problems.append(f"{name}: steady bubble {ratio} x 1F1B, claimed {claim[0]}")
    print("steady: the idle time inside each stage's own span, the bubble left when one "
          "step's end\n  overlaps the next one's start (no all-stage sync before the "
          "optimizer: Qi et al.'s post-\n  validation); ZBV's paper value is 0, this "
          "greedy search leaves a little; V-Half's and\n  V-Min's claims are limits for "
          "many stages (family.py)")
    if png:
        print(f"wrote {plot_trade_off(rows, png)}")
    return problems


def plot_trade_off(rows: list, path: str) -> str:
    """Memory vs bubble, one point per schedule (needs matplotlib)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install -e '.[plot]'") from None
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, tl, mem, _ in rows:
        x, y = float(mem), 100 * float(tl.steady_bubble())
        ax.scatter([x], [y])
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("peak activations held (micro-batches of a whole stage)")
    ax.set_ylabel("bubble when iterations overlap (%)")
    ax.set_title("pipeline schedules: memory against bubble")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return path


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
    measured = Timeline.from_records([r.pipeline["timeline"][-1] for r in runs], name=name,
                                     chunks=schedule.chunks)
    costs = measured_costs(schedule, [measured])    # median seconds, a stage's whole share
    simulated = simulate(schedule, costs=costs)
    simulated.time_unit = "s"
    print(f"\n-- {name}, last step; median ms per stage's share, stage 0 .. {pp - 1}:\n   "
          + " | ".join(f"{k} " + " ".join(f"{1e3 * c:.2f}" for c in cs)
                       for k, cs in costs.items() if any(cs)))
    print(side_by_side(simulated, measured, ("simulated with these costs", "measured"),
                       columns=COLUMNS).replace(LEGEND + "\n", "").replace("\n" + LEGEND, ""))
    unit = simulate(schedule).bubble_fraction()
    print(f"bubble: measured {100 * measured.bubble_fraction():.1f}% | simulated with these "
          f"costs {100 * simulated.bubble_fraction():.1f}% | unit costs {100 * unit:.1f}%\n"
          "  the simulator counts sends, receives and Python between actions as free, and uses"
          "\n  median costs")
    held, want = [r.pipeline["held_peak"] for r in runs], peak_activations(schedule)
    print(f"peak activations held per stage: measured {held}, peak_activations {want}")
    return [] if held == want else [f"{name}: held {held} != {want}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"demo 12 · pipeline parallel · schedules for P={args.P}, M={args.M}, V={args.V}\n"
          f"real runs on pp={args.pp}, M={args.run_m}: {', '.join(args.run)}")
    problems = show_schedules(args.P, args.M, args.V, args.png)
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
    drawn = sum(runs_on(n, args.P, args.M) for n in SCHEDULES)
    print(f"OK: {drawn} schedules valid, bubbles and peaks as stated; pp={args.pp} losses "
          f"= 1 process (max |Δ| = {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
