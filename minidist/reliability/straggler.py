"""Stragglers: notice the rank that holds everyone up, and give its replica fewer rows.

Synchronous training runs at the pace of its slowest rank: the gradient sync of a step
cannot finish before the last replica's backward has. One slow machine (a throttled
GPU, a noisy neighbour on its CPU) slows the whole job to its pace and raises no error.
A slow rank shows in the others' wait, not in their compute: a fast rank's wall time
includes waiting for the slow one, so wall time points at nobody, and compute time
points at the culprit.

Measure. After each step every rank contributes four float64 numbers, train.py's timing
of the step: its dp coordinate, its compute time (forward and backward of its
micro-batches), its communication wait (the seconds it spent inside calls on its groups:
under DDP what the optimizer step waited for the gradient sync) and its step time; one
all_gather over the world group gives every rank the same (W, 4) table. Under DDP and
ZeRO-1 the gradient sync overlaps the backward and is waited for only in the optimizer
step, so a fast rank's compute holds no waiting for a slow one. ZeRO-2 and -3 block inside
the backward (reduce-scatters; and stage 3's all-gathers in the forward too): the groups
time those calls (runtime/group.py) and train.py moves them from compute to the
communication wait, so a fast rank's compute is again its own. Limits: time lost before
the forward (loading data) is not seen. A `slow` fault (reliability/faults.py) sleeps as
the forward begins, as a slow device computes late; with per_row= its delay follows the
rows it is given.

Detect (`Detector`). A rank is slow in a step when its compute time exceeds FACTOR
(F = 1.5) times the median of the other ranks' compute; it is a straggler once it has
been slow for PATIENCE (K = 3) consecutive steps. Rank 0 prints one line then:

    straggler: rank 1 computes 2.4x the median for 3 steps (compute 41 ms vs 17 ms)

(means over those K steps). A rank that stops being slow resets its count, and is named
again if it becomes a straggler again. Noise within F names nobody. Under tp, cp or pp
the peers of a replica wait for each other inside compute, so the ranks of a slow
replica are named together.

Rebalance (`Balancer`, --straggler rebalance). A replica's time is its slowest rank's
compute, and its speed s_d = rows_d / time_d (rows per second, summed over the last
EVERY = 5 steps). Every EVERY steps, each dp rank d is offered rows in proportion to
its speed, r_d = B s_d / sum s (at least M, one row per micro-batch; largest remainders,
ties to the lower rank); the new rows are used from the next step when the predicted step
time max_d r_d / s_d is at least MIN_GAIN = 10 % below the measured one (hysteresis), so
noise of a few per cent moves no row. The tp, cp and pp ranks of a replica share its rows
(parallel/micro_batching.py, micro_batches(rows=...)). The prediction takes compute as proportional to the
rows; a fixed per-step delay is not, so the prediction is optimistic and the rows move in
several smaller steps, each made only while it still predicts 10 %. A replica that speeds
up again gets its rows back the same way.

Exactness. Every micro-batch loss is divided by the token count of the WHOLE global batch
(parallel/micro_batching.py), so any partition of the rows over the dp ranks sums to the same
gradient, up to the order of additions: a rebalanced run equals the even one within ~1e-12 in
float64, not bitwise. Dropout follows the global sample index, so it does not move.
MoE models keep the even split (their routing groups and capacity follow the rows of a
micro-batch): rebalance falls back to detect there.

One rank's view (train.py cuts each step's micro-batches by `rows` and calls
`Straggler.end` after the update):
    1. the step, on rows[d] rows for dp rank d (the same tuple on every rank)
    2. end: all_gather [dp rank, compute, comm_wait, step] over the world group;
       the Detector names stragglers (rank 0 logs); under rebalance the Balancer may set
       new rows for the next step. Every rank computes the same answer from the same
       gathered table in the same float64 order: no second message is needed.
Communication: one all_gather of 4 float64 per rank per step on the world group, (W-1) x
32 bytes for each rank to receive; like on_step's all-reduce it runs outside the step's
byte count (RankResult.bytes_per_step holds training traffic only).

References: FALCON (Wu et al. 2024, arXiv:2410.12588) detects fail-slow ranks from their
iteration times and mitigates them at several levels, shifting micro-batches between
data-parallel groups among them; Llama 3 (Dubey et al. 2024, sec. 3.3.4) on stragglers
slowing thousands of GPUs.
Read next: observe/throughput.py
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from minidist import collectives as C
from minidist.train import Hook

MODES = ("off", "detect", "rebalance")
FACTOR, PATIENCE, EVERY, MIN_GAIN = 1.5, 3, 5, 0.10
HISTORY = 4096                     # steps of gathered timings a Straggler keeps


class Detector:
    """The straggler rule on each step's compute times (see the module docstring)."""

    def __init__(self, factor: float = FACTOR, patience: int = PATIENCE):
        if not factor > 1 or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"straggler Detector: factor={factor!r} must be > 1 and "
                             f"patience={patience!r} an int >= 1")
        self.factor, self.patience = factor, patience
        self.streak: dict[int, list[tuple[float, float]]] = {}   # rank -> (compute, median)

    def state_dict(self) -> dict:
        """The running streaks, JSON-able (a checkpoint keeps them)."""
        return {"streak": {str(r): [list(p) for p in run] for r, run in self.streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.streak = {int(r): [(float(c), float(m)) for c, m in run]
                       for r, run in state["streak"].items()}

    def observe(self, compute) -> list[str]:
        """Fold in one step's compute time per rank (seconds, in rank order); return a
        line for each rank that has just become a straggler."""
        t = np.asarray(compute, np.float64)
        lines = []
        for r in range(len(t)):
            others = np.delete(t, r)
            median = float(np.median(others)) if len(others) else float("inf")
            if not t[r] > self.factor * median:
                self.streak.pop(r, None)
                continue
            run = self.streak.setdefault(r, [])
            run.append((float(t[r]), median))
            if len(run) == self.patience:
                mine, theirs = (float(np.mean(v)) for v in zip(*run))
                lines.append(f"straggler: rank {r} computes {mine / theirs:.1f}x the median "
                             f"for {self.patience} steps (compute {1e3 * mine:.0f} ms vs "
                             f"{1e3 * theirs:.0f} ms)")
        return lines


def partition(speeds, total: int, least: int) -> tuple[int, ...]:
    """Integers r_d >= least summing to `total`, r_d close to total s_d / sum s: ranks
    whose share falls below `least` get `least`, the others share the rest in proportion
    (floors, then one more row to the largest remainders, ties to the lower rank)."""
    s = [float(v) for v in speeds]
    if total < least * len(s) or not all(v > 0 for v in s):
        raise ValueError(f"partition: {total} rows cannot give each of {len(s)} ranks "
                         f"{least}, or speeds {s} are not all > 0")
    fixed: set[int] = set()
    while True:
        free = [d for d in range(len(s)) if d not in fixed]
        left, norm = total - least * len(fixed), sum(s[d] for d in free)
        ideal = {d: left * s[d] / norm for d in free}
        low = {d for d in free if ideal[d] < least}
        if not low:
            break
        fixed |= low
    rows = {d: least for d in fixed} | {d: int(ideal[d]) for d in free}
    for d in sorted(free, key=lambda d: (rows[d] - ideal[d], d))[:total - sum(rows.values())]:
        rows[d] += 1
    return tuple(rows[d] for d in range(len(s)))


class Balancer:
    """The rows of each dp rank, moved towards the replicas' speeds (module docstring)."""

    def __init__(self, dp: int, global_batch: int, micro_batches: int, every: int = EVERY,
                 min_gain: float = MIN_GAIN):
        self.B, self.M, self.every, self.min_gain = global_batch, micro_batches, every, min_gain
        self.rows = (global_batch // (dp * micro_batches) * micro_batches,) * dp
        self.window: list[tuple[tuple[int, ...], np.ndarray]] = []

    def state_dict(self) -> dict:
        """The rows in use and the window of timings not yet acted on, JSON-able."""
        return {"rows": list(self.rows),
                "window": [[list(rows), t.tolist()] for rows, t in self.window]}

    def load_state_dict(self, state: dict) -> None:
        self.rows = tuple(int(r) for r in state["rows"])
        self.window = [(tuple(int(r) for r in rows), np.asarray(t, np.float64))
                       for rows, t in state["window"]]

    def observe(self, replica_time) -> str | None:
        """Fold in one step's time per dp rank (its slowest rank's compute); every `every`
        steps, move rows if that gains enough; returns a line saying so, or None."""
        self.window.append((self.rows, np.asarray(replica_time, np.float64)))
        if len(self.window) < self.every:
            return None
        rows = np.array([r for r, _ in self.window], np.float64)          # (steps, dp)
        times = np.array([t for _, t in self.window])                     # (steps, dp)
        self.window = []
        if not np.all(times.sum(0) > 0):
            return None
        speed = rows.sum(0) / times.sum(0)                                 # rows per second
        new = partition(speed, self.B, self.M)
        now, then = float(times.mean(0).max()), float(np.max(np.array(new) / speed))
        if new == self.rows or then > (1 - self.min_gain) * now:
            return None
        old, self.rows = self.rows, new
        return (f"straggler: rows per dp rank {old} -> {new} (slowest replica's compute "
                f"{1e3 * now:.0f} ms; {1e3 * then:.0f} ms if proportional to rows)")


class Straggler(Hook):
    """One rank's straggler handling, train_on_rank's `straggler=` (module docstring): a
    hook of the step (on_step_end; the loop reads `rows` for the next step's split).
    `world`: the group of every rank; `log(line)` prints (rank 0's); `history` records
    the rows used at each step and the gathered (W, 4) tables (the last HISTORY steps),
    for tests and plots."""

    def __init__(self, mode: str, world, dp: int, global_batch: int, micro_batches: int,
                 log: Callable[[str], None] = print, detector: Detector | None = None,
                 balancer: Balancer | None = None):
        if mode not in MODES[1:]:
            raise ValueError(f"--straggler {mode!r}: use one of {', '.join(MODES)}")
        self.mode, self.world, self.log = mode, world, log
        self.detector = detector or Detector()
        self.balancer = balancer or Balancer(dp, global_batch, micro_batches)
        self.history: deque[tuple[tuple[int, ...], np.ndarray]] = deque(maxlen=HISTORY)

    def state_dict(self) -> dict:
        """The detector's streaks and the balancer's rows and window (a checkpoint keeps
        them: a resumed run trains on the rows the uninterrupted one would)."""
        return {"detector": self.detector.state_dict(), "balancer": self.balancer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.balancer.load_state_dict(state["balancer"])

    @property
    def rows(self) -> tuple[int, ...]:
        """Rows of each dp rank for the coming step."""
        return self.balancer.rows

    def on_step_end(self, end) -> None:
        """The hook protocol (train.Hook): COLLECTIVE, `end` with this step's timings."""
        self.end(end.dp_rank, end.timing["compute"], end.timing["comm_wait"],
                 end.timing["step"])

    def end(self, dp_rank: int, compute: float, comm_wait: float, step: float) -> None:
        """COLLECTIVE over the world group: gather this step's timings (seconds: forward
        and backward, waiting for the gradient sync, the whole step), detect, and under
        rebalance perhaps set the rows of the next step."""
        mine = np.array([dp_rank, compute, comm_wait, step], np.float64)
        table = C.all_gather(mine, group=self.world)                       # (W, 4)
        self.history.append((self.rows, table))
        for line in self.detector.observe(table[:, 1]):
            self.log(line)
        if self.mode == "rebalance":
            dp = len(self.rows)
            slowest = np.zeros(dp)
            for d, t in zip(table[:, 0].astype(int), table[:, 1]):
                slowest[d] = max(slowest[d], t)
            line = self.balancer.observe(slowest)
            if line is not None:
                self.log(line)


def add_arguments(ap) -> None:
    """--straggler, for `python -m minidist train` (recovery.add_arguments calls this)."""
    ap.add_argument("--straggler", default="off", choices=list(MODES),
                    help="detect: name a rank whose compute exceeds 1.5x the others' median "
                         "for 3 steps; rebalance: also move rows away from slow dp ranks "
                         "(reliability/straggler.py)")


def for_rank(ctx, a, plan, cfg) -> Straggler | None:
    """This rank's Straggler for the train command's options (None for --straggler off);
    a MoE model keeps the even split, so rebalance detects only there (rank 0 says so)."""
    mode = getattr(a, "straggler", "off")
    if mode == "off":
        return None
    log = (lambda line: print(line, flush=True)) if ctx.rank == 0 else (lambda line: None)
    if mode == "rebalance" and cfg.moe_every:
        log("straggler: MoE routing groups follow the rows of a micro-batch, so the rows "
            "stay even; detecting only")
        mode = "detect"
    return Straggler(mode, ctx.world, plan.dp, a.batch, plan.micro_batches, log)
