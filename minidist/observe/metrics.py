"""Training metrics: one JSON line per step and rank, written while the run goes.

A training run is judged by a handful of numbers per step: the loss, the gradient norm,
the learning rate, how long the step took and where that time went, how many bytes it
sent, how much memory it holds. Every rank writes its own numbers, one JSON object per
line ("JSON lines"), into RUN_DIR/metrics/rank<r>.jsonl, and flushes the line to the
operating system before the next step starts: a run that crashes, or is killed, keeps
every step it finished, and `tail -f` shows the run as it goes.

One rank's view of step s (observe/run_dir.py's RankObserver calls `write`):
    1. train.train_on_rank measures the step (RankResult's numbers for step s);
    2. the global loss is all-reduced (8 bytes; the progress line needs it too);
    3. `MetricsWriter.write(s, values)`: one line, flushed.
At the end (the launcher): `read` the lines of every rank, `summarize` them (summary.json).

A line (every time in seconds, every size in bytes):
    {"step": 3, "rank": 1, "loss": 2.31, "grad_norm": 0.84, "lr": 0.003,
     "time_s": {"step": .., "compute": .., "comm_wait": .., "other": .., "cpu": ..},
     "bytes_sent": {"dp": .., "tp": ..}, "bytes": {"sent": .., "recv": ..},
     "memory": {"params": .., "grads": .., "optimizer": ..}, "rss_peak": .., "unix_time": ..}
loss is the loss of the global batch (equal on every rank); time_s "other" = step -
compute - comm_wait: the update, the clipping, the bookkeeping; bytes_sent is per mesh axis
("dp" the gradient sync, "tp", "pp", ...: train.py's RankResult.bytes_by_axis); memory is
the engine's model state after the step; rss_peak the process's peak resident set size.

Reference: the JSON Lines format (jsonlines.org); the fields follow what torchtitan and
    Megatron-LM log per step (loss, grad norm, lr, throughput, memory).
Read next: observe/run_dir.py (who writes these lines, and the rest of the run directory).
"""

from __future__ import annotations

import json
import os
import re
import resource
import time
from pathlib import Path
from statistics import mean
from typing import Any, Iterable

from minidist.observe import run_files

TIME_KEYS = ("step", "compute", "comm_wait", "cpu")
RANK_FILE = re.compile(r"rank(\d{1,9})\.jsonl", re.ASCII)      # rank 3: rank3.jsonl


def line(rank: int, step: int, values: dict[str, Any]) -> dict[str, Any]:
    """The metrics line of `rank` at `step` from train_on_rank's numbers: values holds
    loss, grad_norm, lr, time_s (TIME_KEYS), bytes_sent (per axis), bytes, memory."""
    t = {k: float(values["time_s"][k]) for k in TIME_KEYS}
    t["other"] = t["step"] - t["compute"] - t["comm_wait"]
    return {"step": int(step), "rank": int(rank), "loss": float(values["loss"]),
            "grad_norm": float(values["grad_norm"]), "lr": float(values["lr"]),
            "time_s": t,
            "bytes_sent": {k: int(v) for k, v in values["bytes_sent"].items()},
            "bytes": {k: int(v) for k, v in values.get("bytes", {}).items()},
            "memory": {k: int(v) for k, v in values.get("memory", {}).items()},
            "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB
            "unix_time": time.time(), **_moe(values.get("moe"))}


def _moe(stats: dict | None) -> dict:
    """{"moe": {layer: routing of the step}} for a MoE model (train._moe_stats: the global
    batch's load per expert, with and without the balancing bias, their max violation, the
    drop rate, aux and z; the bias after the step when the model balances by bias)."""
    if not stats:
        return {}
    keep = ("load", "unbiased_load", "max_violation", "unbiased_max_violation",
            "drop_rate", "aux", "z")
    out = {}
    for name, st in stats.items():
        out[name] = {k: st[k] for k in keep if k in st}
        if st.get("bias") is not None:
            out[name]["bias"] = [float(b) for b in st["bias"]]
    return {"moe": out}


def check_moe(rec: dict, where: str) -> dict:
    """rec["moe"] ({} if absent): each layer's max_violation and drop_rate numbers, its
    bias (if any) a list of numbers; else RunFileError naming `where` and the field."""
    moe = rec.get("moe", {})
    run_files.check(moe, "an object", where, "moe")
    for name, st in moe.items():
        at = f"moe.{name}"
        run_files.check(st, "an object", where, at)
        for key in ("max_violation", "drop_rate"):
            run_files.field(st, key, "a number", where, at)
        if "bias" in st:
            for i, b in enumerate(run_files.field(st, "bias", "a list", where, at)):
                run_files.check(b, "a number", where, f"{at}.bias.{i}")
    return moe


class MetricsWriter:
    """Appends this rank's lines to `folder`/rank<r>.jsonl (a resumed run adds to them)."""

    def __init__(self, folder: str | os.PathLike, rank: int):
        self.rank = rank
        self.path = Path(folder) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def write(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Write and flush one line (see `line`); return it."""
        out = line(self.rank, step, values)
        self._file.write(json.dumps(out) + "\n")
        self._file.flush()                     # in the kernel now: a crash keeps it
        return out

    def close(self) -> None:
        self._file.close()


def read(folder: str | os.PathLike) -> dict[int, list[dict]]:
    """{rank: its lines in step order} of every rank<r>.jsonl in `folder`. A step written
    twice (a run resumed from a checkpoint redoes steps) keeps its last line; a line that
    is not JSON (cut short: the rank was killed while writing it) is skipped.

    The files are read without trusting them (observe/run_files.py: no link followed, at
    most MAX_METRICS bytes in all) and each line is checked (`check_line`): RunFileError
    names the file, the line and the field."""
    folder = Path(folder)
    out = {}
    for name, text in run_files.read_folder(folder, RANK_FILE, run_files.MAX_METRICS,
                                            "MAX_METRICS allows all metrics files together"):
        by_step = {}
        for n, row in enumerate(text.split("\n"), start=1):
            where = f"{folder / name} line {n}"
            try:
                rec = run_files.parse_json(row, where)
            except json.JSONDecodeError:
                continue                      # a torn line
            by_step[check_line(rec, where)["step"]] = rec
        out[int(RANK_FILE.fullmatch(name)[1])] = [by_step[s] for s in sorted(by_step)]
    return dict(sorted(out.items()))


def check_line(rec: Any, where: str) -> dict:
    """`rec` if it holds what `summarize` and the report take from a line (`line`): an int
    step, numbers loss, grad_norm and rss_peak, `_check_numbers`' objects and a MoE
    model's "moe" (check_moe); else
    RunFileError naming `where` and the field."""
    run_files.check(rec, "an object", where)
    run_files.field(rec, "step", "an int", where)
    for key in ("loss", "grad_norm"):
        run_files.field(rec, key, "a number", where)
    check_moe(rec, where)
    return _check_numbers(rec, where)


def _check_numbers(rec: dict, where: str, at: str = "") -> dict:
    """time_s (step, compute, comm_wait, other and any more: numbers), bytes_sent and
    memory (objects of numbers) and rss_peak (a number), in a line or a rank's summary."""
    times = run_files.numbers(rec, "time_s", where, at)
    for key in ("step", "compute", "comm_wait", "other"):
        run_files.field(times, key, "a number", where, f"{at}.time_s" if at else "time_s")
    for key in ("bytes_sent", "memory"):
        run_files.numbers(rec, key, where, at)
    run_files.field(rec, "rss_peak", "a number", where, at)
    return rec


def summarize(lines: dict[int, list[dict]], tokens_per_step: int | None = None) -> dict:
    """The run in a few numbers (summary.json): steps, final loss, tokens/s and per rank
    the mean time per step split into compute / comm wait / other, the mean bytes sent per
    step and axis, the memory after the last step and the peak RSS.

    A step ends when its slowest rank ends: tokens/s = tokens_per_step * steps / the sum
    over steps of the largest step time of any rank."""
    if not any(lines.values()):
        return {"steps": 0, "ranks": {}}
    steps = sorted({rec["step"] for recs in lines.values() for rec in recs})
    slowest = {s: 0.0 for s in steps}
    for recs in lines.values():
        for rec in recs:
            slowest[rec["step"]] = max(slowest[rec["step"]], rec["time_s"]["step"])
    first = next(recs for _, recs in sorted(lines.items()) if recs)   # the lowest rank's
    wall = sum(slowest.values())
    out = {"steps": len(steps), "first_step": steps[0], "last_step": steps[-1],
           "final_loss": first[-1]["loss"], "losses": [rec["loss"] for rec in first],
           "step_s_median": sorted(slowest.values())[len(steps) // 2], "wall_s": wall,
           "tokens_per_step": tokens_per_step,
           "tokens_per_s": tokens_per_step * len(steps) / wall
           if tokens_per_step and wall > 0 else None,
           "ranks": {str(r): _rank_summary(recs) for r, recs in lines.items() if recs}}
    return out


def _rank_summary(recs: list[dict]) -> dict:
    """Means per step of one rank's times and bytes; its last memory; its peak RSS."""
    keys = [k for k in recs[0]["time_s"] if all(k in rec["time_s"] for rec in recs)]
    times = {k: mean(rec["time_s"][k] for rec in recs) for k in keys}
    axes = sorted({a for rec in recs for a in rec["bytes_sent"]})
    return {"time_s": times,
            "bytes_sent": {a: mean(rec["bytes_sent"].get(a, 0) for rec in recs) for a in axes},
            "memory": recs[-1]["memory"], "rss_peak": max(rec["rss_peak"] for rec in recs)}


def check_summary(s: Any, where: str) -> dict:
    """`s` if it holds what the report takes from a summary (`summarize`) with the types
    it has there; else RunFileError naming `where` and the field."""
    f = run_files.field
    run_files.check(s, "an object", where)
    if not f(s, "steps", "an int", where):
        return s                                  # no step finished: nothing more is read
    for key in ("first_step", "last_step"):
        f(s, key, "an int", where)
    for key in ("final_loss", "step_s_median"):
        f(s, key, "a number", where)
    if "tokens_per_s" in s:
        f(s, "tokens_per_s", "a number or null", where)
    losses = f(s, "losses", "a list", where)
    if not losses:
        raise run_files.RunFileError(f"{where}: losses is empty, expected the loss of each "
                                     f"of its {s['steps']} steps")
    for i, loss in enumerate(losses):
        run_files.check(loss, "a number", where, f"losses[{i}]")
    for r, rank in f(s, "ranks", "an object", where).items():
        if not re.fullmatch(r"\d{1,9}", r, re.ASCII):
            raise run_files.RunFileError(f"{where}: ranks holds the key {json.dumps(r[:24])},"
                                         " expected a rank (a number)")
        run_files.check(rank, "an object", where, f"ranks.{r}")
        _check_numbers(rank, where, f"ranks.{r}")
    return s


def columns(lines: Iterable[dict], key: str) -> list[float]:
    """One field of every line, in order: "loss", "grad_norm", "lr" or "time_s.compute"."""
    head, _, sub = key.partition(".")
    return [float(rec[head][sub] if sub else rec[head]) for rec in lines]
