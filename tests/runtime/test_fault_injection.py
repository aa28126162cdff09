"""Fault injection, randomized but seeded: whatever goes wrong on a rank, spawn names it, fast.

A trial is (kind, point, W, seed). Every rank runs the same short program (`_program`):
mixed synchronous and async collectives on the world group and on a subgroup made with
ctx.new_group. The faulty rank, drawn from the seed, injects the fault at the point.

    kinds   raise, exit (os._exit or sys.exit, by the seed), sigkill, sigstop (a hang),
            sleep (a rank slow past the deadline); mismatches in one call: a different
            op (which one, by the seed), dtype, shape, root or reduce op; two calls in a
            different order; a missing call
    points  start      before the first call
            between    between two synchronous world calls
            asyncK     the other ranks queue K = 1..3 async world calls, then a sync one;
                       a mismatch is the K-th async call (K-1 queued before it)
            inflight   the faulty rank queues two async world calls and one of them is
                       running (published, waiting for its peers, who start only once the
                       fault is in) when the fault comes
            subgroup   a call on the subgroup (W-1 ranks in a shuffled order; W=2: both)
            final      after the last call, just before the exit barrier
The seed also draws the roots, the message size (x has 2 x group-size rows of 3 or of
2048 float64: the small-message paths and the chunked ones) and the target's algorithm.

The oracle (`_check`), against the time the faulty rank injected its fault (it writes
time.monotonic(), a system-wide clock, to a file just before):
    - spawn raises RankFailure; its text is one headline naming the rank to blame, then
      that rank's error once (at most one flight recorder, at most one traceback);
    - raise / exit / sigkill: e.rank is the faulty rank, reported within FAIL_BOUND s;
    - sigstop / sleep: e.rank and e.hung name the faulty rank alone ("rank f of W is
      hung"), at the deadline T_HANG = 1.5 s and within T_HANG + 1.5 s (a hang that is
      reported only after a second timeout, 2 T_HANG, is too late);
    - a mismatch: the blamed rank's own error is a CollectiveMismatch, within
      FAIL_BOUND s, and the blamed rank is one of the two disagreeing ranks: the faulty
      rank f itself, or a member of the target call's group whose error names f as the
      rank in the other call (every other rank makes the same calls, so any
      disagreement is between f and someone who met it);
    - nothing is left behind (the autouse fixture in conftest.py).
Runs other than the hang kinds use T_FAIL = 10 s, so that a fault noticed only through a
timeout shows up as late, not as a quick pass.

Every trial asserts its latency (the wall clock, which a loaded machine stretches), so
all trials run under -m slow only: a fixed selection (every kind at least once,
test_fault_is_named_fast) and the sweep, every kind x point once, with W rotating over 2..4
and the seed over 0..2 (96 trials); MINIDIST_FULL_SWEEP=1 runs every kind x point x W in
2..4 (288 trials). The default run keeps the control: the program with no fault, at W=2.
Reproduce one trial (its id is kind-point-W<W>-s<seed>), from the selection or the sweep:
    python -m pytest -q -m slow "tests/runtime/test_fault_injection.py::\
test_fault_is_named_fast[sigstop-async3-W4-s1]"
    python -m pytest -q -m slow "tests/runtime/test_fault_injection.py::\
test_fault_is_named_fast_sweep[sleep-final-W2-s2]"
"""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

import minidist.collectives as C
from minidist.runtime import RankFailure, call, spawn

pytestmark = pytest.mark.multiproc

FAILS = ("raise", "exit", "sigkill")
HANGS = ("sigstop", "sleep")
MISMATCHES = ("mismatch-op", "mismatch-dtype", "mismatch-shape", "mismatch-root",
              "mismatch-redop", "mismatch-order", "missing-call")
KINDS = FAILS + HANGS + MISMATCHES
POINTS = ("start", "between", "async1", "async2", "async3", "inflight", "subgroup", "final")
SUBSTITUTES = ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
               "all_to_all", "barrier", "send", "recv")     # what mismatch-op calls instead
T_HANG, T_FAIL = 1.5, 10.0         # collective_timeout for the hang kinds, for the others
FAIL_BOUND = 2.0                   # s from the fault to spawn's RankFailure (not a hang)
HANG_SLACK = 1.5                   # a hang: reported within T_HANG + this after the fault;
                                   # = T_HANG, so a report after two timeouts in a row fails
JOIN_TIMEOUT = 30.0                # a safety net: a job that never ends fails the trial


@dataclass(frozen=True)
class Step:
    """One step of the program: a collective call, or an action of the harness."""
    op: str                        # a collective, or new_group, wait, fault, mark, await_fault
    group: str = "world"           # "world" or "sub"
    mode: str = "sync"             # "sync" or "async"
    root: int = 0                  # a group rank
    redop: str = "sum"
    dtype: str = "float64"
    extra: int = 0                 # extra columns: a different shape
    algo: str = "auto"
    target: bool = False           # the call a mismatch perturbs


@dataclass(frozen=True)
class Trial:
    kind: str
    point: str
    W: int
    seed: int
    faulty: int = field(init=False)
    sub: tuple[int, ...] = field(init=False)         # the subgroup, in group-rank order

    def __post_init__(self):
        rng = self.rng("ranks")
        members = list(range(self.W))
        if self.W > 2:
            members.remove(rng.randrange(self.W))    # one rank is outside the subgroup
        rng.shuffle(members)
        faulty = rng.choice(members) if self.point == "subgroup" else rng.randrange(self.W)
        object.__setattr__(self, "sub", tuple(members))
        object.__setattr__(self, "faulty", faulty)

    def rng(self, what: str) -> random.Random:
        return random.Random(f"{self}/{what}")       # str seeds are stable across runs

    def __str__(self) -> str:
        return f"{self.kind}-{self.point}-W{self.W}-s{self.seed}"

    def describe(self) -> str:
        return (f"trial {self} (kind={self.kind!r}, point={self.point!r}, W={self.W}, "
                f"seed={self.seed}; faulty rank {self.faulty}, subgroup {list(self.sub)})")


# --- the program --------------------------------------------------------------------------

def _program(t: Trial) -> list[Step]:
    """The calls every rank makes, before the faulty rank's change; `fault` steps mark
    where a raise/exit/kill/stop/sleep goes (only the faulty rank acts on them)."""
    rng = t.rng("program")
    W, S = t.W, len(t.sub)
    k = int(t.point[-1]) if t.point.startswith("async") else 2
    target = dict(op="reduce", redop="sum", target=True,
                  algo=rng.choice(("auto", "tree", "ring")))
    here = {p: [Step("fault")] if p == t.point else [] for p in POINTS}
    return [
        *here["start"],
        Step(**target, root=rng.randrange(W)) if t.point == "start" else Step("all_gather"),
        Step("all_reduce"),
        *here["between"],
        Step(**target, root=rng.randrange(W)) if t.point == "between" else
        Step("reduce", root=rng.randrange(W)),
        Step("broadcast", root=rng.randrange(W)),
        *here[f"async{k}"],
        *[Step(op, mode="async") for op in ("all_to_all", "all_gather")[:k - 1]],
        Step(**{**target, "target": t.point.startswith("async")}, mode="async",
             root=rng.randrange(W)),
        Step("gather", root=rng.randrange(W)),
        Step("wait"),
        *([Step("await_fault")] if t.point == "inflight" else []),
        Step(**{**target, "target": t.point == "inflight"}, mode="async",
             root=rng.randrange(W)),
        Step("all_reduce", mode="async", redop="max"),
        *here["inflight"],
        Step("reduce_scatter"),
        Step("wait"),
        Step("new_group"),
        *here["subgroup"],
        Step(**{**target, "target": t.point == "subgroup"}, group="sub", root=rng.randrange(S)),
        Step("all_gather", group="sub", mode="async"),
        Step("scatter", group="sub", root=rng.randrange(S)),
        Step("wait"),
        Step("all_gather"),
        Step(**{**target, "target": t.point == "final"}, root=rng.randrange(W)),
        *here["final"],
    ]


def _steps_on(t: Trial, rank: int) -> list[Step]:
    """This rank's steps: the program, changed on the faulty rank as the kind says."""
    steps = _program(t)
    if t.kind not in KINDS:                                 # the control: no fault at all
        return [s for s in steps if s.op not in ("fault", "await_fault")]
    if rank != t.faulty or t.kind not in MISMATCHES:
        return [s for s in steps if s.op != "await_fault" or rank != t.faulty]
    steps = [s for s in steps if s.op not in ("fault", "await_fault")]
    i = next(i for i, s in enumerate(steps) if s.target)
    s, size = steps[i], (t.W if steps[i].group == "world" else len(t.sub))
    if t.kind == "mismatch-op":
        op = t.rng("substitute").choice(SUBSTITUTES)
        steps[i] = replace(s, op=op, mode="sync" if op == "recv" else s.mode)
    elif t.kind == "mismatch-dtype":
        steps[i] = replace(s, dtype="float32")
    elif t.kind == "mismatch-shape":
        steps[i] = replace(s, extra=1)
    elif t.kind == "mismatch-root":
        steps[i] = replace(s, root=(s.root + 1) % size)
    elif t.kind == "mismatch-redop":
        steps[i] = replace(s, redop="max")
    elif t.kind == "mismatch-order":      # with the next call (the last one: the previous)
        j = i + 1 if i + 1 < len(steps) else i - 1
        steps[i], steps[j] = steps[j], steps[i]
        i = min(i, j)
    else:                                 # missing-call
        del steps[i]
    steps.insert(i, Step("mark"))         # the fault's time: just before the changed call
    return steps


# --- what each rank runs ------------------------------------------------------------------

def _rank(ctx, t: Trial, fault_file: str) -> list:
    """Run this rank's steps; returns a summary of each result (the clean run checks it)."""
    groups, works, out = {"world": ctx.world}, [], []
    cols = 2048 if t.rng("size").random() < 0.5 else 3
    for s in _steps_on(t, ctx.rank):
        if s.op == "new_group":
            groups["sub"] = ctx.new_group(t.sub, name="sub")
        elif s.op == "wait":
            out += [_summary(w.wait()) for w in works]
            works = []
        elif s.op == "mark":
            _write_time(fault_file)
        elif s.op == "await_fault":
            _await_file(fault_file)
        elif s.op == "fault":
            if ctx.rank == t.faulty:
                if t.point == "inflight":
                    _await_running(ctx)
                _write_time(fault_file)
                _inject(t)
        elif groups[s.group] is not None:                # a non-member skips sub calls
            r = _collective(s, groups[s.group], ctx.rank, cols)
            if s.mode == "async" and s.op != "recv":
                works.append(r)
            else:
                out.append(_summary(r))
    return out


def _collective(s: Step, g, rank: int, cols: int):
    """Make the call step s on group g; x is (2 * group size, cols) with rank-dependent values."""
    x = (np.arange(2 * g.size * (cols + s.extra), dtype=s.dtype)
         .reshape(2 * g.size, cols + s.extra) + rank)
    kw = dict(group=g, async_op=s.mode == "async")
    if s.op in ("reduce", "all_reduce", "reduce_scatter"):
        extra = dict(root=s.root) if s.op == "reduce" else {}
        algo = s.algo if s.op == "reduce" else "auto"
        return getattr(C, s.op)(x, op=s.redop, algo=algo, **extra, **kw)
    if s.op in ("broadcast", "gather"):
        return getattr(C, s.op)(x, root=s.root, **kw)
    if s.op == "scatter":
        return C.scatter(np.stack([x] * g.size) if g.rank == s.root else None, root=s.root, **kw)
    if s.op in ("all_gather", "all_to_all"):
        return getattr(C, s.op)(x, **kw)
    if s.op == "barrier":
        return C.barrier(**kw)
    if s.op == "send":
        return C.send(x, dst=(g.rank + 1) % g.size, **kw)
    if s.op == "recv":
        return C.recv(np.empty_like(x), src=(g.rank + 1) % g.size, group=g)
    raise AssertionError(f"unknown step {s}")


def _summary(result):
    return None if result is None else float(np.sum(result))


def _inject(t: Trial) -> None:
    if t.kind == "raise":
        raise ValueError(f"injected fault, {t}")
    if t.kind == "exit":
        if t.rng("exit").random() < 0.5:
            os._exit(3)
        sys.exit(3)
    if t.kind in ("sigkill", "sigstop"):
        os.kill(os.getpid(), signal.SIGKILL if t.kind == "sigkill" else signal.SIGSTOP)
        time.sleep(5)                     # (SIGSTOP) never reached before the launcher's kill
    if t.kind == "sleep":
        time.sleep(T_HANG + 5)            # slow, past the deadline
    raise AssertionError(f"{t}: the fault did not stop the rank")


def _await_running(ctx) -> None:
    """Wait until one of this rank's queued world calls is published and running: the
    others start only after the fault, so it cannot finish (a reduce may, on a leaf of
    its tree, which only sends; the all_reduce queued behind it then runs)."""
    board, gid, deadline = ctx.job.board, ctx.world.gid, time.monotonic() + 10
    while True:
        rec = board.read_call(ctx.rank, gid)
        if rec is not None and rec[call.STATE] == call.STARTED:
            time.sleep(0.02)              # let its worker settle into the wait
            return
        if time.monotonic() > deadline:
            raise AssertionError("harness: the queued async call never started")
        time.sleep(1e-3)


def _write_time(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(path + ".tmp", path)       # readers never see a half-written file


def _await_file(path: str) -> None:
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError("harness: the faulty rank never marked its fault")
        time.sleep(1e-3)


# --- the oracle ---------------------------------------------------------------------------

def _run_trial(t: Trial, tmp_path) -> None:
    fault_file = str(tmp_path / f"fault-{t}")
    timeout = T_HANG if t.kind in HANGS else T_FAIL
    with pytest.raises(RankFailure) as info:
        spawn(t.W, _rank, t, fault_file, collective_timeout=timeout, join_timeout=JOIN_TIMEOUT)
    end = time.monotonic()
    assert os.path.exists(fault_file), \
        f"{t.describe()}: the fault was never injected; spawn raised:\n{info.value}"
    with open(fault_file) as f:
        latency = end - float(f.read())
    _check(t, info.value, latency)


def _check(t: Trial, e: RankFailure, latency: float) -> None:
    text, f, W = str(e), t.faulty, t.W
    lines = text.splitlines()
    where = (f"{t.describe()}: reported after {latency:.2f} s, e.rank={e.rank}, "
             f"e.hung={getattr(e, 'hung', None)}; report begins:\n" + "\n".join(lines[:4]))
    headlines = [ln for ln in lines if re.match(r"ranks? \[?\d", ln)]
    assert len(headlines) == 1 and headlines[0] == lines[0], f"not one headline: {where}"
    assert text.count("flight recorder (") <= 1, f"flight recorder repeated: {where}"
    assert text.count("Traceback (most recent call last)") <= 1, f"traceback repeated: {where}"
    if t.kind in HANGS:
        assert e.rank == f and e.hung == (f,), f"the hung rank is not named: {where}"
        assert text.count("flight recorder (") == 1, f"no flight recorder: {where}"
        assert re.fullmatch(rf"rank {f} of {W} is hung: rank \d+ timed out waiting for it; "
                            r"the other ranks were stopped\.", lines[0]), where
        assert lines[1].startswith("  CollectiveTimeout: "), where
        assert "killed by the launcher" in e.failures[f], where
        assert T_HANG - 0.05 <= latency < T_HANG + HANG_SLACK, f"not at the deadline: {where}"
        return
    assert latency < FAIL_BOUND, f"too slow: {where}"
    if t.kind in FAILS:
        assert e.rank == f, f"the faulty rank is not named: {where}"
        assert lines[0] == f"rank {f} of {W} failed; the other ranks were stopped.", where
        assert re.search(_FAIL_TEXT[t.kind].format(t=t), e.failures[f]), where
        return
    blamed = e.rank
    assert lines[0] == f"rank {blamed} of {W} failed; the other ranks were stopped.", where
    assert e.failures[blamed].startswith("CollectiveMismatch: "), f"not a mismatch: {where}"
    members = range(W) if _target_group(t) == "world" else t.sub
    assert blamed == f or (blamed in members and _names(e.failures[blamed], t)), \
        f"the blamed rank is not one of the two that disagree: {where}"


def _names(error: str, t: Trial) -> bool:
    """Whether the first line of an error names the faulty rank: by its global rank, or by
    its rank in a group ("rank 1 of group 'sub'")."""
    first, f = error.split("\n", 1)[0], t.faulty
    in_group = {"world": f, "sub": t.sub.index(f) if f in t.sub else None}
    return bool(re.search(rf"(?<!group )\brank {f}\b(?! of group)", first) or any(
        re.search(rf"\brank {r} of group '{name}'", first)
        for name, r in in_group.items() if r is not None))


_FAIL_TEXT = {"raise": r"^ValueError: injected fault, {t}$",
              "exit": r"^(exited with code 3 without reporting a result|SystemExit: 3)",
              "sigkill": r"^killed by SIGKILL$"}


def _target_group(t: Trial) -> str:
    return next(s.group for s in _program(t) if s.target)


# --- the trials ---------------------------------------------------------------------------

# The fixed selection, every kind at least once (slow like the sweep: see the docstring).
DEFAULT = [Trial("raise", "between", 3, 0), Trial("exit", "inflight", 4, 0),
           Trial("sigkill", "async2", 3, 1), Trial("sigstop", "async3", 4, 1),
           Trial("sleep", "subgroup", 2, 0), Trial("mismatch-op", "async1", 4, 2),
           Trial("mismatch-dtype", "subgroup", 4, 0), Trial("mismatch-shape", "final", 2, 0),
           Trial("mismatch-root", "start", 3, 0), Trial("mismatch-redop", "between", 4, 1),
           Trial("mismatch-order", "async3", 3, 0), Trial("missing-call", "final", 3, 1)]
# The sweep: every (kind, point) once, W and the seed rotating over (2, 3, 4) and (0, 1, 2):
# 96 trials, ~2 min. MINIDIST_FULL_SWEEP=1 runs each (kind, point) at every W (288, ~6 min).
_FULL = os.environ.get("MINIDIST_FULL_SWEEP") == "1"
SWEEP = [Trial(k, p, W, (i + W) % 3) for i, (k, p) in enumerate(itertools.product(KINDS, POINTS))
         for W in ((2, 3, 4) if _FULL else (2 + i % 3,))]


@pytest.mark.slow                  # wall-clock: every trial bounds its latency
@pytest.mark.parametrize("t", DEFAULT, ids=str)
def test_fault_is_named_fast(t, tmp_path):
    _run_trial(t, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("t", SWEEP, ids=str)
def test_fault_is_named_fast_sweep(t, tmp_path):
    _run_trial(t, tmp_path)


@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow),
                               pytest.param(4, marks=pytest.mark.slow)])
def test_the_program_runs_clean_without_a_fault(W):
    """The control: with no fault (kind "none") every rank finishes and the sums agree."""
    t = Trial("none", f"async{W - 1}", W, 0)
    outs = spawn(W, _rank, t, "/nonexistent", collective_timeout=T_FAIL)
    cols = 2048 if t.rng("size").random() < 0.5 else 3
    n = 2 * W * cols
    total = W * n * (n - 1) / 2 + n * W * (W - 1) / 2            # sum over ranks of x
    assert all(o[1] == total for o in outs), f"{t.describe()}: all_reduce sums {outs}"
