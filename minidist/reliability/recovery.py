"""Recovery: checkpoint a training run as it goes, and restart it from there when a rank fails.

    python -m minidist train --dp 2 --checkpoint-dir D --checkpoint-every 5 --max-restarts 3

The run is supervised by the launcher process (`supervise`): on a RankFailure (a rank
raised, died, or hung past the collective deadline, runtime/launch.py) it waits a
backoff, then starts all ranks again; they load the latest complete checkpoint
(reliability/checkpoint.py) and continue from its step. Because a checkpoint holds the
whole global state (parameters, optimizer state, step, losses) and every step's data and
dropout are addressed by the global step index (data.py, seed.py), the restarted run
computes exactly what the uninterrupted run would have: the final parameters and every
loss are bitwise equal (the run prints `params sha256: ...` to compare at a glance). The
log says what failed, the step it resumes from, and the steps lost (done since that
checkpoint, redone now).

One rank's view (`RankCheckpoints`, called by train.py at the end of every step):
    1. after step s, if (s + 1) is a multiple of `every` or s is the last step:
       params = engine.full_params(), state = engine.full_optimizer_state() (collective:
       every rank gets the global arrays), losses = all losses so far (collective);
    2. write its piece of every array and commit (checkpoint.save: two barriers on the
       world group), or, asynchronously, snapshot and let a thread write it (CheckFreq);
       rank 0 also records the step in `progress`, which the launcher reads after a failure.
The launcher's view (`supervise`): attempt k = spawn the ranks with the latest checkpoint;
on RankFailure with attempts left: log, sleep backoff * 2^k (capped), attempt k + 1.

Faults to test this with: reliability/faults.py (`--inject sigkill:rank=1:step=5`, or a
kill inside a save with point=save). An injected fault fires on one attempt only (attempt
0 by default), so the restarted run gets past it.

Cost: a checkpoint gathers the global state onto every rank (what --check does at the
end), then each rank writes 1/W of it. Recovery time: the backoff, the start of W
processes (~0.3 s here), the load (every rank reads and verifies the checkpoint), and the
steps since the checkpoint.
Reference: torchtitan's checkpoint resume, torchrun's --max-restarts; Llama 3's report of
466 interruptions in 54 days (Dubey et al. 2024, sec. 3.3.4).
Read next: reliability/faults.py
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minidist import collectives as C
from minidist.cli import at_least
from minidist.parallel.compose import group_count
from minidist.reliability import checkpoint as ckpt, confined, faults
from minidist.reliability.async_checkpoint import AsyncCheckpointer
from minidist.reliability.elastic import Elastic
from minidist.reliability.faults import Injector
from minidist.reliability.spike import Guard
from minidist.reliability.straggler import add_arguments as straggler_arguments
from minidist.runtime import RankFailure, spawn

MAX_BACKOFF = 10.0             # seconds, the longest wait between attempts


@dataclass(frozen=True)
class Policy:
    """How a run checkpoints: into `root` every `every` steps (and after the last one),
    keeping the newest `keep`; `resume` "auto" (continue from the latest complete
    checkpoint) or "never" (start afresh: the folder must hold no checkpoint);
    `asynchronous`: persist in a background thread while training goes on."""

    root: str
    every: int = 10
    keep: int = 3
    resume: str = "auto"
    asynchronous: bool = False

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1 or not isinstance(self.keep, int) \
                or self.keep < 1 or self.resume not in ("auto", "never"):
            raise ValueError(f"checkpoints: every={self.every!r} and keep={self.keep!r} must "
                             f"be ints >= 1, resume={self.resume!r} 'auto' or 'never'")

    def start(self) -> tuple[ckpt.CheckpointState | None, str]:
        """(the state to resume from, or None; a line saying what was found)."""
        found = ckpt.latest(self.root) if Path(self.root).exists() else None
        if found is None:
            return None, f"no checkpoint in {self.root}: starting at step 0"
        if self.resume == "never":
            raise ValueError(f"--resume never, but {self.root} holds a checkpoint of step "
                             f"{found.step}; give a new --checkpoint-dir or remove that one")
        skipped = "".join(f"\n  skipped: {s}" for s in found.skipped)
        return ckpt.load(found.path), f"resuming from {found.path} (step {found.step}){skipped}"


class Progress:
    """The last step rank 0 finished, in memory shared with the launcher (made before the
    ranks are forked), so a failure report can say which steps were lost."""

    def __init__(self):
        self._buf = mmap.mmap(-1, 8)
        self.cell = np.frombuffer(self._buf, np.int64, 1)
        self.cell[0] = -1

    @property
    def step(self) -> int:
        return int(self.cell[0])


class RankCheckpoints:
    """One rank's checkpointing during a run (see the module docstring); `on_step_end` is
    train.py's hook, `close` finishes (and, async, commits) the last checkpoint."""

    def __init__(self, policy: Policy, ctx, last_step: int, prior_losses: list[float],
                 extra: dict, barrier: Callable[[], Any], progress: Progress | None = None,
                 injector=None, data_offset: int = 0, token: str | None = None,
                 hooks: dict[str, Any] | None = None):
        self.policy, self.last_step, self.prior = policy, last_step, list(prior_losses)
        self.data_offset, self.hooks = data_offset, dict(hooks or {})
        self.extra, self.progress, self.injector = extra, progress, injector
        self.rank, self.world, self.barrier = ctx.rank, ctx.world_size, barrier
        if token is None and self.world > 1:
            raise ValueError(f"RankCheckpoints: {self.world} writers need token=, one random "
                             f"string drawn once for all of them (confined.token(), in the "
                             f"launcher), or their saves would not meet in one directory")
        self.token = token or confined.token()
        self.writer = AsyncCheckpointer(policy.root, rank=self.rank, world=self.world,
                                             barrier=barrier, keep=policy.keep,
                                             token=self.token) \
            if policy.asynchronous else None

    def on_step_end(self, end) -> None:
        """After step `end.step` (train.StepEnd): save if this step is due."""
        if self.progress is not None and self.rank == 0:
            self.progress.cell[0] = end.step
        s = end.step + 1                                   # steps done
        if s % self.policy.every and end.step != self.last_step:
            return
        state = ckpt.CheckpointState(
            step=s, params=end.engine.full_params(), optimizer=end.engine.full_optimizer_state(),
            rng={"dropout": "stateless: drawn from (seed, step, sample index)"},
            data_cursor={"next_step": s, "offset": self.data_offset},
            losses=self.prior + list(end.losses()),
            extra={**self.extra, "hooks": {name: hook.state_dict()
                                           for name, hook in self.hooks.items()},
                   **({} if end.routing_bias is None else {"routing_bias": {
                       name: [float(v) for v in b] for name, b in end.routing_bias.items()}})})
        if self.writer is not None:
            self.writer.snapshot(state, owned=True)     # the engine's arrays are copies
        else:
            ckpt.save(state, self.policy.root, rank=self.rank, world=self.world,
                      barrier=self.barrier, keep=self.policy.keep, on_phase=self._phase(s),
                      token=self.token)

    def _phase(self, steps_done: int) -> Callable[[str], None] | None:
        """The hook that fires a fault injected into this save (point=save)."""
        fault = None if self.injector is None else self.injector.armed("save", steps_done - 1)
        if fault is None:
            return None
        return lambda name: self.injector.at("save", steps_done - 1) \
            if name == fault.phase else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def supervise(attempt: Callable[[int], Any], *, max_restarts: int, policy: Policy | None,
              progress: Progress | None = None, backoff: float = 0.5,
              log: Callable[[str], None] = print, elastic=None,
              on_failure: Callable[[Any, int], str] | None = None) -> Any:
    """Run attempt(0); on RankFailure, log it and run attempt(k) again (k = 1, 2, ...), up
    to max_restarts times, after backoff * 2^(k-1) s (capped at MAX_BACKOFF). Returns
    what the successful attempt returns; the last RankFailure if none succeeds. With an
    `elastic` (reliability/elastic.py) a failure may shrink the next attempt's layout,
    and an attempt that stopped early (capacity returns) is followed by a grown one.
    on_failure(error, resume step) may change the next attempt; it returns a log line."""
    k = 0
    while True:
        try:
            result = attempt(k)
        except RankFailure as e:
            lines = str(e).splitlines()        # the headline, then the failed rank's cause
            headline = lines[0] + (f" ({lines[1].strip()})" if len(lines) > 1 else "")
            if k == max_restarts:
                if max_restarts:                 # else no restart was asked for: the
                    log(f"recovery: attempt {k} failed ({headline}); no restarts left "
                        f"(--max-restarts {max_restarts})")     # report says it all
                raise
            if any(t.startswith(ckpt.CheckpointStorageError.__name__)
                   for t in e.failures.values()):
                log(f"recovery: attempt {k} failed on its storage, which a restart cannot "
                    f"fix: not restarting")
                raise
            found = None if policy is None else ckpt.latest(policy.root)
            resume = 0 if found is None else found.step
            done = None if progress is None else progress.step + 1
            lost = "" if done is None or done <= resume else \
                f"; steps {resume}..{done - 1} are lost and run again"
            wait = min(MAX_BACKOFF, backoff * 2 ** k)
            origin = "step 0 (no checkpoint yet)" if found is None else \
                f"{found.path} (step {resume})"
            log(f"recovery: attempt {k} failed: {headline}\n"
                f"recovery: restarting all ranks in {wait:g} s from {origin}{lost} "
                f"[restart {k + 1} of at most {max_restarts}]"
                + "".join("\n" + line for line in
                          ([] if on_failure is None else [on_failure(e, resume)]) if line))
            time.sleep(wait)
            k += 1
            continue
        if elastic is None or elastic.stop == elastic.steps:
            return result
        log(elastic.grow())                 # a planned stop, not a failure: no restart used


# --- the train command's side (train.py calls these) -----------------------------------

def add_arguments(ap) -> None:
    """The reliability options of `python -m minidist train`."""
    ap.add_argument("--checkpoint-dir", default=None, metavar="D",
                    help="checkpoint into D and resume from its latest complete checkpoint")
    ap.add_argument("--checkpoint-every", type=at_least(1), default=10, metavar="N",
                    help="steps between checkpoints (and one after the last step)")
    ap.add_argument("--keep", type=at_least(1), default=3, help="checkpoints kept (newest)")
    ap.add_argument("--resume", default="auto", choices=["auto", "never"],
                    help="auto: continue from D's latest checkpoint; never: D must be empty")
    ap.add_argument("--async-checkpoint", action="store_true",
                    help="persist checkpoints in a background thread (CheckFreq)")
    ap.add_argument("--max-restarts", type=at_least(0), default=0,
                    help="restart all ranks from the latest checkpoint after a failure")
    ap.add_argument("--elastic", action="store_true",
                    help="after a failure, go on with one data-parallel replica less "
                         "(reliability/elastic.py)")
    ap.add_argument("--rejoin-after", type=at_least(1), default=None, metavar="N",
                    help="--elastic: the lost replica comes back after N steps")
    ap.add_argument("--spike", default="off", choices=["off", "detect", "skip", "rollback",
                                                       "rerun"],
                    help="loss-spike handling (reliability/spike.py)")
    ap.add_argument("--spike-skip-batches", type=at_least(0), default=5, metavar="N",
                    help="--spike rollback: batches skipped after rolling back")
    straggler_arguments(ap)                       # --straggler off|detect|rebalance
    ap.add_argument("--inject", action="append", default=[], metavar="SPEC",
                    help="inject a fault, kind:rank=R:step=S[:point=P]... "
                         "(reliability/faults.py; also $MINIDIST_INJECT)")


@dataclass(frozen=True)
class Resilience:
    """A run's reliability options: checkpoint policy (or None), faults to inject,
    restarts allowed, and the launcher's view of rank 0's progress."""

    policy: Policy | None
    faults: tuple
    max_restarts: int
    progress: Progress
    elastic: bool = False
    rejoin_after: int | None = None
    spike: str = "off"
    skip_batches: int = 5

    @property
    def active(self) -> bool:
        return self.policy is not None or bool(self.faults) or self.max_restarts > 0 \
            or self.elastic or self.spike != "off"


def options(a, world_size: int, pp: int = 1) -> Resilience:
    """The options (and $MINIDIST_INJECT) as a Resilience; ValueError for options that
    make no run: a fault that can never fire is one."""
    injected = [faults.parse(s) for s in a.inject] + faults.from_env()
    faults.check_ranks(injected, world_size)
    last_stage = range(world_size - world_size // pp, world_size)  # pp is the outer axis
    for f in injected:
        if f.kind == "nan" and f.rank not in last_stage:
            raise ValueError(f"--inject {f}: only the last pipeline stage's ranks "
                             f"({last_stage.start}..{world_size - 1}) compute a loss")
    if a.max_restarts < 0:
        raise ValueError(f"--max-restarts {a.max_restarts}: must be >= 0")
    policy = None if a.checkpoint_dir is None else Policy(
        a.checkpoint_dir, a.checkpoint_every, a.keep, a.resume, a.async_checkpoint)
    if policy is not None:
        check_root(policy.root)
    if getattr(a, "precision", "fp32") != "fp32" and (a.max_restarts > 0 or a.elastic):
        raise ValueError(f"--precision {a.precision} with --max-restarts or --elastic: "
                         f"resuming under mixed precision is not built (a checkpoint holds "
                         f"the rounded model copy, not the fp32 master weights and the loss "
                         f"scale); train with --precision fp32 to restart from checkpoints")
    for f in injected:
        if f.step >= a.steps:
            raise ValueError(f"--inject {f}: step {f.step} is not run (--steps {a.steps})")
        saves = policy is not None and ((f.step + 1) % policy.every == 0
                                        or f.step == a.steps - 1)
        if f.point == "save" and not saves:
            raise ValueError(f"--inject {f}: no checkpoint is saved after step {f.step} "
                             "(--checkpoint-dir, --checkpoint-every)")
        if f.point == "save" and policy.asynchronous:
            raise ValueError(f"--inject {f}: faults inside a save fire in the synchronous "
                             "save's phases; --async-checkpoint writes in a background thread "
                             "where they would never fire. Drop one of the two")
    if (a.elastic or a.rejoin_after is not None) and (policy is None or a.max_restarts < 1
                                                      or not a.elastic):
        raise ValueError("--elastic (and --rejoin-after) continue from a checkpoint after a "
                         "failure: give --elastic with --checkpoint-dir and --max-restarts >= 1")
    if a.spike == "rollback" and (policy is None or a.max_restarts < 1
                                  or a.spike_skip_batches < 0):
        raise ValueError("--spike rollback restarts from a checkpoint: give --checkpoint-dir, "
                         "--max-restarts >= 1 and --spike-skip-batches >= 0")
    return Resilience(policy, tuple(injected), a.max_restarts, Progress(), a.elastic,
                      a.rejoin_after, a.spike, a.spike_skip_batches)


def check_root(root: str) -> None:
    """Refuse, before any rank starts, a --checkpoint-dir no save could write into: a file,
    a path that cannot be made, a directory this user cannot write (ValueError, one line).
    Makes the directory if it is missing, as the first save would."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--checkpoint-dir {root}: is a file, not a directory; give a "
                         f"directory (it is made if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--checkpoint-dir {root}: cannot make that directory "
                         f"({e.strerror}); give a path this user can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--checkpoint-dir {root}: this user cannot write into it; fix its "
                         f"permissions or give another directory")


def run_config(a, cfg, data_cfg) -> dict:
    """What a checkpoint must agree on to be resumed by this run (the Plan may differ):
    every field of the model and data configs, and the options that change the numbers."""
    return {**{f"model.{k}": v for k, v in asdict(cfg).items()},
            **{f"data.{k}": v for k, v in asdict(data_cfg).items()},
            "seed": a.seed, "batch": a.batch, "lr": a.lr, "optimizer": a.optimizer,
            "steps": a.steps}


def differences(saved: Any, mine: dict) -> str:
    """The fields in which a checkpoint's run config differs from this run's, one line:
    `lr 0.003 (checkpoint) vs 0.01 (this run)`, at most 4 named."""
    if not isinstance(saved, dict):
        return "it records no run configuration of this minidist"
    diff = [k for k in sorted(set(saved) | set(mine)) if saved.get(k, "") != mine.get(k, "")]
    named = [f"{k} {saved.get(k, '(absent)')!r} vs {mine.get(k, '(absent)')!r}"
             for k in diff[:4]]
    more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
    return "; ".join(named) + more + " (the checkpoint's vs this run's)"


def run(a, cfg, data_cfg, plan, r: Resilience, rank_main: Callable):
    """Spawn `rank_main(ctx, a, cfg, data_cfg, plan, t0, job)` on every rank, restarting
    them from the latest checkpoint after a failure (`supervise`); the RankResult's
    losses cover the whole run, the steps before the checkpoint included."""
    config, t0 = run_config(a, cfg, data_cfg), time.perf_counter()
    elastic = Elastic(plan, cfg, a.batch, data_cfg.block_size, a.steps, r.rejoin_after) \
        if r.elastic else None
    floor = [0]                    # the data offset after the last spike rollback

    def on_failure(e, resume: int) -> str:
        if r.spike == "rollback" and any(t.startswith("SpikeDetected")
                                         for t in e.failures.values()):
            found = None if r.policy is None else ckpt.latest(r.policy.root)
            before = 0 if found is None else ckpt.load(found.path).data_cursor.get("offset", 0)
            floor[0] = max(floor[0], before) + r.skip_batches
            return (f"spike: rolled back to step {resume}; skipping {r.skip_batches} batches: "
                    f"step s now trains on batch s + {floor[0]}")
        return "" if elastic is None else elastic.shrink(resume)

    def attempt(k: int):
        layout, stop = (plan, a.steps) if elastic is None else (elastic.plan, elastic.stop)
        state, note = (None, "") if r.policy is None else r.policy.start()
        if state is not None and getattr(a, "precision", "fp32") != "fp32":
            raise ValueError(f"--checkpoint-dir {r.policy.root} holds a checkpoint of step "
                             f"{state.step}, and resuming under --precision {a.precision} is "
                             f"not built (it holds no fp32 master weights); give a new "
                             f"--checkpoint-dir or train with --precision fp32")
        if state is not None and state.extra.get("run") != config:
            raise ValueError(f"--checkpoint-dir {r.policy.root} holds a checkpoint of another "
                             f"run: {differences(state.extra.get('run'), config)}. Give a new "
                             "--checkpoint-dir, or the options of that run")
        if note:
            print(note, flush=True)
        offset = max(floor[0], 0 if state is None else state.data_cursor.get("offset", 0))
        token = confined.token()             # this attempt's saves' temporary names
        result = spawn(layout.world_size, rank_main, a, cfg, data_cfg, layout, t0,
                       (state, k, r, config, stop, offset, token),
                       groups=group_count(layout, cfg), nodes=getattr(a, "nodes", None))[0]
        prior = [] if state is None else list(state.losses)[:state.step]
        return replace(result, losses=tuple(prior) + result.losses)

    return supervise(attempt, max_restarts=r.max_restarts, policy=r.policy,
                     progress=r.progress, log=lambda line: print(line, flush=True),
                     elastic=elastic, on_failure=on_failure)


def on_rank(ctx, a, plan, job: tuple,
            hooks: dict[str, Any] | None = None) -> tuple[dict, "RankCheckpoints | None"]:
    """A rank's side of `run`: (what this attempt runs -- train.RunConfig's start_step,
    steps, total_steps and data_offset, and train_on_rank's initial_state, injector (a
    hook) and guard --, this rank's RankCheckpoints or None). `hooks`: the run's other stateful hooks by name (the
    straggler handler), each with state_dict() and load_state_dict(); the spike guard
    joins them. Their state goes into every checkpoint and comes back from the one this
    attempt resumes, so a resumed run equals the uninterrupted one with every option."""
    state, attempt, r, config, stop, offset, token = job
    start = 0 if state is None else state.step
    injector = Injector(list(r.faults), ctx.rank, attempt) if r.faults else None
    guard = None if r.spike == "off" else Guard(
        r.spike, lambda line: print(line, flush=True) if ctx.rank == 0 else None)
    hooks = {name: h for name, h in {**(hooks or {}), "spike": guard}.items() if h is not None}
    saved = {} if state is None else state.extra.get("hooks", {})
    for name, hook in hooks.items():
        if name in saved:
            hook.load_state_dict(saved[name])
    saver = None if r.policy is None else RankCheckpoints(
        r.policy, ctx, stop - 1, [] if state is None else list(state.losses)[:start],
        {"run": config, "plan": plan.describe()}, lambda: C.barrier(group=ctx.world),
        r.progress, injector, offset, token, hooks)
    return {"start_step": start, "steps": max(0, stop - start), "total_steps": a.steps,
            "initial_state": None if state is None else (
                state.params, state.optimizer,
                *([state.extra["routing_bias"]] if "routing_bias" in state.extra else [])),
            "injector": injector, "guard": guard, "data_offset": offset}, saver
