"""The run directory: one folder per training run, with everything needed to look at it later.

    RUN_DIR/
      config.json              the command line, GPTConfig, DataConfig, Plan, versions,
                               and MFU's inputs: model FLOPs per token and one rank's peak
      metrics/rank<r>.jsonl    one line per step and rank, flushed each step (metrics.py)
      trace.json               one Chrome/Perfetto trace of the traced steps, every rank
      summary.json             steps, final loss, tokens/s, time split per rank (at the end)
      trace/                   each rank's part of the trace (a JSON line per traced step),
                               until `finish` merges them

The trace is the picture of a step: one track group per rank (pid = rank) and in it one
track (tid) per kind of work, so that the bars of a track nest or follow each other:
    0 step         the step, and under pp its pipeline actions (F0, B0, W0 ...) in it
    1 autograd     every operation's forward ("MatMul") and backward ("MatMul backward")
    2 collectives  every collective call and send/recv of the main thread, named after
                   the call ("all_reduce #17"; args: group, seq, bytes, state, the call)
    3, 4, ...      the calls of other threads (a group's async worker: DDP's buckets)
Only the steps in trace_steps are traced (default the first two), at most MAX_EVENTS
events per rank: a trace is for looking at a step, the metrics are for the whole run.

One rank's view (RankObserver, one of train.train_on_rank's hooks):
    1. begin(step): a traced step switches on two hooks: a Tracer, an autograd Observer
       (after each forward, with the time before it; it also wraps the node's backward
       rule so that the backward is timed wherever it runs), and runtime/flight.py's
       observer (each collective or send/recv as it ends, from its flight record);
    2. end(step, values, span, pipeline): hooks off; one metrics line; the step's events
       go to RUN_DIR/trace/rank<r>-<pid>.jsonl (one line, appended and flushed).
The launcher's view: `create` before spawning, `finish` after the ranks are done (after a
failure too): the parts are merged into trace.json and summary.json is written.
Clocks: ops and steps use time.perf_counter (CLOCK_MONOTONIC: one clock for every process
of the machine); a flight record holds time.time_ns stamps, so a call's bar is placed at
[perf_counter() - its duration, perf_counter()] when it ends, inside any bar around it.
Cost: off, one test per op and one per call; on, ~1 us per op (bench/observe.py).

Reference: PyTorch's profiler (torch.profiler) exports the same kind of trace;
    Google's "Trace Event Format" (observe/trace.py).
Read next: observe/metrics.py, observe/report.py (`python -m minidist report RUN_DIR`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import threading
from datetime import datetime, timezone
from pathlib import Path
from threading import get_ident
from time import perf_counter
from typing import Any, Sequence

import numpy as np

import minidist
from minidist.autograd import tensor as core
from minidist.autograd.tensor import Observer, observe, unobserve
from minidist.observe import metrics, run_files
from minidist.observe.throughput import model_flops_per_token
from minidist.observe.trace import Event, Trace
from minidist.runtime import call
from minidist.runtime import flight
from minidist.train import Hook

LANES = {0: "step", 1: "autograd", 2: "collectives"}
MAX_EVENTS = 200_000                       # per rank and run: the rest is dropped, counted
DEFAULT_TRACE_STEPS = (0, 1)


# --- the folder ---------------------------------------------------------------------------

def config(model_cfg, data_cfg, plan, *, command: Sequence[str] = (),
           peak_flops: float | None = None, **run: Any) -> dict:
    """What config.json holds: the command, the three configs, the run's other settings
    (global_batch, lr, ...), tokens per step (global_batch x T), the versions, and what
    `report` needs for MFU: model_flops_per_token (6N + 12LHQT, N every parameter:
    observe/throughput.py's one convention; None for a MoE model) and peak_flops (one
    rank's peak FLOP/s, observe/peak.py's for the model's dtype; None if not measured)."""
    batch = run.get("global_batch")
    return {"command": " ".join(command), "model": _plain(model_cfg), "data": _plain(data_cfg),
            "plan": _plain(plan), "plan_describe": plan.describe(),
            "world_size": plan.world_size, "run": run,
            "tokens_per_step": None if batch is None else batch * data_cfg.block_size,
            "model_flops_per_token": None if model_cfg.moe_every else
            model_flops_per_token(model_cfg),
            "peak_flops": None if peak_flops is None else float(peak_flops),
            "versions": {"minidist": minidist.__version__, "python": platform.python_version(),
                         "numpy": np.__version__, "platform": platform.platform()},
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _plain(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else repr(obj)


def create(path: str | os.PathLike, cfg: dict) -> Path:
    """Make the run directory (an existing one is reused: a resumed run appends to its
    metrics) and write config.json; return its path."""
    path = Path(path)
    try:
        (path / "metrics").mkdir(parents=True, exist_ok=True)
        _write_json(path / "config.json", cfg)
    except OSError as e:                  # a file, a path not writable: one line, exit 2
        raise ValueError(f"--run-dir {path}: cannot make a run directory there "
                         f"({e.strerror or e}); give a directory this user can write, or "
                         "--run-dir none") from None
    return path


def finish(path: str | os.PathLike) -> dict:
    """After the ranks are done: merge the trace parts into trace.json (if any step was
    traced), write summary.json from the metrics; return the summary."""
    path = Path(path)
    parts = sorted((path / "trace").glob("rank*.jsonl"))
    if parts:
        _write_json(path / "trace.json", merge(parts), indent=None)
        shutil.rmtree(path / "trace")
    cfg = load(path, "config.json") or {}
    summary = metrics.summarize(metrics.read(path / "metrics"), cfg.get("tokens_per_step"))
    _write_json(path / "summary.json", summary)
    return summary


def load(path: str | os.PathLike, name: str) -> Any:
    """RUN_DIR/name read as JSON, or None if it is not there. Read without trusting it
    (observe/run_files.py: no link followed, at most MAX_JSON bytes, UTF-8, nesting
    bounded); RunFileError names the file and what is wrong."""
    return run_files.read_json(Path(path) / name, run_files.MAX_JSON,
                               "MAX_JSON allows config.json or summary.json")


def check_config(cfg: Any, where: str) -> dict:
    """`cfg` if it holds what the report takes from config.json (`config`) with the types
    it has there; else RunFileError naming `where` and the field."""
    f = run_files.field
    run_files.check(cfg, "an object", where)
    f(cfg, "command", "a string", where)
    model = f(cfg, "model", "an object", where)
    for key in ("n_layer", "n_embd", "n_head", "block_size"):
        f(model, key, "an int", where, "model")
    f(model, "dtype", "a string", where, "model")
    f(f(cfg, "data", "an object", where), "task", "a string", where, "data")
    f(cfg, "plan_describe", "a string", where)
    f(cfg, "world_size", "an int", where)
    f(cfg, "tokens_per_step", "an int or null", where)
    for key, kind in (("model_flops_per_token", "an int or null"),
                      ("peak_flops", "a number or null")):     # absent in older runs
        value = f(cfg, key, kind, where) if key in cfg else None
        if value is not None and not 0 < value < float("inf"):
            raise run_files.RunFileError(f"{where}: {key} is {value!r}, expected a "
                                         "number > 0 or null")
    return cfg


def _write_json(path: Path, obj: Any, indent: int | None = 1) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")      # atomic: write, then rename
    tmp.write_text(json.dumps(obj, indent=indent, default=repr))
    os.replace(tmp, path)


def merge(parts: Sequence[Path]) -> dict:
    """One Chrome trace from the ranks' parts (a line per traced step; a line cut short by
    a crash is skipped): time 0 at the first event of any rank; a track group per rank,
    its tracks named (thread_name metadata)."""
    events, lanes = [], {}
    for p in parts:
        for text in p.read_text().splitlines():
            try:
                part = json.loads(text)
            except json.JSONDecodeError:
                continue
            events += _events(part)
            lanes.update({(part["rank"], int(t)): name for t, name in part["lanes"].items()})
    out = Trace(events).shifted().to_json()
    out["traceEvents"][:0] = [
        {"name": key, "ph": "M", "pid": r, "tid": t, "args": arg}
        for (r, t), name in sorted(lanes.items())
        for key, arg in (("thread_name", {"name": name}), ("thread_sort_index",
                                                           {"sort_index": t}))]
    return out


def _events(part: dict) -> list[Event]:
    """The trace events of one part line (RankObserver._trace's compact lists)."""
    r = part["rank"]
    out = [Event(e["name"], r, e["ts"], e["ts"] + e["dur"], e["args"], e["cat"], e["tid"])
           for e in part["bars"]]
    out += [Event(name + " backward" if back else name, r, t0 * 1e6, t1 * 1e6, {},
                  "backward" if back else "forward", lane)
            for name, back, t0, t1, lane in part["ops"]]
    out += [Event(f"{op} #{seq}", r, t0 * 1e6, t1 * 1e6,
                  {"group": group, "seq": seq, "bytes": nbytes, "state": state, "call": text},
                  "p2p" if op in ("send", "recv", "sendrecv") else "collective", lane)
            for op, group, seq, nbytes, state, text, t0, t1, lane in part["calls"]]
    return out


# --- the CLI's run directory --------------------------------------------------------------

def add_arguments(ap) -> None:
    """train's options --run-dir and --trace-steps."""
    ap.add_argument("--run-dir", default=None, metavar="DIR",
                    help="the run directory (config, metrics per step, trace, summary; read "
                         "it with `python -m minidist report DIR`); default "
                         "<UTC time>-<layout> in $MINIDIST_RUN_DIR, else in ./runs; 'none': "
                         "no run directory. A single-process run writes one only when given")
    ap.add_argument("--trace-steps", type=steps_argument, default=DEFAULT_TRACE_STEPS,
                    metavar="STEPS", help="steps traced into DIR/trace.json, e.g. 0,1 or 2-4, "
                                          "or 'none' (default 0,1)")


def steps_argument(text: str) -> tuple[int, ...]:
    """--trace-steps: "0,1" -> (0, 1); "2-4" -> (2, 3, 4); "none" -> ()."""
    if text.strip().lower() == "none":
        return ()
    try:
        steps = set()
        for item in text.split(","):
            lo, _, hi = item.partition("-")
            steps.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        steps = {-1}
    if min(steps, default=-1) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of steps >= 0 like 0,1 or "
                                         "2-4, nor 'none'")
    return tuple(sorted(steps))


def default_path(plan, parent: str | os.PathLike | None = None) -> Path:
    """<UTC time>-<layout> in `parent` (default $MINIDIST_RUN_DIR, else ./runs), e.g.
    runs/20250101-120000-dp2-tp2; a name already taken gets -2, -3, ..."""
    parent = Path(parent or os.environ.get("MINIDIST_RUN_DIR") or "runs")
    axes = [f"{k}{getattr(plan, k)}" for k in ("pp", "dp", "cp", "ep", "tp")
            if getattr(plan, k) > 1]
    slug = "-".join(axes + ([f"zero{plan.zero}"] if plan.zero else [])) or "single"
    base = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{slug}"
    for k in range(1, 1000):
        path = parent / (base if k == 1 else f"{base}-{k}")
        if not path.exists():
            return path
    raise RuntimeError(f"run_dir: {parent / base} and 999 more names are taken")


def for_cli(a, command: Sequence[str], model_cfg, data_cfg, plan) -> Path | None:
    """The run directory of `train`'s options, created with its config.json; None for
    --run-dir none."""
    if a.run_dir is not None and a.run_dir.lower() == "none":
        return None
    path = Path(a.run_dir) if a.run_dir is not None else default_path(plan)
    run = {k: getattr(a, k) for k in ("steps", "batch", "lr", "optimizer", "seed", "dtype")
           if hasattr(a, k)}
    return create(path, config(model_cfg, data_cfg, plan, command=command,
                               peak_flops=getattr(a, "peak_flops", None),
                               global_batch=a.batch, trace_steps=list(a.trace_steps), **run))


# --- one rank -----------------------------------------------------------------------------

class RankObserver(Hook):
    """One rank's metrics lines and trace: a hook of train_on_rank's step (begin at its
    start, end after it)."""

    def __init__(self, path: str | os.PathLike, rank: int,
                 trace_steps: Sequence[int] = DEFAULT_TRACE_STEPS,
                 group_names: dict[int, str] | None = None):
        self.path, self.rank = Path(path), rank
        self.trace_steps = frozenset(trace_steps)
        self.names = group_names if group_names is not None else {}
        self.metrics = metrics.MetricsWriter(self.path / "metrics", rank)
        self.part = self.path / "trace" / f"rank{rank}-{os.getpid()}.jsonl"
        self.written = self.dropped = 0         # events of this rank in its part file
        self.lanes = dict(LANES)
        self._threads: dict[int, int] = {}      # thread ident -> its lane (not the main's)
        self._main = threading.main_thread().ident
        self._tracer = Tracer()

    def begin(self, step: int) -> None:
        if step in self.trace_steps:
            self._tracer.start()

    def on_step_start(self, step: int) -> None:
        self.begin(step)

    def on_step_end(self, end) -> None:
        """COLLECTIVE (the step's global loss): the metrics line and the trace of the step."""
        values = {"loss": end.loss(), "grad_norm": end.grad_norm, "lr": end.lr,
                  "time_s": end.timing, "bytes_sent": end.bytes_by_axis, "bytes": end.bytes,
                  "memory": end.engine.memory()}
        if getattr(end, "moe", None):            # MoE: each layer's routing of the step
            values["moe"] = {name: {**stats, **({} if end.routing_bias is None else
                                                {"bias": end.routing_bias.get(name)})}
                             for name, stats in end.moe.items()}
        self.end(end.step, values, end.span, end.timeline)

    def end(self, step: int, values: dict, span: tuple[float, float] | None = None,
            pipeline: Sequence[tuple] | None = None) -> dict:
        """After step `step`: hooks off, its metrics line (returned), its trace events."""
        traced = self._tracer.on
        if traced:
            self._tracer.stop()
        out = self.metrics.write(step, values)
        if traced:
            self._trace(step, out, span, pipeline or ())
        return out

    def close(self) -> None:
        if self._tracer.on:
            self._tracer.stop()
        self.metrics.close()

    def _trace(self, step: int, line: dict, span, pipeline) -> None:
        """The step's records into this rank's part, one JSON line: `bars` (the step and its
        pipeline actions, trace events), `ops` and `calls` as compact lists that `merge`
        turns into events (lists, not objects: 4x faster to write, on the rank's time)."""
        bars = [] if span is None else [Event(
            f"step {step}", self.rank, span[0] * 1e6, span[1] * 1e6,
            {"loss": line["loss"], "time_s": line["time_s"]}, "step", 0).to_json()]
        bars += [Event(str(a), self.rank, t0 * 1e6, t1 * 1e6,
                       {"micro_batch": a.micro_batch, "chunk": a.chunk}, "pipeline", 0).to_json()
                 for a, t0, t1 in pipeline]
        ops, calls = self._tracer.take(self.names, self._lane)
        room = max(MAX_EVENTS - self.written - len(bars), 0)      # the bars are always kept
        calls = calls[:room]
        ops = ops[:max(room - len(calls), 0)]
        self.dropped += len(self._tracer.last) - len(ops) - len(calls)
        self.written += len(bars) + len(ops) + len(calls)
        self.part.parent.mkdir(parents=True, exist_ok=True)
        with open(self.part, "a") as f:          # one line per traced step, flushed
            f.write(json.dumps({"rank": self.rank, "step": step, "lanes": self.lanes,
                                "dropped": self.dropped, "bars": bars, "ops": ops,
                                "calls": calls}) + "\n")

    def _lane(self, kind: int, thread: int) -> int:
        """Track of an op (kind 0, 1) or a call (2): 1 or 2 on the main thread, one more per
        other thread."""
        if thread == self._main:
            return 1 if kind < 2 else 2
        if thread not in self._threads:
            name = next((t.name for t in threading.enumerate() if t.ident == thread), "?")
            self._threads[thread] = lane = max(self.lanes) + 1
            self.lanes[lane] = f"thread {name}"
        return self._threads[thread]


class Tracer(Observer):
    """A traced step's two hooks: an autograd Observer for the operations and the runtime's
    flight observer for the collective calls; raw records (tuples) until `take`."""

    def __init__(self) -> None:
        self.on, self.raw, self.last = False, [], []
        self._described: dict[tuple, tuple[str, str, str]] = {}   # a call's identity -> text

    def start(self) -> None:
        if any(isinstance(o, Tracer) for o in core.observers) or flight.observer is not None:
            raise RuntimeError("run_dir: another trace is recording in this process (a Tracer "
                               "observes the autograd, or runtime/flight.observer is set); "
                               "one RankObserver per rank process.")
        observe(self)
        flight.observer = self._call
        self.on = True

    def stop(self) -> None:
        unobserve(self)
        flight.observer = None
        self.on = False

    def forward(self, fn, ctx, args, arrays, kwargs, result, t0) -> None:
        t1 = perf_counter()
        self.raw.append((0, fn.__name__, t0, t1, get_ident()))
        node = result._node
        if node is not None:                  # time its backward too, whoever runs it
            result._node = (self._timed(fn.__name__, node[0]),) + node[1:]

    def _timed(self, name: str, backward):
        def timed_backward(ctx: Any, grad: Any) -> Any:
            t0 = perf_counter()
            grads = backward(ctx, grad)
            if self.on:
                self.raw.append((1, name, t0, perf_counter(), get_ident()))
            return grads
        timed_backward.__qualname__ = backward.__qualname__   # autograd/saved.py names by it
        return timed_backward

    def _call(self, row) -> None:
        t1 = perf_counter()
        t0 = t1 - (row[call.T_END] - row[call.T_START]) * 1e-9
        self.raw.append((2, tuple(row), t0, t1, get_ident()))

    def take(self, names: dict[int, str], lane) -> tuple[list, list]:
        """The records so far (then forgotten) as (ops, calls):
            op    [name, 0 forward | 1 backward, start s, end s, track]
            call  [op, group, seq, bytes, state, call.describe text, start s, end s, track]
        Each distinct call is described once (runtime/call.py), its number put in after."""
        self.last, self.raw = self.raw, []
        ops, calls = [], []
        for kind, what, t0, t1, thread in self.last:
            if kind < 2:
                ops.append([what, kind, t0, t1, lane(kind, thread)])
                continue
            key = what[:call.SEQ] + what[call.SEQ + 1:call.STATE]
            if key not in self._described:
                rec = np.array(what, np.int64)
                rec[call.SEQ] = 0
                self._described[key] = (call.decode(int(rec[call.OP])), names.get(
                    int(rec[call.GID]), f"group#{rec[call.GID]}"), call.describe(rec, names))
            op, group, text = self._described[key]
            seq = int(what[call.SEQ])
            calls.append([op, group, seq, int(what[call.NBYTES]),
                          call.STATE_NAMES[int(what[call.STATE])],
                          text.replace(" #0 on ", f" #{seq} on ", 1), t0, t1, lane(2, thread)])
        return ops, calls
