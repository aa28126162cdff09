"""One measured training run of `python -m minidist bench train`'s tables.

`measure` spawns the plan's ranks (or W ranks that each train alone, the ceiling the
machine allows), trains warm-up + measured steps with train.train_on_rank and reduces the
timings to a Row: per step the slowest rank's step time, the median over the measured
steps; compute, comm wait and CPU time as means over the ranks. `best_of` runs a list of
layouts `repeats` times, interleaved so that the machine's load hits all of them alike,
and keeps each one's fastest repeat. bench/train.py (data parallelism and ZeRO) and
bench/train_layouts.py (tensor, context and expert parallelism) build their tables from
these rows.
Read next: bench/train.py.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from minidist.parallel.context import ring_attention as ra
from minidist.runtime.launch import spawn
from minidist.train import OnStep, OptimizerConfig, Plan, RunConfig, train_on_rank


@dataclass(frozen=True)
class Row:
    """One run of the table (times in seconds, medians over the measured steps)."""

    name: str
    dp: int
    tokens_per_s: float
    step: float
    compute: float
    comm_wait: float
    cpu: float
    sent: int
    sent_by_axis: dict | None = None            # rank 0's {"dp": B, "tp": B} per step
    plan: Plan | None = None
    act: int = 0                                # activation bytes per layer, measured
    hidden: float = float("nan")                # ring: share of the send time hidden


@dataclass
class _Alone:
    """A one-rank context around a one-member group: this rank trains by itself."""

    world: object
    world_size: int = 1
    rank: int = 0


def _on_rank(ctx, model_cfg, data_cfg, plan: Plan, steps: int, batch: int, alone: bool):
    if alone:                                  # every rank creates every group, in order
        mine = [ctx.new_group((r,), name=f"alone{r}") for r in range(ctx.world_size)]
        ctx = _Alone(mine[ctx.rank])
    marks = [(0.0, 0.0)]                       # ring (send, wait) seconds after each step
    ra.RING_TIMES.reset()
    snap = lambda step, loss: marks.append((ra.RING_TIMES.send_s, ra.RING_TIMES.wait_s))  # noqa
    r = train_on_rank(ctx, model_cfg, data_cfg, plan, RunConfig(steps=steps, global_batch=batch),
                      OptimizerConfig(lr=1e-3), hooks=[OnStep(snap) if plan.cp > 1 else None])
    ring = [(s1 - s0, w1 - w0) for (s0, w0), (s1, w1) in zip(marks, marks[1:])]
    return r.timing, [b["sent"] for b in r.bytes_per_step], r.bytes_by_axis, ring


def measure(name: str, model_cfg, data_cfg, plan: Plan, steps: int, warmup: int,
            global_batch: int, alone: int = 0) -> Row:
    """Spawn plan.world_size ranks training `global_batch` (or `alone` ranks, each training
    its own `global_batch`), train `warmup + steps` steps, reduce the timings to a Row."""
    ranks = alone or plan.world_size
    runs = spawn(ranks, _on_rank, model_cfg, data_cfg, plan, warmup + steps, global_batch,
                 bool(alone))
    keep = slice(warmup, warmup + steps)
    slowest = [max(t) for t in zip(*(run[0]["step"][keep] for run in runs))]
    mean = lambda key: [float(np.mean(t)) for t in                       # noqa: E731
                        zip(*(run[0][key][keep] for run in runs))]
    ring = [np.sum(per_rank, axis=0) for per_rank in zip(*(run[3][keep] for run in runs))]
    hidden = [1 - wait / send for send, wait in ring if send > 0]       # all ranks, per step
    step = statistics.median(slowest)
    by_axis = {a: int(statistics.median(b[a] for b in runs[0][2][keep]))
               for a in runs[0][2][0]} if steps else {}
    return Row(name, ranks if not alone else 1,
               global_batch * (alone or 1) * data_cfg.block_size / step, step,
               statistics.median(mean("compute")), statistics.median(mean("comm_wait")),
               statistics.median(mean("cpu")), int(statistics.median(runs[0][1][keep])),
               by_axis, plan, hidden=statistics.median(hidden) if hidden else float("nan"))


def best_of(repeats: int, runs: list, common: dict) -> list[Row]:
    """Each run (name, plan, alone, global batch) `repeats` times, interleaved so that the
    machine's load hits all alike; each keeps its fastest repeat."""
    best: dict[str, Row] = {}
    for _ in range(repeats):
        for name, p, alone, batch in runs:
            row = measure(name, plan=p, alone=alone, global_batch=batch, **common)
            if name not in best or row.tokens_per_s > best[name].tokens_per_s:
                best[name] = row
    return [best[name] for name, *_ in runs]
