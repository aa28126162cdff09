"""Real jobs under a policy: `minidist train` processes on this machine, preempted by
checkpoint and resumed, each ending bitwise where its uninterrupted run ends.

    python -m minidist cluster simulate --real --policy las      [--slots 2 --trace T.csv]

The cluster is this machine with `slots` "GPUs" (one node). A job of g slots is
`python -m minidist train --dp g ...`: g rank processes, started together (a gang) in a
process group of their own. The driver below is the simulator's loop on a wall clock:
every `tick` it polls the processes, builds the same policies.Snapshot and applies the
same policies' Decision. A job's progress is read from its log (`step N` lines, or
`resuming from ... (step K)`): executed = steps done x step_time, in the trace's seconds,
so las's attained service (slots x executed), easy's remaining estimate and fair's usage
count work done, not process start-up or checkpoint loading (the real restore cost).

Preemption by checkpoint (reliability/checkpoint.py, recovery.py): every job checkpoints
after every step (--checkpoint-every 1, --keep 2). To preempt, the driver waits for the
job's next committed checkpoint (the save a real system would ask for), then sends
SIGTERM to the job's process group; its ranks die (the launcher also gives them
PDEATHSIG) and its slots are free once every process has exited. To resume, it runs the
same command again: `train` loads the newest complete checkpoint and continues from its
step; steps done after it (at most the one in flight) are redone. Data and dropout are
addressed by global step index, so the resumed run computes exactly the uninterrupted
one: the `params sha256:` it prints must equal that of a reference run of the same
command without checkpoints, which the driver runs afterwards to check.

One job's timeline, as the driver sees it (phase: what happens):
    waiting       (submitted, no slots)
    running       Popen(train ...), slots taken; progress read from its log each tick
    checkpointing (preempted) wait for a newer checkpoint, SIGTERM the group, wait for exit
                  (a job that ends by itself meanwhile is done, not preempted)
    waiting       slots released; `resuming from .../stepN` when started again
    done          exit code 0; its log's last `params sha256:` line is the digest

Trace: times are wall-clock seconds; a job trains round(duration / step_time) steps.
The built-in DEMO_TRACE is three tiny jobs made for 2 slots (see its comment).
Read next: cluster/cli.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from minidist.cluster import policies
from minidist.cluster.placement import Cluster, give_back, take
from minidist.cluster.scheduler import Costs, JobRecord, Result, Segment
from minidist.cluster.traces import Job
from minidist.reliability import checkpoint as ckpt

MODEL = ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--batch", "8",
         "--dtype", "float64", "--every", "1")
MAX_STEPS = 2000                  # a real job beyond this is not "tiny" (minutes of CPU)
# a: long, alone at first; b: a 2-slot gang arriving while a runs (las preempts a for it
# once a has done 50 steps, the 0.5 slot-s threshold; fifo and easy make b wait); c: short,
# 1 slot (easy backfills it next to a, fifo makes it wait behind b). b and c stay under the
# threshold (2 x 20 and 20 steps). (id, submit s, slots, duration s = steps x 10 ms, user,
# estimate s)
DEMO_TRACE = (Job("a", 0.0, 1, 1.5, "alice", 4.0), Job("b", 0.4, 2, 0.2, "bob", 1.0),
              Job("c", 0.6, 1, 0.2, "carol", 1.0))


@dataclass(frozen=True)
class RealConfig:
    """slots: "GPUs" of this machine; step_time: nominal seconds per step (steps =
    round(duration / step_time)); thresholds: las queues in slots x nominal seconds of
    progress (0.5 = 50 steps on 1 slot); tick: polling
    period; timeout: the whole schedule, seconds."""

    slots: int = 2
    step_time: float = 0.01
    thresholds: tuple[float, ...] = (0.5,)
    tick: float = 0.02
    timeout: float = 120.0


@dataclass(frozen=True)
class Outcome:
    """One real job: steps trained, preemptions, steps redone after resuming, and the
    parameter digest of the scheduled run and of its uninterrupted reference run."""

    job: str
    steps: int
    preemptions: int
    redone: int
    digest: str
    reference: str


@dataclass(eq=False)
class _Proc:
    job: Job
    steps: int
    seed: int
    folder: str                           # its checkpoints, logs, and the jobs' cwd
    phase: str = "pending"
    placement: tuple = ()
    proc: subprocess.Popen | None = None
    executed: float = 0.0
    held_since: float = 0.0
    first_start: float = float("nan")
    end: float = float("nan")
    preemptions: int = 0
    asked: tuple = ()                     # (time, checkpoint step) when preempted
    logs: list = field(default_factory=list)
    segments: list = field(default_factory=list)


def steps_of(job: Job, cfg: RealConfig) -> int:
    return max(1, round(job.duration / cfg.step_time))


def command(p: _Proc, checkpoints: bool = True) -> list[str]:
    """The `train` command line of a job, checkpointing into its folder (or not). It runs
    in that folder, so whatever else `train` writes (a run directory) lands there too."""
    argv = [sys.executable, "-m", "minidist", "train", *MODEL, "--seed", str(p.seed),
            "--steps", str(p.steps), "--dp", str(p.job.gpus)]
    if checkpoints:
        argv += ["--checkpoint-dir", os.path.join(p.folder, "ckpt"),
                 "--checkpoint-every", "1", "--keep", "2"]
    return argv


def run_real(jobs, policy: str, workdir: str, cfg: RealConfig = RealConfig()
             ) -> tuple[Result, tuple[Outcome, ...]]:
    """Run `jobs` as real processes under `policy`, then each job's reference run; return
    the schedule as a Result (segments, records; times in wall seconds) and outcomes."""
    cluster = Cluster(1, cfg.slots)
    for j in jobs:
        cluster.check_fits(j.id, j.gpus)
    procs = [_Proc(j, steps_of(j, cfg), i, os.path.join(os.path.abspath(workdir), j.id))
             for i, j in enumerate(jobs)]
    for p in procs:
        os.makedirs(p.folder)                    # fails on a folder of an earlier run
    driver = _Driver(procs, cluster, policies.make(policy, cfg.thresholds), cfg)
    try:
        driver.run()
    finally:
        driver.stop_all()
    result = Result(policy, cluster, Costs(), tuple(
        JobRecord(p.job, p.first_start, p.end, p.preemptions) for p in procs),
        tuple(sorted((s for p in procs for s in p.segments), key=lambda s: s.start)),
        tuple(driver.events))
    outcomes = tuple(Outcome(p.job.id, p.steps, p.preemptions, _redone(p.logs),
                             _digest(p.logs[-1]), _reference(p)) for p in procs)
    return result, outcomes


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _digest(path: str) -> str:
    found = re.findall(r"^params sha256: ([0-9a-f]{64})$", _read(path), re.M)
    return found[-1] if found else "none"


def _reference(p: _Proc) -> str:
    """The digest of the same job run start to end, without checkpoints."""
    done = subprocess.run(command(p, checkpoints=False), capture_output=True, text=True,
                          timeout=300, cwd=p.folder)
    found = re.findall(r"^params sha256: ([0-9a-f]{64})$", done.stdout, re.M)
    return found[-1] if done.returncode == 0 and found else f"failed (exit {done.returncode})"


def _steps_done(path: str, before: float) -> int:
    """Steps done by the job whose current segment logs to `path`: the last `step N`
    line + 1, else the step it resumed at, else what was known before."""
    text = _read(path)
    last = re.findall(r"^step +(\d+) \|", text, re.M)
    if last:
        return int(last[-1]) + 1
    back = re.search(r"^resuming from \S+ \(step (\d+)\)", text, re.M)
    return int(back.group(1)) if back else round(before)


def _redone(logs: list[str]) -> int:
    """Steps run twice: the last step a segment printed + 1 - the step the next resumed at."""
    total = 0
    for before, after in zip(logs, logs[1:]):
        last = re.findall(r"^step +(\d+) \|", _read(before), re.M)
        back = re.search(r"^resuming from \S+ \(step (\d+)\)", _read(after), re.M)
        if last and back:
            total += max(0, int(last[-1]) + 1 - int(back.group(1)))
    return total


class _Driver:
    """The wall-clock twin of scheduler._Sim: the same Snapshot -> Decision loop, with
    processes in place of simulated jobs (module docstring)."""

    def __init__(self, procs, cluster, decide, cfg):
        self.procs, self.cluster, self.decide, self.cfg = procs, cluster, decide, cfg
        self.free = [cluster.gpus_per_node]
        self.events: list[tuple[float, str, str]] = []
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        while any(p.phase != "done" for p in self.procs):
            t = self.now()
            if t > self.cfg.timeout:
                raise RuntimeError(f"real schedule: not done after {self.cfg.timeout:g} s "
                                   f"({[(p.job.id, p.phase) for p in self.procs]})")
            for p in self.procs:
                if p.phase in ("running", "checkpointing"):
                    p.executed = self.cfg.step_time * _steps_done(p.logs[-1], p.executed
                                                                  / self.cfg.step_time)
            self._poll(t)
            active = [p for p in self.procs if p.phase not in ("pending", "done")]
            tasks = tuple(policies.Task(p.job, p.phase, p.placement, p.executed)
                          for p in active)
            usage: dict[str, float] = {}
            for p in self.procs:
                usage[p.job.user] = usage.get(p.job.user, 0.0) + p.job.gpus * p.executed
            self._apply(t, self.decide(policies.Snapshot(t, self.cluster, tuple(self.free),
                                                         tasks, usage)))
            held = sum(p.job.gpus for p in self.procs if p.placement)
            if held + self.free[0] != self.cluster.gpus_per_node:
                raise RuntimeError(f"real schedule: {held} slots held + {self.free[0]} free "
                                   f"!= {self.cluster.gpus_per_node}")
            time.sleep(self.cfg.tick)

    def _poll(self, t: float) -> None:
        for p in self.procs:
            if p.phase == "pending" and p.job.submit <= t:
                p.phase = "waiting"
                self.events.append((t, "submit", p.job.id))
            elif p.phase in ("running", "checkpointing"):
                if p.phase == "checkpointing" and p.asked and self._saved_since(p, t):
                    try:
                        os.killpg(p.proc.pid, signal.SIGTERM)  # its group: launcher + ranks
                    except ProcessLookupError:                 # it has just ended
                        pass
                    p.asked = ()
                code = p.proc.poll()
                if code is None:
                    continue
                if code == 0:                 # finished, possibly before a preemption took
                    p.preemptions -= p.phase == "checkpointing"
                    p.phase, p.end = "done", t
                    self._release(p, t, "finish")
                elif p.phase == "checkpointing" and not p.asked:
                    p.phase = "waiting"
                    self._release(p, t, "released")
                else:
                    tail = _read(p.logs[-1]).strip().splitlines()[-5:]
                    raise RuntimeError(f"real job {p.job.id} failed (exit {code}):\n  "
                                       + "\n  ".join(tail))

    def _latest_step(self, p: _Proc) -> int:
        """The step of the job's newest committed checkpoint (-1: none, or being written)."""
        try:
            found = ckpt.latest(os.path.join(p.folder, "ckpt"))
        except (ckpt.CheckpointError, OSError, ValueError):   # mid-save or mid-cleanup
            return -1
        return -1 if found is None else found.step

    def _saved_since(self, p: _Proc, t: float) -> bool:
        """A checkpoint newer than the one at the preemption has committed (or 10 s went by:
        then stop it anyway, losing the steps since its last checkpoint)."""
        asked_at, step = p.asked
        return self._latest_step(p) > step or t - asked_at > 10.0

    def _release(self, p: _Proc, t: float, what: str) -> None:
        give_back(self.free, p.placement, self.cluster.gpus_per_node)
        p.segments.append(Segment(p.job.id, p.held_since, t, p.placement))
        p.placement, p.proc = (), None
        self.events.append((t, what, p.job.id))

    def _apply(self, t: float, d: policies.Decision) -> None:
        for job_id in d.preempts:
            p = next(q for q in self.procs if q.job.id == job_id)
            p.phase, p.asked = "checkpointing", (t, self._latest_step(p))
            p.preemptions += 1
            self.events.append((t, "preempt", job_id))
        for job_id, spot in d.starts:
            p = next(q for q in self.procs if q.job.id == job_id)
            take(self.free, spot)
            path = os.path.join(p.folder, f"segment{len(p.logs)}.log")
            with open(path, "w") as out:
                p.proc = subprocess.Popen(command(p), stdout=out, stderr=subprocess.STDOUT,
                                          cwd=p.folder, start_new_session=True)
            p.logs.append(path)
            p.phase, p.placement, p.held_since = "running", spot, t
            if p.first_start != p.first_start:                      # NaN: the first start
                p.first_start = t
            self.events.append((t, "resume" if p.preemptions else "start", job_id))

    def stop_all(self) -> None:
        """Stop and reap every process this driver started and is still running."""
        for p in self.procs:
            if p.proc is not None and p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.proc.wait()
