"""Fault injection: make a chosen rank fail, hang, slow down or compute garbage, on purpose.

Recovery code is only as good as the failures it has seen. So every failure the
runtime and the training loop must survive can be injected, by one rank, at one
step, at one point of that step:

    python -m minidist train ... --inject sigkill:rank=1:step=5
    MINIDIST_INJECT="sleep:rank=0:step=3:seconds=2;raise:rank=2:step=7" python script.py

A spec is `kind:rank=R:step=S[:point=P][:attempt=A][:seconds=X][:per_row=Y][:phase=NAME]`:
    kind     raise     raise InjectedFault (an ordinary Python error)
             exit      os._exit(3): the process ends without a word
             sigkill   SIGKILL to itself: killed, as by the OOM killer
             sigstop   SIGSTOP to itself: hung (the others time out on it)
             sleep     time.sleep(seconds): a slow rank (a straggler, or a hang if long)
             slow      time.sleep(seconds + per_row x rows) at the start of EVERY step
                       from `step` on, as its forward begins (so it counts as compute
                       time): a persistent straggler (reliability/straggler.py). `rows`
                       are this rank's rows of the step, so per_row is a slow device,
                       whose delay shrinks with its share of the batch; seconds a fixed
                       delay per step, which no rebalancing can win back
             nan       this rank's gradients of the step are NaN (its losses are
                       multiplied by NaN before backward): they spread to every rank
             corrupt   this rank's batch of the step is replaced by random tokens (a
                       bad-data loss spike); the targets stay, so the loss jumps
    point    start     before the step's forward (default)
             end       after the optimizer step of that step
             save      inside the checkpoint save after that step, at the moment
                       `phase` of reliability/checkpoint.PHASES (default
                       rank_file_partial: this rank's file half written)
    attempt  the restart attempt it fires on (default 0, the first run: a restarted job
             does not fail again at the same place, or recovery would never finish)
    seconds  for sleep and slow (default 5; 0 for slow when per_row is given)
    per_row  for slow: seconds per row of this rank's step (default 0)

One rank's view: the training loop builds `Injector(faults, rank, attempt)` and calls
`injector.at(point, step)` at each point; only a fault whose rank, step, point and
attempt all match fires. nan, corrupt and slow are not events but changes to what the
step computes: `with injector.nan_loss(model, step)`, `injector.corrupt(step, x)` and
`injector.slow(step)` (called as the step's forward and backward begin).

Read next: reliability/checkpoint.py, reliability/recovery.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from minidist.reliability.checkpoint import PHASES
from minidist.train import Hook

KINDS = ("raise", "exit", "sigkill", "sigstop", "sleep", "slow", "nan", "corrupt")
POINTS = ("start", "end", "save")
ENV = "MINIDIST_INJECT"
EXIT_CODE = 3                     # what `exit` ends the process with


class InjectedFault(RuntimeError):
    """The error a `raise` fault raises."""


@dataclass(frozen=True)
class Fault:
    """One injected failure (see the module docstring)."""

    kind: str
    rank: int
    step: int
    point: str = "start"
    attempt: int = 0
    seconds: float = 5.0
    phase: str = "rank_file_partial"          # point=save: checkpoint.PHASES
    per_row: float = 0.0                      # slow: seconds per row of the step

    def __str__(self) -> str:
        extra = f":seconds={self.seconds:g}" if self.kind in ("sleep", "slow") else ""
        extra += f":per_row={self.per_row:g}" if self.per_row else ""
        extra += f":phase={self.phase}" if self.point == "save" else ""
        return (f"{self.kind}:rank={self.rank}:step={self.step}:point={self.point}"
                f":attempt={self.attempt}{extra}")


def parse(spec: str) -> Fault:
    """`kind:rank=R:step=S[:point=P][:attempt=A][:seconds=X][:per_row=Y][:phase=NAME]` ->
    Fault, or ValueError saying what is wrong with it."""
    usage = ("write kind:rank=R:step=S[:point=P][:attempt=A][:seconds=X][:per_row=Y]"
             "[:phase=NAME], e.g. sigkill:rank=1:step=5")
    kind, *fields = spec.strip().split(":")
    if kind not in KINDS:
        raise ValueError(f"--inject {spec!r}: unknown kind {kind!r}; kinds are "
                         f"{', '.join(KINDS)} ({usage})")
    values: dict[str, str] = {}
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq or key not in ("rank", "step", "point", "attempt", "seconds", "per_row",
                                 "phase") \
                or key in values:
            raise ValueError(f"--inject {spec!r}: cannot read {field!r} ({usage})")
        values[key] = value
    if "rank" not in values or "step" not in values:
        raise ValueError(f"--inject {spec!r}: rank= and step= are required ({usage})")
    if "per_row" in values and kind != "slow":
        raise ValueError(f"--inject {spec!r}: per_row is an option of slow only ({usage})")
    seconds = 0.0 if "per_row" in values else 5.0
    try:
        fault = Fault(kind, int(values["rank"]), int(values["step"]),
                      values.get("point", "start"), int(values.get("attempt", 0)),
                      float(values.get("seconds", seconds)),
                      values.get("phase", "rank_file_partial"),
                      float(values.get("per_row", 0.0)))
    except ValueError:
        raise ValueError(f"--inject {spec!r}: rank, step and attempt are integers, seconds "
                         f"and per_row numbers ({usage})") from None
    if fault.point not in POINTS or min(fault.rank, fault.step, fault.attempt) < 0 \
            or not (fault.seconds >= 0 and fault.per_row >= 0):
        raise ValueError(f"--inject {spec!r}: point is one of {', '.join(POINTS)}; rank, "
                         f"step and attempt are >= 0, seconds and per_row >= 0 ({usage})")
    if fault.phase not in PHASES:
        raise ValueError(f"--inject {spec!r}: phase is one of {', '.join(PHASES)}")
    if fault.kind in ("nan", "corrupt") and fault.point != "start":
        raise ValueError(f"--inject {spec!r}: {fault.kind} changes the step's data, so its "
                         "point is start")
    if fault.kind == "slow" and fault.point != "start":
        raise ValueError(f"--inject {spec!r}: slow delays the start of every step from "
                         f"{fault.step} on, so its point is start")
    return fault


def from_env(environ=None) -> list[Fault]:
    """The faults of $MINIDIST_INJECT (specs separated by ';'), for scripts."""
    text = (os.environ if environ is None else environ).get(ENV, "")
    return [parse(s) for s in text.split(";") if s.strip()]


def check_ranks(faults: list[Fault], world_size: int) -> None:
    """ValueError if a fault names a rank the job does not have (before launching)."""
    for f in faults:
        if f.rank >= world_size:
            raise ValueError(f"--inject {f}: rank {f.rank} does not exist in a job of "
                             f"{world_size} ranks (0..{world_size - 1})")


class Injector(Hook):
    """This rank's faults of this attempt; `at` fires them (see the module docstring). As
    a hook of train_on_rank: the start and end points of each step, corrupted input
    tokens, and a slow or NaN-poisoned forward and backward."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int = 0):
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.rank = rank
        self._poisoned: set[int] = set()         # steps a nan fault has hit (once each)

    def _matching(self, kind: str | None, point: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.step == step and f.point == point
                and (kind is None or f.kind == kind)]

    def at(self, point: str, step: int) -> None:
        """Fire every event fault (raise, exit, sigkill, sigstop, sleep) set for here."""
        for f in self._matching(None, point, step):
            if f.kind in ("nan", "corrupt", "slow"):
                continue
            sys.stdout.write(f"[rank {self.rank}] injecting {f}\n")   # one write: one line
            sys.stdout.flush()
            if f.kind == "raise":
                raise InjectedFault(f"injected fault {f}")
            if f.kind == "exit":
                os._exit(EXIT_CODE)
            if f.kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if f.kind == "sleep":
                time.sleep(f.seconds)

    def slow(self, step: int, rows: int = 0) -> None:
        """Under a `slow` fault whose step is <= `step`: sleep seconds + per_row x rows
        (saying so at its first step); `rows`: this rank's rows of the step. train.py
        calls this as the step's forward and backward begin."""
        for f in self.faults:
            if f.kind == "slow" and f.step <= step:
                if f.step == step:
                    sys.stdout.write(f"[rank {self.rank}] injecting {f}\n")
                    sys.stdout.flush()
                time.sleep(f.seconds + f.per_row * rows)

    def armed(self, point: str, step: int) -> Fault | None:
        """The fault set for `point` of `step` (e.g. a kill inside a save), or None."""
        found = self._matching(None, point, step)
        return found[0] if found else None

    @contextlib.contextmanager
    def nan_loss(self, model, step: int) -> Iterator[None]:
        """Inside: under a `nan` fault for this step, every loss this rank's model computes
        (model.loss, nn/gpt.py) is multiplied by NaN, so backward makes all of its
        gradients NaN and the gradient sync spreads them; otherwise nothing changes. Only a
        rank that computes the loss can do this (under pp, one of the last stage's). It
        hits a step once: a step computed again (spike.py's rerun) is clean, as after a
        transient hardware fault."""
        if not self._matching("nan", "start", step) or step in self._poisoned:
            yield
            return
        self._poisoned.add(step)
        loss = model.loss

        def poisoned(*args, **kwargs):
            return loss(*args, **kwargs) * float("nan")

        model.loss = poisoned                     # this instance only, for this step
        try:
            yield
        finally:
            del model.loss

    # --- the hook protocol (train.Hook) ---
    def on_step_start(self, step: int) -> None:
        self.at("start", step)

    def prepare(self, step: int, batches: list, model) -> list:
        """Random tokens instead of the batch under a `corrupt` fault."""
        return [dataclasses.replace(mb, x=self.corrupt(step, mb.x, model.cfg.vocab_size))
                for mb in batches]

    @contextlib.contextmanager
    def around_compute(self, step: int, batches: list, model) -> Iterator[None]:
        """A `slow` fault delays the forward and backward; a `nan` one poisons the loss."""
        self.slow(step, sum(len(mb.x) for mb in batches))
        with self.nan_loss(model, step):
            yield

    def on_step_end(self, end) -> None:
        self.at("end", end.step)

    def corrupt(self, step: int, x: np.ndarray, vocab_size: int) -> np.ndarray:
        """This rank's input tokens for the step: random ones under a `corrupt` fault (a
        fixed draw from (step, rank), so a rerun corrupts the same way), else x."""
        if not self._matching("corrupt", "start", step):
            return x
        rng = np.random.default_rng([step, self.rank, 0xBAD])
        return rng.integers(0, vocab_size, size=x.shape).astype(x.dtype)
