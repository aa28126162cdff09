"""Observability: a run directory, its merged trace and its report, for a dp=2 x tp=2 run.

What you will see: a tiny GPT trained on 4 ranks (dp=2 x tp=2) with a run directory,
written where `python -m minidist train` writes its own (runs/<UTC time>-dp2-tp2 in the
current folder, or in $MINIDIST_RUN_DIR; --run-dir DIR to choose) and kept, so that you
can open its trace: its files; per rank, what the trace holds for the traced step (ops by
phase, collectives by group) and its first few collective bars with their times; the
report `python -m minidist report RUN_DIR` prints. The check: every collective call and
send/recv a rank made in the traced step is a bar in the trace. The reference is each
rank's flight recorder: its position (calls made so far, every group) at the end of each
step, read by the rank itself; and the sequence numbers on every group have no gap and are
the same on every member.

Run:       python demos/25_observability.py [--dp 2 --tp 2 --steps 3 --trace-step 1]
           [--run-dir DIR], then open RUN_DIR/trace.json in https://ui.perfetto.dev
Read with: minidist/observe/run_dir.py, minidist/observe/metrics.py,
           minidist/observe/report.py, minidist/observe/trace.py, minidist/runtime/flight.py
Paper:     PyTorch's profiler traces and NCCL's flight recorder (the same two ideas);
           Google's "Trace Event Format" (the file format)
"""

import argparse
import collections
import json
import textwrap
from pathlib import Path

from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.observe import report, run_dir
from minidist.runtime.launch import spawn
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank

# --- settings (each can be overridden on the command line) ---
DP, TP, STEPS, TRACE_STEP, BATCH, N_LAYER, N_EMBD, N_HEAD, LR = 2, 2, 3, 1, 8, 2, 16, 2, 1e-2
SHOW = 4                                           # collective bars shown per rank
# each number option's (low, high): the demo stays small
LIMITS = dict(dp=(1, 8), tp=(1, 8), steps=(2, 100), trace_step=(1, 99), batch=(1, 256),
              n_layer=(1, 8), n_embd=(1, 256), n_head=(1, 64))
WIDTH = 100                                        # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(dp=DP, tp=TP, steps=STEPS, trace_step=TRACE_STEP, batch=BATCH,
                        n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD), LIMITS)
    ap.add_argument("--run-dir", default=None, metavar="DIR",
                    help="the run directory, kept (default: <UTC time>-<layout> in "
                         "$MINIDIST_RUN_DIR, else in ./runs, as train's)")
    a = ap.parse_args(argv)
    if a.dp * a.tp > 8:
        ap.error(f"--dp {a.dp} x --tp {a.tp} = {a.dp * a.tp} ranks; the demo runs at most 8")
    if a.trace_step >= a.steps:
        ap.error("need --trace-step < --steps (the step before it is the reference)")
    if a.n_embd % a.n_head or a.n_head % a.tp or a.batch % a.dp:
        ap.error(f"need --n-embd a multiple of --n-head, --n-head of --tp and --batch of --dp; "
                 f"got {a.n_embd}, {a.n_head}, {a.tp}, {a.batch}, {a.dp}")
    data = DataConfig(task="reverse", length=3)
    cfg = model_config_for(data, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head)
    try:
        Plan(dp=a.dp, tp=a.tp).validate(cfg, a.batch, data.block_size)
    except ValueError as e:
        ap.error(str(e))
    if a.run_dir is not None and Path(a.run_dir).exists() and any(Path(a.run_dir).iterdir()):
        ap.error(f"--run-dir {a.run_dir} is not empty; give a new directory (the demo writes a "
                 "fresh run there)")
    return a


def rank_main(ctx, cfg, data, plan, a, path):
    """Every rank: train with an observer; at each step's end note the flight recorder's
    position of this rank (calls made so far, on every group)."""
    position = {}

    def note(end):
        position[end.step] = int(ctx.world.records.recorder.pos[ctx.rank])

    observer = run_dir.RankObserver(path, ctx.rank, (a.trace_step,), ctx.world.group_names)
    train_on_rank(ctx, cfg, data, plan, RunConfig(steps=a.steps, global_batch=a.batch),
                  OptimizerConfig(lr=LR), hooks=[observer, OnStepEnd(note)])
    observer.close()
    return position[a.trace_step] - position[a.trace_step - 1]   # calls in the traced step


def show_tree(path: Path) -> None:
    print(f"\n== the run directory {path.name}/ ==")
    for p in sorted(path.iterdir()):
        for q in [p] + (sorted(p.iterdir()) if p.is_dir() else []):
            what = ("" if q.is_dir() else f"{len(q.read_text().splitlines())} lines"
                    if q.suffix == ".jsonl" else f"{q.stat().st_size:,} B")
            print(f"  {'  ' * (q != p)}{q.name}{'/' if q.is_dir() else f'  ({what})'}")


def show_report(lines: list[str]) -> None:
    """report.text's lines (its per-rank tables already fit), any longer line wrapped."""
    for line in lines:
        print(textwrap.fill(line, WIDTH, subsequent_indent="    ") if len(line) > WIDTH
              else line)


def show_trace(trace: dict, ranks: int) -> dict[int, list[dict]]:
    """Per rank: ops by phase, collectives by (op, group), the first SHOW collective bars."""
    print("\n== trace.json: the traced step, rank by rank (times from the first bar) ==")
    bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    calls = {r: sorted((e for e in bars if e["pid"] == r and e["cat"] in ("collective", "p2p")),
                       key=lambda e: e["ts"]) for r in range(ranks)}
    for r in range(ranks):
        ops = collections.Counter(e["cat"] for e in bars if e["pid"] == r
                                  and e["cat"] in ("forward", "backward"))
        groups = collections.Counter(f"{e['name'].split(' #')[0]} on {e['args']['group']}"
                                     for e in calls[r])
        print(textwrap.fill(f"rank {r}: {ops['forward']} forward + {ops['backward']} backward "
                            "ops; " + ", ".join(f"{n} {k}" for k, n in sorted(groups.items())),
                            WIDTH, subsequent_indent="    "))
        for e in calls[r][:SHOW]:
            print(textwrap.fill(f"  {e['ts'] / 1e3:7.2f} ms  {e['dur'] / 1e3:6.2f} ms  track "
                                f"{e['tid']}  {e['args']['call']}", WIDTH,
                                subsequent_indent=" " * 10))
    return calls


def main(argv=None) -> int:
    a = parse_args(argv)
    data = DataConfig(task="reverse", length=3)
    cfg = model_config_for(data, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype="float64")
    plan = Plan(dp=a.dp, tp=a.tp)
    print(f"demo 25 · observability · {plan.describe()} = {plan.world_size} ranks · GPT "
          f"{a.n_layer} layers, C={a.n_embd} · {a.steps} steps, step {a.trace_step} traced")
    path = Path(a.run_dir) if a.run_dir is not None else run_dir.default_path(plan)
    run_dir.create(path, run_dir.config(cfg, data, plan, global_batch=a.batch,
                                        command=["python", "demos/25_observability.py"]))
    made = spawn(plan.world_size, rank_main, cfg, data, plan, a, path)
    run_dir.finish(path)
    show_tree(path)
    calls = show_trace(json.loads((path / "trace.json").read_text()), plan.world_size)
    print("\n== python -m minidist report RUN_DIR --no-plots ==")
    show_report(report.text(path))
    print(f"\nthe run directory is kept:\n  {path}\nopen its trace.json in "
          "https://ui.perfetto.dev; `python -m minidist report DIR` prints the report\n"
          "above again (and draws plots with matplotlib)")
    traced = [len(calls[r]) for r in range(plan.world_size)]
    by_group = collections.defaultdict(dict)             # group -> rank -> sorted seqs
    for r, mine in calls.items():
        for e in mine:
            by_group[e["args"]["group"]].setdefault(r, []).append(e["args"]["seq"])
    gaps = [g for g, ranks in by_group.items() for s in map(sorted, ranks.values())
            if s != list(range(s[0], s[0] + len(s)))]
    differ = [g for g, ranks in by_group.items() if len({tuple(sorted(s)) for s in
                                                         ranks.values()}) != 1]
    if traced != made or gaps or differ:
        print(f"MISMATCH: calls in the trace {traced}, by the flight recorder {made}; groups "
              f"with a gap {gaps}; groups whose members differ {differ}")
        return 1
    print(f"calls per rank of the traced step, in the trace: {', '.join(map(str, traced))}; by "
          f"the flight recorder:\n  {', '.join(map(str, made))}; sequence numbers contiguous "
          f"and equal on every group ({len(by_group)})")
    print(f"OK: the trace has every collective call of the traced step, on all {plan.world_size}"
          " ranks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
