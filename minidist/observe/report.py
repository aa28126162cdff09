"""The run report: a run directory read back, summarised in a few lines, and plotted.

    python -m minidist report RUN_DIR [--no-plots]

A run directory (observe/run_dir.py) holds every step of every rank; the report answers
the first questions one asks of a run: did the loss go down, how fast was it (tokens/s),
where did each rank's step time go (compute, waiting for communication, the rest), how
many bytes did each rank send per step on each mesh axis, and how much memory does each
rank hold. A run that did not finish has no summary.json: the report summarises its
metrics lines instead, and says so.

What it prints (times are means per step; shares are of the rank's step time):
    the command and the model, layout and batch (config.json)
    steps, first and final loss, tokens/s, median step time (summary.json)
    MFU at that tokens/s: tokens/s x model FLOPs per token / (peak FLOP/s x ranks), with
    the model FLOPs per token (6N + 12LHQT, N every parameter) and one rank's peak that
    `train` recorded in config.json: observe/throughput.py's one convention, the progress
    line's and `bench throughput`'s (no line for a MoE model or an older run)
    per rank: step ms, compute / comm wait / other ms (share), bytes sent per step and
    axis, model state after the last step (params + grads + optimizer), peak RSS
    a MoE model: per layer, the max violation of the first and last 10 steps, the drop
    rate and the balancing bias's range (metrics lines' "moe")
    the trace: its events, the traced steps, and where to open it
With the `plot` extra (matplotlib), PNGs in RUN_DIR/plots: loss.png (loss and gradient
norm per step), step_time.png (each rank's step split into compute / comm wait /
other), memory.png (each rank's model state by kind, and its peak RSS). Without it, one
line says how to get them.

A run directory is input like any other: a file that is malformed or was planted there (a
link out of the folder, a FIFO, /dev/zero, a file of gigabytes, a line that is not a
metrics line, JSON nested 100,000 deep) ends the report in one `error:` line that names the
file and the line, exit code 2. Every file is read through observe/run_files.py, which
follows no link, reads regular files only, and never more than its documented limits.

Reference: the per-step numbers follow torchtitan's and Megatron-LM's training logs.
Read next: observe/metrics.py (the lines), observe/run_dir.py (the folder),
    observe/run_files.py (reading them without trusting them).
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from minidist.cli import CliParser, cli_error
from minidist.observe import metrics, run_files
from minidist.observe.progress import human
from minidist.observe.run_dir import check_config, load
from minidist.observe.run_files import RunFileError, check, field
from minidist.observe.throughput import mfu

SHARES = ("compute", "comm_wait", "other")


def _size(n: float) -> str:
    """Bytes for people: 512 B, 28.1 KiB, 40.3 MiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary_of(path: Path) -> tuple[dict, bool]:
    """(the run's summary, True if it is summary.json; False: made from the metrics, as a
    run that did not finish has none)."""
    saved = load(path, "summary.json")
    if saved is not None:
        return metrics.check_summary(saved, str(path / "summary.json")), True
    return (metrics.summarize(metrics.read(path / "metrics"),
                              config_of(path).get("tokens_per_step")), False)


def config_of(path: Path) -> dict:
    """The run's config.json, checked ({} if it has none)."""
    cfg = load(path, "config.json")
    return {} if cfg is None else check_config(cfg, str(path / "config.json"))


def text(path: Path) -> list[str]:
    """The report's lines for the run directory `path`; RunFileError if one of its files
    is not what it must be (observe/run_files.py)."""
    cfg = config_of(path)
    s, finished = summary_of(path)
    out = [f"run directory {path}"]
    if cfg:
        m, d = cfg["model"], cfg["data"]
        out += [f"  {cfg['command'] or '(started from Python, no command line)'}",
                f"  GPT {m['n_layer']} layers, C={m['n_embd']}, H={m['n_head']}, "
                f"T={m['block_size']}, {m['dtype']} · task {d['task']} · "
                f"{cfg['plan_describe']} = {cfg['world_size']} ranks · "
                f"{cfg['tokens_per_step']} tokens/step"]
    if not finished:
        out.append("  (no summary.json: the run did not finish, or is still running; "
                   "summarised from its metrics lines)")
    if not s.get("steps"):
        return out + ["no step finished: metrics/ has no lines"]
    tok = f"{s['tokens_per_s']:,.0f} tokens/s · " if s.get("tokens_per_s") else ""
    out.append(f"steps {s['first_step']}-{s['last_step']} ({s['steps']}) · loss "
               f"{s['losses'][0]:.4f} -> {s['final_loss']:.4f} · {tok}median step "
               f"{s['step_s_median'] * 1e3:.1f} ms (the slowest rank's)")
    u = mfu_of(cfg, s)
    if u is not None:
        out.append(f"MFU {100 * u:.2f}% = {human(s['tokens_per_s'])} tokens/s x "
                   f"{human(cfg['model_flops_per_token'])} FLOPs/token (6N + 12LHQT) / "
                   f"({human(cfg['peak_flops'], 'FLOP/s')} x {cfg['world_size']} ranks)")
    return out + _rank_table(s["ranks"]) + _moe_lines(path) + [_trace_line(path)]


def _moe_lines(path: Path) -> list[str]:
    """A MoE model's routing, per layer, from the lowest rank's metrics lines: the max
    violation (max load / mean load - 1) over the first and the last 10 steps, the drop
    rate over the run, and the balancing bias's range after the last step."""
    lines = metrics.read(path / "metrics")
    first = next((recs for _, recs in sorted(lines.items()) if recs), [])
    per_step = [rec.get("moe", {}) for rec in first]      # checked as they were read
    layers = list(per_step[-1]) if per_step else []
    if not layers:
        return []
    out = ["MoE routing per layer, the global batch's (max violation = max / mean load - 1,",
           "  mean of the first 10 steps -> of the last 10; tokens dropped; the bias at the end):"]
    for name in layers:
        vio = [st[name]["max_violation"] for st in per_step if name in st]
        drops = [st[name]["drop_rate"] for st in per_step if name in st]
        bias = per_step[-1][name].get("bias")
        out.append(f"  {name:<16} max violation {sum(vio[:10]) / len(vio[:10]):.3f} -> "
                   f"{sum(vio[-10:]) / len(vio[-10:]):.3f} · dropped "
                   f"{100 * sum(drops) / len(drops):.1f}%"
                   + ("" if bias is None else f" · bias {min(bias):+.3f} .. {max(bias):+.3f}"))
    return out


def mfu_of(cfg: dict, s: dict) -> float | None:
    """The run's MFU at the summary's tokens/s, by the one convention: tokens/s x
    config.json's model_flops_per_token / (its peak_flops x world_size ranks)
    (observe/throughput.mfu); None when one of them is missing."""
    tokens_per_s, flops = s.get("tokens_per_s"), cfg.get("model_flops_per_token")
    peak, ranks = cfg.get("peak_flops"), cfg.get("world_size", 0)
    if not (tokens_per_s and flops and peak and ranks >= 1):
        return None
    return mfu(tokens_per_s * flops, 1.0, peak, ranks)


def _rank_table(ranks: dict) -> list[str]:
    """Two tables, each within 100 columns: per rank the times, then the bytes and memory."""
    axes = sorted({a for r in ranks.values() for a in r["bytes_sent"]})
    order = sorted(ranks.items(), key=lambda kv: int(kv[0]))
    out = ["per rank, mean per step (and its share of the rank's step):",
           f"  {'rank':<5}{'step ms':>9}" + "".join(f"{k.replace('_', ' ') + ' ms':>17}"
                                                    for k in SHARES)]
    for r, v in order:
        t = v["time_s"]
        share = {k: t[k] / t["step"] * 100 if t["step"] else 0.0 for k in SHARES}
        out.append(f"  {r:<5}{t['step'] * 1e3:>9.2f}"
                   + "".join(f"{t[k] * 1e3:>11.2f} {share[k]:>4.0f}%" for k in SHARES))
    out.append(f"  {'rank':<5}" + "".join(f"{'sent ' + a:>11}" for a in axes)
               + f"{'model state':>13}{'peak RSS':>11}")
    for r, v in order:
        out.append(f"  {r:<5}" + "".join(f"{_size(v['bytes_sent'].get(a, 0)):>11}" for a in axes)
                   + f"{_size(sum(v['memory'].values())):>13}{_size(v['rss_peak']):>11}")
    return out


def _trace_line(path: Path) -> str:
    trace = path / "trace.json"
    raw = run_files.read_json(trace, run_files.MAX_TRACE, "MAX_TRACE allows trace.json")
    if raw is None:
        parts = [n for n in run_files.names_in(path / "trace") if n.startswith("rank")
                 and n.endswith(".jsonl")]
        return (f"trace: not merged yet ({len(parts)} part files in {path / 'trace'})"
                if parts else "trace: none (no step was traced: --trace-steps)")
    events, ranks, steps = _trace_facts(raw, str(trace))
    return (f"trace: {trace}\n  {events:,} events on {ranks} rank{'s' if ranks > 1 else ''}, "
            f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
            "(open it in https://ui.perfetto.dev)")


def _trace_facts(raw, where: str) -> tuple[int, int, list[int]]:
    """(complete events, ranks, traced steps) of a trace.json: its "X" events, their pids,
    and the numbers of its "step N" events (cat "step"); RunFileError naming the event
    that is not such."""
    events = field(check(raw, "an object", where), "traceEvents", "a list", where)
    count, ranks, steps = 0, set(), set()
    for i, e in enumerate(events):
        at = f"traceEvents[{i}]"
        if check(e, "an object", where, at).get("ph") != "X":
            continue
        count += 1
        ranks.add(field(e, "pid", "an int", where, at))
        if e.get("cat") == "step":
            name = field(e, "name", "a string", where, at)
            step = re.fullmatch(r"step (\d{1,9})", name, re.ASCII)
            if step is None:
                raise RunFileError(f'{where}: {at}.name is {name[:40]!r}, expected "step N" '
                                   'in an event of cat "step"')
            steps.add(int(step[1]))
    return count, len(ranks), sorted(steps)


def plots(path: Path) -> list[Path]:
    """loss.png, step_time.png and memory.png in RUN_DIR/plots; ImportError without
    matplotlib."""
    from matplotlib.figure import Figure                 # no pyplot: no global backend state
    from matplotlib.ticker import MaxNLocator
    lines, (s, _) = metrics.read(path / "metrics"), summary_of(path)
    folder = path / "plots"
    first = next((recs for _, recs in sorted(lines.items()) if recs), [])
    steps = [rec["step"] for rec in first]
    fig = Figure(figsize=(7, 5))
    for i, (key, label) in enumerate((("loss", "loss (global batch)"),
                                      ("grad_norm", "gradient norm (before clipping)"))):
        ax = fig.add_subplot(2, 1, i + 1)
        ax.plot(steps, metrics.columns(first, key), marker="." if len(steps) < 50 else None)
        ax.set(ylabel=label, xlabel="step" if i else None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    _save(fig, folder / "loss.png")
    ranks = sorted(s["ranks"], key=int)
    fig = Figure(figsize=(7, 4))
    ax, bottom = fig.add_subplot(), [0.0] * len(ranks)
    for k in SHARES:
        ms = [s["ranks"][r]["time_s"][k] * 1e3 for r in ranks]
        ax.bar(ranks, ms, bottom=bottom, label=k.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, ms)]
    ax.set(xlabel="rank", ylabel="ms per step (mean)", title="where the step time goes")
    ax.legend()
    fig.tight_layout()
    _save(fig, folder / "step_time.png")
    fig = Figure(figsize=(8, 4))
    ax, bottom = fig.add_subplot(1, 2, 1), [0.0] * len(ranks)
    for k in sorted({k for r in ranks for k in s["ranks"][r]["memory"]}):
        kib = [s["ranks"][r]["memory"].get(k, 0) / 1024 for r in ranks]
        ax.bar(ranks, kib, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, kib)]
    ax.set(xlabel="rank", ylabel="KiB", title="model state after the last step")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 2, 2)
    ax.bar(ranks, [s["ranks"][r]["rss_peak"] / 2**20 for r in ranks], color="gray")
    ax.set(xlabel="rank", ylabel="MiB", title="peak resident set size")
    fig.tight_layout()
    _save(fig, folder / "memory.png")
    return [folder / n for n in ("loss.png", "step_time.png", "memory.png")]


def _save(fig, path: Path) -> None:
    """The figure as a PNG at `path`, written without following a link (run_files)."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    run_files.write_file(path, png.getvalue())


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist report RUN_DIR`: print the run's report and write its plots.
    Exit code 0; 2 (one `error:` line) if RUN_DIR is not a run directory, or one of its
    files is malformed, a link, not a regular file or too big (observe/run_files.py)."""
    ap = CliParser(prog="python -m minidist report",
                   description="Summarise a run directory written by `python -m minidist "
                               "train` (and plot it, with the `plot` extra).")
    ap.add_argument("run_dir", help="the folder `train` printed as 'run directory: ...'")
    ap.add_argument("--no-plots", action="store_true", help="print only, write no PNGs")
    a = ap.parse_args(argv)
    path = Path(a.run_dir)
    if not (path / "config.json").exists() and not (path / "metrics").is_dir():
        return cli_error(f"{path} is not a run directory (it has no config.json and no "
                         "metrics/). Give the folder that `python -m minidist train` printed "
                         "as 'run directory: ...'.")
    try:
        print("\n".join(text(path)))
        if a.no_plots or not summary_of(path)[0].get("steps"):
            return 0
        written = plots(path)
    except RunFileError as e:               # a file of RUN_DIR is malformed, or planted
        return cli_error(e)
    except ImportError:
        print("plots: matplotlib is not installed (pip install 'minidist[plot]'), so no PNGs "
              "were written")
        return 0
    print(f"plots: {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
