"""The per-rank training loop: baseline.py's loop, with a Plan saying how work is split.

`train_on_rank(ctx, ...)` runs on every rank (spawn it). It is baseline.train_single_process
with these changes, and nothing else may differ:
    1. parallel/compose.py builds the layout of the Plan: one DeviceMesh (pp x dp x cp x
       tp), this rank's shard of the model (its pipeline stage's layers; tp; attention over
       cp) and its gradient-sync engine (over dp x cp: DDP or ZeRO);
    2. this rank reads only the rows of its dp coordinate (under context parallelism only
       its positions of them), cut into plan.micro_batches micro-batches
       (parallel/micro_batching.py); the loss is still divided by the token count of the
       WHOLE global batch, so local losses and gradients simply add up across ranks;
    3. the step schedule runs forward and backward: gradient accumulation, or under pp > 1
       this stage's actions of the pipeline schedule (parallel/pipeline/stage.py); the engine
       owns the gradient communication and the optimizer;
    4. the loss of a step is the sum over dp x cp ranks of their micro-batch losses (the
       last pipeline stage's: the others add 0), all-reduced once after the loop (so the
       per-step byte counts hold training traffic).

One rank's view of step s (dp rank d of dp, cp rank c, tp rank t, M micro-batches):
    1. batches, n = micro_batching.micro_batches(data, s, B, dp, d, M, seed, my positions)
    2. (check mode) micro_batching.check_token_count: n is the global count of targets
    3. loss_s = micro_batching.grad_accumulation(engine, batches, n)   (pp > 1: stage.step)
    4. engine.step(lr_s, clip_grad): wait, clip by the GLOBAL norm, update; returns the norm
Shapes: x, y (B/(dp M), T/cp) per micro-batch, the same on every tp rank.
Result (RankResult): losses (global), grad_norms, lrs, full params and optimizer state
(gathered over dp under ZeRO and over tp), bytes sent/received per step (group.stats deltas
around the step: "sent", "recv" over all axes; bytes_by_axis: sent per axis, "dp" being
the gradient sync over dp x cp, "pp" the pipeline's activations and gradients, "embed" the
tied wte's all-reduce, "ep" the MoE tokens' all-to-alls, "edp" the experts' gradient sync), pipeline (pp > 1: this stage's timeline per step, as (kind,
micro-batch, chunk, start, end) in perf_counter seconds, and its peak held activations),
memory
(engine.memory()) and timing per step in seconds: "compute" (forward + backward, less
engine.compute_wait_s: what ZeRO-2/3 wait for inside them), "comm_wait" (engine.comm_wait_s,
what step() waited for communication, plus engine.compute_wait_s), "step" (wall
time of the whole step) and "cpu" (this process's CPU time in the step, all threads).

The loop (train_on_rank) is baseline.py's: for each step, read the batches, forward and
backward (ParallelStep.compute), update (ParallelStep.update), record (Meter). The run's
features attach to it as hooks, objects with these methods (class Hook; the loop calls
each on every rank, in the order the hooks are listed):
    on_step_start(step)                     before the step's batches are read
    prepare(step, batches, model) -> batches   the micro-batches, changed or not
    around_compute(step, batches, model)    a context manager around forward + backward
    on_step_end(end: StepEnd)               after the update, with what the step cost
    state_dict() / load_state_dict(state)   what a checkpoint keeps of the feature
Hooks: the fault injector (reliability/faults.py), the straggler handler (straggler.py),
the run directory's observer (observe/run_dir.py), on_step and on_step_end callbacks
(progress lines, checkpoints: reliability/recovery.py). Not hooks, because they change the
step itself: the spike guard (reliability/spike.py), which decides the update, and the
deterministic mode (deterministic/step.py), which computes the gradient grain by grain.

train_on_rank's arguments: those of baseline.train_single_process (grad_accum is
plan.micro_batches; for a dense model the same result up to the order of additions), and
    on_step(step, global loss)   after each step, on every rank; one more 8-byte
                                 all-reduce per step (not counted in bytes_per_step)
    start_step, initial_state, total_steps   resume: initial_state = (params, optimizer
                                 state) in the global layout (any Plan's) is loaded, and the
                                 steps run are start_step .. start_step + steps - 1; data,
                                 dropout and the lr schedule follow the global step index;
                                 total_steps: the whole run's length (cosine decay)
    injector, straggler, observer, on_step_end   the hooks above
    guard, data_offset           loss-spike handling; step s trains on the global batch
                                 s + data_offset (batches skipped after a rollback)
    device_memory, memory_ledger the steps run under memory/ledger.py's Ledger (a per-rank
                                 budget in bytes or "64MB", or none); RankResult.memory
                                 ["ledger"] is its summary()
    deterministic, grain, token_tiles   bitwise train_single_process(deterministic=True,
                                 grain=..., token_tiles=...): each micro-batch is one grain
                                 of `grain` rows, whatever plan.micro_batches says

CLI: `python -m minidist train --pp 2 --dp 2 --cp 2 --tp 2 [--sp] [--zero 1] [--schedule
1f1b] [--check]` (train_cli.py).
Read next: parallel/compose.py, parallel/micro_batching.py, parallel/sharding.py.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from minidist import collectives as C
from minidist import optim
from minidist.data import DataConfig, SyntheticData, check_compatible
from minidist.deterministic import step as determinism
from minidist.deterministic.expert import ExpertGrains
from minidist.deterministic.layout import determinize_layout
from minidist.memory.ledger import Ledger
from minidist.nn import GPTConfig
from minidist.parallel import micro_batching
from minidist.parallel import placement
from minidist.parallel.compose import Plan, build
from minidist.runtime.errors import rank_prefix

__all__ = ["Plan", "RankResult", "StepEnd", "train_on_rank"]


@dataclass(frozen=True)
class RankResult:
    """What one rank returns; losses, norms, params and state comparable to baseline.py."""

    losses: tuple[float, ...]                       # global-batch loss per step
    grad_norms: tuple[float, ...]                   # global grad norm before clipping
    lrs: tuple[float, ...]
    params: dict[str, np.ndarray]                   # full values (gathered over dp and tp)
    optimizer_state: dict                           # baseline's state_dict() layout
    bytes_per_step: tuple[dict[str, int], ...]      # {"sent": B, "recv": B}, both axes
    bytes_by_axis: tuple[dict[str, int], ...]       # {"dp": sent B, "tp": sent B}
    memory: dict                # engine.memory() after the last step; "ledger": memory/ledger.py
    timing: dict[str, tuple[float, ...]]            # "compute", "comm_wait", "step", "cpu"
    pipeline: dict | None = None                    # pp > 1: "timeline", "held_peak", ...
    moe: tuple[dict[str, dict], ...] = ()           # per step: {layer: routing stats}


@dataclass(frozen=True)
class StepEnd:
    """What the hooks see after step `step`'s update. losses() and loss() are COLLECTIVE
    (every rank calls them, or none): the global losses of the steps this call of
    train_on_rank ran so far, and of this step (computed once); the engine's
    full_params() and full_optimizer_state() are collective too."""

    step: int
    engine: object
    losses: Callable[[], tuple[float, ...]]
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)   # this step: step, comm wait, compute
    memory: int = 0              # bytes: the ledger's peak of this step, else the model state
    loss: Callable[[], float] = lambda: float("nan")
    grad_norm: float = float("nan")
    lr: float = float("nan")
    timing: dict | None = None                # seconds: compute, comm_wait, step, cpu
    bytes: dict | None = None                 # sent and received this step, all groups
    bytes_by_axis: dict | None = None         # sent this step, per group
    span: tuple[float, float] | None = None   # perf_counter at the step's start and end
    timeline: list | None = None              # pp > 1: this stage's actions
    dp_rank: int = 0


class Hook:
    """A feature of the run attached to the training step (the protocol of the module
    docstring). Each method does nothing here; a feature overrides those it needs."""

    def on_step_start(self, step: int) -> None:
        """Before the step's batches are read."""

    def prepare(self, step: int, batches: list, model) -> list:
        """The step's micro-batches, changed or not (before forward)."""
        return batches

    def around_compute(self, step: int, batches: list, model):
        """A context manager around the step's forward and backward."""
        return contextlib.nullcontext()

    def on_step_end(self, end: StepEnd) -> None:
        """After the update."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this feature (reliability/recovery.py)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict returned."""


class OnStep(Hook):
    """on_step(step, global loss) after every step: COLLECTIVE (the loss's all-reduce)."""

    def __init__(self, fn: Callable[[int, float], None]) -> None:
        self.fn = fn

    def on_step_end(self, end: StepEnd) -> None:
        self.fn(end.step, end.loss())


class OnStepEnd(Hook):
    """on_step_end(StepEnd) after every step (checkpoints: reliability/recovery.py)."""

    def __init__(self, fn: Callable[[StepEnd], None]) -> None:
        self.fn = fn

    def on_step_end(self, end: StepEnd) -> None:
        self.fn(end)


def _traffic(groups: dict[str, object]) -> dict[str, int]:
    """{"sent", "recv"} over all groups, and "sent.<axis>" per group, so far."""
    out = {"sent": 0, "recv": 0}
    for axis, g in groups.items():
        out["sent"] += g.stats["bytes_sent"]
        out["recv"] += g.stats["bytes_recv"]
        out[f"sent.{axis}"] = g.stats["bytes_sent"]
    return out


def train_on_rank(ctx, model_cfg: GPTConfig, data_cfg: DataConfig, plan: Plan, *,
                  steps: int, global_batch: int, lr: float, seed: int = 0,
                  optimizer: str = "adamw", weight_decay: float = 0.0,
                  betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.0,
                  clip_grad: float | None = None, warmup_steps: int = 0,
                  lr_schedule: str = "constant", min_lr: float = 0.0,
                  on_step: Callable[[int, float], None] | None = None,
                  start_step: int = 0, initial_state: tuple[dict, dict] | None = None,
                  total_steps: int | None = None, injector=None, guard=None,
                  data_offset: int = 0,
                  on_step_end: Callable[["StepEnd"], None] | None = None,
                  straggler=None, observer=None,
                  device_memory: int | str | None = None,
                  memory_ledger: bool = False, deterministic: bool = False,
                  grain: int = 1, token_tiles: int | None = None) -> RankResult:
    """Train GPT(model_cfg, seed) on this rank's share of `steps` global batches: the loop
    of baseline.train_single_process around this rank's ParallelStep, with the run's
    features attached as hooks (module docstring: the arguments, the hook protocol)."""
    total_steps = _check_steps(steps, start_step, total_steps, lr_schedule)
    check_compatible(model_cfg, data_cfg)
    plan.validate(model_cfg, global_batch, data_cfg.block_size)
    if deterministic:                  # a grain per micro-batch: the grain decides, not M
        determinism.check(plan, model_cfg, guard, straggler, grain, global_batch, token_tiles)
        plan = replace(plan, micro_batches=global_batch // (plan.dp * grain))
    placement.set_checking(plan.checks)
    lay = build(ctx, plan, model_cfg, seed, optimizer=optimizer, lr=lr,
                weight_decay=weight_decay, betas=betas, momentum=momentum)
    if initial_state is not None:
        lay.engine.load_full_state(*initial_state)
    run = ParallelStep(lay, model_cfg, global_batch, clip_grad, guard,
                       (grain, token_tiles) if deterministic else None)
    meter = Meter(ctx, lay, plan, device_memory, memory_ledger)
    hooks = [h for h in (straggler, OnStep(on_step) if on_step else None, observer,
                         injector, OnStepEnd(on_step_end) if on_step_end else None) if h]
    data, dp_rank = SyntheticData(data_cfg), lay.dp_group.rank
    positions = None if lay.context is None else lay.context.positions(data_cfg.block_size)
    for step in range(start_step, start_step + steps):
        for h in hooks:
            h.on_step_start(step)
        lr_s = lr if lr_schedule == "constant" else optim.lr_at(
            step, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
        rows = None if straggler is None else straggler.rows        # uneven under rebalance
        first, mine = determinism.my_rows(rows, global_batch, plan.dp, dp_rank)
        batches, n_tokens = micro_batching.micro_batches(
            data, step + data_offset, global_batch, plan.dp, dp_rank,
            mine // grain if deterministic else plan.micro_batches, seed, positions,
            **({} if rows is None else {"rows": rows}))
        for h in hooks:
            batches = h.prepare(step, batches, lay.model)
        if plan.checks:
            micro_batching.check_token_count(batches, n_tokens, lay.grad_group)

        def compute(step=step, batches=batches, n_tokens=n_tokens, first=first, lr_s=lr_s):
            """Forward and backward of this step's micro-batches: the local loss."""
            with contextlib.ExitStack() as around:
                for h in hooks:
                    around.enter_context(h.around_compute(step, batches, lay.model))
                return run.compute(batches, n_tokens, first // grain, lr_s)

        loss = meter.compute(compute)          # timed, under the memory ledger if any
        norm = run.update(step, lr_s, loss, compute, meter.global_loss)
        end = meter.end(step, lr_s, norm, run.timeline, dp_rank)
        for h in hooks:
            h.on_step_end(end)
    return meter.result(run.timelines)


def _check_steps(steps, start_step, total_steps, lr_schedule: str) -> int:
    """ValueError unless the step counts and schedule make a run; total_steps (default
    start_step + steps)."""
    if not isinstance(steps, int) or steps < 0 or lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"train_on_rank: steps={steps!r} must be an int >= 0 and "
                         f"lr_schedule={lr_schedule!r} 'constant' or 'cosine'.")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"train_on_rank: start_step={start_step!r} must be an int >= 0 (the "
                         "global index of the first step to run).")
    total_steps = start_step + steps if total_steps is None else total_steps
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) \
            or total_steps < start_step + steps:
        raise ValueError(f"train_on_rank: total_steps={total_steps!r} must be an int >= "
                         f"start_step + steps = {start_step + steps}.")
    return total_steps


class ParallelStep:
    """This rank's part of one training step: forward and backward of its micro-batches
    (gradient accumulation, or its pipeline stage's actions), then the update (the
    engine's step; the spike guard's, which may skip or redo it). Under the deterministic
    mode (deterministic/step.py) the grain sum does both at once, in compute."""

    def __init__(self, lay, model_cfg: GPTConfig, global_batch: int, clip_grad, guard,
                 deterministic: tuple[int, int | None] | None) -> None:
        self.lay, self.clip_grad, self.guard = lay, clip_grad, guard
        self.stage, self.timeline, self.timelines = lay.pipeline, None, []
        self.deterministic, self.norm = deterministic is not None, None
        if self.deterministic:                 # the layers' twins, the experts' grains
            grain, token_tiles = deterministic
            determinize_layout(lay.model, token_tiles)
            self.named = list(lay.model.named_parameters())
            self.experts = None if lay.ep_group is None else \
                ExpertGrains(lay.model, lay.ep_group, lay.expert_group)
            self.leaves, self.order = global_batch // grain, determinism.param_order(model_cfg)

    def compute(self, batches: list, n_tokens: int, first: int, lr: float) -> float:
        """Forward and backward of `batches` (the first is grain `first` of the global
        batch, for the deterministic mode): the local loss."""
        lay, engine, stage = self.lay, self.lay.engine, self.stage
        if self.deterministic:
            if stage is None:
                loss, self.norm = determinism.step(
                    engine, self.named, batches, first, self.leaves, n_tokens, lay.dp_group,
                    lr, self.clip_grad, lay.tp_group, self.experts, self.order,
                    lay.grad_group)
            else:
                loss, self.norm = determinism.pipeline_step(
                    engine, stage, batches, first, self.leaves, n_tokens, lay.dp_group,
                    lay.pp_group, self.order, lr, self.clip_grad, lay.tp_group,
                    lay.grad_group, self.experts)
        elif stage is None:
            return micro_batching.grad_accumulation(engine, batches, n_tokens)
        else:
            loss = stage.step(engine, batches, n_tokens)
        if stage is not None:                  # this step's actions: (kind, m, chunk, t0, t1)
            self.timeline = [(a.kind, a.micro_batch, a.chunk, t0, t1)
                             for a, t0, t1 in stage.record]
            self.timelines.append(self.timeline)
        return loss

    def update(self, step: int, lr: float, loss: float, compute: Callable[[], float],
               global_loss: Callable[[float], float]) -> float:
        """The optimizer step after compute; returns the gradient norm. guard (reliability/
        spike.py) sees the global loss and may skip the update or run compute again."""
        if self.deterministic:                 # the update ran inside compute()
            return float(self.norm)
        if self.guard is None:
            return float(self.lay.engine.step(lr, self.clip_grad))

        def again() -> float:
            return global_loss(compute(), replace_last=True)
        return float(self.guard.step(step, self.lay.engine, lr, self.clip_grad,
                                     global_loss(loss), again)[0])


class Meter:
    """What a step costs and what it gave, for the hooks (StepEnd) and the RankResult:
    local losses, norms, lrs, bytes per group (group.stats deltas), times, the memory peak
    (memory/ledger.py's Ledger under a budget or when asked, else the engine's model
    state) and each MoE layer's routing."""

    def __init__(self, ctx, lay, plan: Plan, device_memory, memory_ledger: bool) -> None:
        self.lay, self.engine, self.grad = lay, lay.engine, lay.grad_group
        self.algo = "direct" if getattr(self.grad, "supports_shared", False) else "auto"
        self.groups = {"dp": self.grad}            # the gradient sync: dp (x cp)
        if lay.mesh is not None:
            self.groups.update({"tp": lay.tp_group,
                                **({"cp": lay.cp_group} if plan.cp > 1 else {})})
        if lay.ep_group is not None:               # the tokens' all-to-alls; experts' sync
            self.groups.update({"ep": lay.ep_group, "edp": lay.expert_group})
        if lay.pipeline is not None:
            self.groups["pp"] = lay.pipeline.links
            if lay.pipeline.embed_group is not None:
                self.groups["embed"] = lay.pipeline.embed_group
        self.moe_layers = {name: m for name, m in lay.model.named_modules()
                           if hasattr(m, "take_totals")}
        self.offload = plan.offload != "none"
        self.ledger = None if device_memory is None and not memory_ledger else \
            _ledger(ctx, self.engine, device_memory)
        self.local, self.norms, self.lrs, self.traffic, self.by_axis = [], [], [], [], []
        self.moe: list[dict] = []
        self.timing: dict[str, list[float]] = {"compute": [], "comm_wait": [], "step": [],
                                               "cpu": []}

    def compute(self, compute: Callable[[], float]) -> float:
        """Run the step's forward and backward, timed and under the ledger: the local loss."""
        self.before = _traffic(self.groups)
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        with contextlib.nullcontext() if self.ledger is None else self.ledger:
            self.local.append(compute())
        self.t1 = time.perf_counter()
        self.inner = float(getattr(self.engine, "compute_wait_s", 0.0))   # ZeRO-2/3: waits
        return self.local[-1]                                              # inside backward

    def global_loss(self, local: float, replace_last: bool = False) -> float:
        """COLLECTIVE: the step's global loss from this rank's local one (replace_last: it
        replaces the step's local loss, a step computed again)."""
        if replace_last:
            self.local[-1] = local
        return float(_global_loss([local], self.grad, self.lay.pp_group, self.algo)[0])

    def end(self, step: int, lr: float, norm: float, timeline, dp_rank: int) -> StepEnd:
        """After the update: record the step; COLLECTIVE under MoE (the routing's sums)."""
        t2, engine, inner = time.perf_counter(), self.engine, self.inner
        if self.ledger is not None:                # memory/ledger.py: this step's peak
            self.ledger.mark("optimizer")
            peak = self.ledger.end_step()
        else:
            peak = sum(v for v in engine.memory().values()         # model state and
                       if isinstance(v, (int, np.integer)))            # ZeRO's buffer peaks
        self.norms.append(norm)
        self.lrs.append(float(lr))
        after = _traffic(self.groups)
        self.traffic.append({k: after[k] - self.before[k] for k in ("sent", "recv")})
        self.by_axis.append({a: after[f"sent.{a}"] - self.before[f"sent.{a}"]
                             for a in self.groups})
        t = self.timing
        t["compute"].append(self.t1 - self.t0 - inner)
        t["comm_wait"].append(float(getattr(engine, "comm_wait_s", t2 - self.t1)) + inner)
        t["step"].append(t2 - self.t0)
        t["cpu"].append(time.process_time() - self.c0)
        if self.moe_layers:
            self.moe.append(_moe_stats(self.moe_layers, self.grad, self.algo))
        loss = functools.lru_cache(maxsize=1)(lambda: self.global_loss(self.local[-1]))
        return StepEnd(step, engine, self.losses, (t["step"][-1], t["comm_wait"][-1],
                       t["compute"][-1]), int(peak), loss, norm, float(lr),
                       {k: v[-1] for k, v in t.items()}, self.traffic[-1], self.by_axis[-1],
                       (self.t0, t2), timeline, dp_rank)

    def losses(self) -> tuple[float, ...]:
        """COLLECTIVE: the global loss of every step so far."""
        return tuple(float(v) for v in _global_loss(self.local, self.grad, self.lay.pp_group,
                                                    self.algo))

    def result(self, timelines: list) -> RankResult:
        """COLLECTIVE: this rank's RankResult (the global losses, the full parameters and
        optimizer state); the offload files and the ledger are closed."""
        engine, stage = self.engine, self.lay.pipeline
        result = RankResult(losses=self.losses(), grad_norms=tuple(self.norms),
                            lrs=tuple(self.lrs), params=engine.full_params(),
                            optimizer_state=engine.full_optimizer_state(),
                            bytes_per_step=tuple(self.traffic),
                            bytes_by_axis=tuple(self.by_axis),
                            memory=_memory(engine, self.ledger),
                            timing={k: tuple(v) for k, v in self.timing.items()},
                            pipeline=None if stage is None else {
                                "stage": stage.cut.stage, "timeline": timelines,
                                "held_peak": stage.held_peak,
                                "held_bytes_peak": stage.held_bytes_peak},
                            moe=tuple(self.moe))
        if self.offload:                       # memory/offload.py: remove its files now
            engine.opt.close()
        return result


def _ledger(ctx, engine, budget):
    """This rank's memory/ledger.py Ledger (budget: bytes, a size string or None), holding
    the engine's parameters, gradients and optimizer state."""
    ledger = Ledger(budget, prefix=rank_prefix(ctx.rank, ctx.world_size))
    ledger.track_engine(engine)
    return ledger


def _memory(engine, ledger) -> dict:
    """engine.memory(), and the ledger's summary() under "ledger" (the ledger is closed)."""
    out = engine.memory()
    if ledger is not None:
        out["ledger"] = ledger.summary()
        ledger.close()
    return out


def _moe_stats(layers: dict, grad, algo: str) -> dict[str, dict]:
    """COLLECTIVE over dp x cp: each MoE layer's routing in this step, over the global
    batch: tokens routed to each expert ("load", before dropping), kept ("kept"), the
    share of assignments dropped, and the aux and z losses (means over routing groups);
    under expert parallelism "a2a_bytes", this rank's all-to-all bytes by the formula."""
    out = {}
    for name, layer in layers.items():
        t = C.all_reduce(layer.take_totals(), group=grad, algo=algo)
        E, groups = layer.n_experts, max(t[-1], 1.0)
        out[name] = {"load": t[:E].astype(int).tolist(), "kept": t[E:2 * E].astype(int).tolist(),
                     "drop_rate": float(t[2 * E] / max(t[2 * E + 1], 1.0)),
                     "aux": float(t[2 * E + 2] / groups), "z": float(t[2 * E + 3] / groups)}
        if hasattr(layer, "take_traffic"):      # expert parallel: this rank's a2a bytes
            out[name]["a2a_bytes"] = layer.take_traffic(layer.router.weight.data.itemsize)
    return out


def _global_loss(local: list[float], grad, pp, algo: str) -> np.ndarray:
    """Sum of the losses over the gradient-sync ranks (dp x cp), then over the pipeline
    stages, whose losses are 0 but on the last (adding zeros is exact)."""
    losses = C.all_reduce(np.array(local, np.float64), group=grad, algo=algo)
    return losses if pp is None else C.all_reduce(losses, group=pp, algo=algo)
