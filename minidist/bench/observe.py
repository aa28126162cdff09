"""Benchmark: what observability costs per training step (target: <= 3 % with the trace on).

Three runs of train.train_on_rank on the same layout, interleaved (off, metrics, trace,
off, ...) so that the machine's load hits all alike; each keeps its fastest repeat:
    off       no observer: nothing recorded (the hooks cost a None test each)
    metrics   observe/run_dir.RankObserver, no step traced: a JSON line per step and
              rank (flushed), the engine's memory() and the global loss's 8-byte
              all-reduce (which `train` makes anyway for its progress line)
    trace     the same, every step traced: each op's forward and backward, each
              collective and send/recv, recorded and written as trace events
Columns (milliseconds, medians over the measured steps of the slowest rank):
    step      train_on_rank's own step time (forward, backward, update): what the trace
              hooks slow down
    cpu       the CPU time of a rank's process in the step (mean over ranks)
    wall      from one step's end to the next one's: the step plus everything after it
              (the metrics line, the trace events written out)
    overhead  wall / wall of "off" - 1
    events    trace events per rank per step
On a machine shared with other jobs, differences of a few per cent between the rows are
noise. So the hooks are also timed alone, in this process (fastest of several batches):
cost per op = one forward event and one backward event, and the overhead they predict =
events per step x cost per event / step time of "off".

Run:  python -m minidist bench observe [--dp 2] [--tp 1] [--steps 8] [--warmup 2]
      [--repeats 3] [--n-layer 2] [--n-embd 64] [--batch-per-rank 32] [--length 8]
      (default: about 15 s)
Read next: observe/run_dir.py.
"""

from __future__ import annotations

import argparse
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import shlex                                   # noqa: E402
import shutil                                  # noqa: E402
import statistics                              # noqa: E402
import tempfile                                # noqa: E402
from dataclasses import dataclass              # noqa: E402
from time import perf_counter                  # noqa: E402

from minidist.autograd.tensor import Add          # noqa: E402
from minidist.cli import CliParser, at_least   # noqa: E402
from minidist.data import DataConfig, model_config_for  # noqa: E402
from minidist.observe import run_dir           # noqa: E402
from minidist.observe.run_dir import Tracer    # noqa: E402
from minidist.runtime.launch import spawn      # noqa: E402
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

MODES = ("off", "metrics", "trace")


@dataclass(frozen=True)
class Row:
    """One mode: median step and wall times (s) of the slowest rank, events per step."""

    mode: str
    step: float
    wall: float
    events: float
    cpu: float = 0.0


def _on_rank(ctx, cfg, data_cfg, plan, steps: int, batch: int, mode: str, path: str | None):
    observer = None if mode == "off" else run_dir.RankObserver(
        path, ctx.rank, range(steps) if mode == "trace" else (), ctx.world.group_names)
    ends: list[float] = []
    r = train_on_rank(ctx, cfg, data_cfg, plan, RunConfig(steps=steps, global_batch=batch),
                      OptimizerConfig(lr=1e-3),
                      hooks=[observer, OnStepEnd(lambda end: ends.append(perf_counter()))])
    if observer is not None:
        observer.close()
    return r.timing["step"], ends, 0 if observer is None else observer.written, \
        r.timing["cpu"]


def measure(mode: str, cfg, data_cfg, plan: Plan, steps: int, warmup: int,
            batch: int) -> Row:
    """Spawn the ranks, train warmup + steps steps under `mode`, reduce to a Row."""
    folder = None if mode == "off" else tempfile.mkdtemp(prefix="minidist-bench-observe-")
    try:
        if folder is not None:
            run_dir.create(folder, run_dir.config(cfg, data_cfg, plan, global_batch=batch))
        runs = spawn(plan.world_size, _on_rank, cfg, data_cfg, plan, warmup + steps, batch,
                     mode, folder)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    keep = slice(warmup, warmup + steps)
    step = [max(t) for t in zip(*(r[0][keep] for r in runs))]
    walls = [[b - a for a, b in zip(r[1], r[1][1:])][warmup - 1 if warmup else 0:]
             for r in runs]
    wall = [max(t) for t in zip(*walls)]
    cpu = [sum(t) / len(t) for t in zip(*(r[3][keep] for r in runs))]
    return Row(mode, statistics.median(step), statistics.median(wall),
               max(r[2] for r in runs) / (warmup + steps), statistics.median(cpu))


def hook_cost(n: int = 20000, batches: int = 5) -> float:
    """Seconds the trace hooks add per op (its forward and its backward event), timed on a
    stand-in op: fastest batch of n, minus the same calls without hooks."""

    class Result:                              # what Tracer.forward sees: a Tensor's _node
        __slots__ = ("_node",)

    def rule(ctx, g):
        return g

    def once(tracer) -> None:
        r = Result()
        r._node = (rule, None, ())
        if tracer is not None:
            tracer.forward(Add, None, (), [], {}, r, perf_counter())
        r._node[0](None, 1.0)

    tracer, best = Tracer(), {}
    tracer.on = True                           # record, without plugging it in
    for _ in range(batches):
        for key, t in (("off", None), ("on", tracer)):
            t0 = perf_counter()
            for _ in range(n):
                once(t)
            best[key] = min(best.get(key, 1e9), (perf_counter() - t0) / n)
            tracer.raw.clear()
    return best["on"] - best["off"]


def render(rows: list[Row]) -> str:
    off = rows[0].wall
    lines = [f"{'mode':<9}{'step ms':>10}{'cpu ms':>10}{'wall ms':>10}{'overhead':>10}"
             f"{'events':>9}"]
    for r in rows:
        lines.append(f"{r.mode:<9}{r.step * 1e3:>10.2f}{r.cpu * 1e3:>10.2f}"
                     f"{r.wall * 1e3:>10.2f}{(r.wall / off - 1) * 100:>9.1f}%{r.events:>9.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench observe`: step time with and without metrics and trace."""
    p = CliParser(prog="python -m minidist bench observe", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=at_least(1), default=2, help="data-parallel ranks")
    p.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel ranks")
    p.add_argument("--steps", type=at_least(1), default=8, help="measured steps")
    p.add_argument("--warmup", type=at_least(1), default=2,
                   help="steps before them (>= 1: the first wall time needs a step before)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="interleaved runs; best kept")
    p.add_argument("--n-layer", type=at_least(1), default=2)
    p.add_argument("--n-embd", type=at_least(1), default=64)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=8, help="prompt length, T = 2 x it")
    p.add_argument("--batch-per-rank", type=at_least(1), default=32,
                   help="sequences per dp rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    a = p.parse_args(argv)
    print("$ python -m minidist bench observe " + shlex.join(argv or []))
    data_cfg = DataConfig(task="sort", length=a.length)
    try:
        cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                               dtype=a.dtype)
        plan = Plan(dp=a.dp, tp=a.tp, check_placements=False)
        plan.validate(cfg, a.batch_per_rank * a.dp, data_cfg.block_size)
    except ValueError as e:
        p.error(str(e))
    print(f"GPT {a.n_layer} layers, C={a.n_embd}, T={data_cfg.block_size}, {a.dtype} on "
          f"{plan.describe()}, batch {a.batch_per_rank * a.dp}; {a.warmup} + {a.steps} steps,"
          f" best of {a.repeats}")
    best: dict[str, Row] = {}
    for _ in range(a.repeats):
        for mode in MODES:
            row = measure(mode, cfg, data_cfg, plan, a.steps, a.warmup,
                          a.batch_per_rank * a.dp)
            if mode not in best or row.wall < best[mode].wall:
                best[mode] = row
    rows = [best[m] for m in MODES]
    print(render(rows))
    per_op = hook_cost()
    predicted = rows[2].events * per_op / 2 / rows[0].step
    print(f"measured: trace {(rows[2].wall / rows[0].wall - 1) * 100:+.1f} %, metrics alone "
          f"{(rows[1].wall / rows[0].wall - 1) * 100:+.1f} % of the wall time per step "
          "(target <= 3 %)")
    print(f"hooks alone: {per_op * 1e6:.2f} us per op (2 events) x {rows[2].events:.0f} events "
          f"/ 2 per step = {predicted * 100:.2f} % of the step time of 'off'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
