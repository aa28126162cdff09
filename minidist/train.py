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
    5. MoE with aux-loss-free balancing: the routing biases' update from the global batch's
       load (parallel/expert/balancing.py)
Shapes: x, y (B/(dp M), T/cp) per micro-batch, the same on every tp rank.
Result (RankResult): losses (global), grad_norms, lrs, full params and optimizer state
(gathered over dp under ZeRO and over tp), bytes sent/received per step (group.stats deltas
around the step: "sent", "recv" over all axes; bytes_by_axis: sent per axis,
recv_by_axis received, inter_by_axis sent to other emulated nodes, "dp" being the gradient sync over dp x cp, "pp" the pipeline's
activations and gradients, "embed" the tied wte's all-reduce, "ep" the MoE tokens'
all-to-alls, "edp" the experts' gradient sync, "etp" the expert-tensor-parallel gathers and
reduce-scatters), pipeline (pp > 1: this stage's timeline per step, as (schedules.Action,
start, end) in perf_counter seconds, and its peak held activations), memory
(engine.memory()), routing_biases (per step, every MoE layer's balancing bias after
the update, the same on every rank) and timing per step in seconds: "comm_wait" (the wall time this rank
spent inside calls on its groups during the step: comm_by_axis summed), "compute" (forward +
backward, less the part of comm_wait inside them), "step" (wall time of the whole step)
and "cpu" (this process's CPU time in the step, all threads). comm_by_axis: per step, the
seconds in calls on each axis of bytes_by_axis, and "other" for the layout's other groups
(the gradient norm's tp x pp group, the pp group, dp alone under cp) when it has any. A
group counts a call of its caller's thread: a synchronous call, a wait in Work.wait() or
for the group's queue (runtime/group.py); an async call running on the group's worker
is not waiting. Each call is counted once, on its own group: the engines and layers
time nothing themselves.

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

train_on_rank's configuration is four dataclasses and the hooks:
    model_cfg (nn.GPTConfig), data_cfg (data.DataConfig)   what is trained, on what
    plan (parallel/compose.Plan)     how the ranks split the work
    run (RunConfig)                  which steps, the global batch, the seed; resuming
                                     (start_step, total_steps, data_offset); the memory
                                     ledger; the deterministic mode
    opt (optim.OptimizerConfig)      the optimizer, its learning-rate schedule, clipping
    hooks                            the features above; OnStep(fn) calls fn(step, global
                                     loss) after each step (one more 8-byte all-reduce, not
                                     in bytes_per_step), OnStepEnd(fn) calls fn(StepEnd)
baseline.train_single_process takes the same model, data, run and optimizer settings
(grad_accum is plan.micro_batches; for a dense model the same result up to the order of
additions). Resuming: initial_state = (params, optimizer state[, routing biases]) in the
global layout (any Plan's) is loaded, and data, dropout and the lr schedule follow the global step index.

CLI: `python -m minidist train --pp 2 --dp 2 --cp 2 --tp 2 [--sp] [--zero 1] [--schedule
1f1b] [--check]` (train_cli.py).
Read next: parallel/compose.py, parallel/micro_batching.py, parallel/sharding.py.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from minidist import collectives as C
from minidist.data import DataConfig, SyntheticData, check_compatible
from minidist.deterministic import step as determinism
from minidist.deterministic.expert import ExpertGrains
from minidist.deterministic.layout import determinize_layout
from minidist.memory.ledger import Ledger
from minidist.nn import GPTConfig
from minidist.optim import OptimizerConfig
from minidist.parallel import micro_batching
from minidist.parallel import placement
from minidist.parallel.compose import Plan, build
from minidist.parallel.expert.balancing import RoutingBalance
from minidist.runtime.errors import rank_prefix

__all__ = ["Hook", "OnStep", "OnStepEnd", "OptimizerConfig", "Plan", "RankResult",
           "RunConfig", "StepEnd", "train_on_rank"]


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
    routing_biases: tuple[dict[str, np.ndarray], ...] = ()   # per step, after the update
    comm_by_axis: tuple[dict[str, float], ...] = ()  # {"dp": s, "tp": s}: seconds in calls
    recv_by_axis: tuple[dict[str, int], ...] = ()   # {"dp": received B, "tp": received B}
    inter_by_axis: tuple[dict[str, int], ...] = ()  # sent to other (emulated) nodes


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
    routing_bias: dict | None = None          # MoE with a balancing bias: every layer's
    moe: dict | None = None                   # MoE: this step's routing per layer (_moe_stats)


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
    """{"sent", "recv"} over all groups, and "sent.<axis>", "recv.<axis>" and "inter.<axis>"
    (sent to ranks on other nodes, runtime/nodes.py) per group, so far."""
    out = {"sent": 0, "recv": 0}
    for axis, g in groups.items():
        out["sent"] += g.stats["bytes_sent"]
        out["recv"] += g.stats["bytes_recv"]
        out[f"sent.{axis}"] = g.stats["bytes_sent"]
        out[f"recv.{axis}"] = g.stats["bytes_recv"]
        out[f"inter.{axis}"] = g.stats.get("bytes_sent_inter", 0)
    return out


def _seconds(groups: dict[str, object], others: list) -> dict[str, float]:
    """Per axis, the seconds this rank spent in calls on its group so far (group.stats),
    and "other": those on the `others` groups together (if any)."""
    out = {axis: g.stats["seconds"] for axis, g in groups.items()}
    if others:
        out["other"] = sum(g.stats["seconds"] for g in others)
    return out


@dataclass(frozen=True)
class RunConfig:
    """Which steps a run trains, on which data, and how it measures them.

    The run trains global steps start_step .. start_step + steps - 1 on global batches of
    global_batch rows (step s reads batch s + data_offset: batches skipped after a
    rollback); total_steps is the whole run's length (the cosine schedule's end; default
    start_step + steps). device_memory: the steps run under memory/ledger.py's Ledger, a
    per-rank budget in bytes or "64MB" (memory_ledger: the ledger without a budget).
    deterministic: bitwise baseline.train_single_process(deterministic=True, grain=...,
    token_tiles=...): each micro-batch is one grain of `grain` rows."""

    steps: int
    global_batch: int
    seed: int = 0
    start_step: int = 0
    total_steps: int | None = None
    data_offset: int = 0
    device_memory: int | str | None = None
    memory_ledger: bool = False
    deterministic: bool = False
    grain: int = 1
    token_tiles: int | None = None

    def __post_init__(self) -> None:
        for field in ("steps", "start_step", "data_offset"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RunConfig: {field}={value!r} must be an int >= 0.")
        last = self.start_step + self.steps
        if self.total_steps is not None and (isinstance(self.total_steps, bool) or not
                                             isinstance(self.total_steps, int)
                                             or self.total_steps < last):
            raise ValueError(f"RunConfig: total_steps={self.total_steps!r} must be an int >= "
                             f"start_step + steps = {last}.")

    @property
    def step_range(self) -> range:
        """The global indices of the steps this run trains."""
        return range(self.start_step, self.start_step + self.steps)

    @property
    def length(self) -> int:
        """total_steps, or start_step + steps."""
        return self.start_step + self.steps if self.total_steps is None else self.total_steps


def train_on_rank(ctx, model_cfg: GPTConfig, data_cfg: DataConfig, plan: Plan,
                  run: RunConfig, opt: OptimizerConfig, hooks: Sequence[Hook | None] = (), *,
                  straggler=None, guard=None,
                  initial_state: tuple[dict, dict] | None = None) -> RankResult:
    """Train GPT(model_cfg, run.seed) on this rank's share of run.steps global batches: the
    loop of baseline.train_single_process around this rank's ParallelStep, with the run's
    features attached as hooks (None entries skipped; the module docstring has the
    protocol). straggler (reliability/straggler.py) is the first hook and decides the
    rows of each dp rank; guard (reliability/spike.py) decides each update; initial_state:
    (params, optimizer state) in the global layout, and the routing biases' table
    (StepEnd.routing_bias) when the model balances by bias, loaded before the first step."""
    check_compatible(model_cfg, data_cfg)
    B = run.global_batch
    plan.validate(model_cfg, B, data_cfg.block_size)
    grain = run.grain if run.deterministic else 1
    if run.deterministic:              # a grain per micro-batch: the grain decides, not M
        determinism.check(plan, model_cfg, guard is not None,
                          straggler is not None and straggler.mode == "rebalance", grain, B,
                          run.token_tiles, data_cfg.block_size)
        plan = replace(plan, micro_batches=B // (plan.dp * grain))
    placement.set_checking(plan.checks)
    lay = build(ctx, plan, model_cfg, run.seed, **opt.engine_arguments())
    if initial_state is not None:
        lay.engine.load_full_state(*initial_state[:2])
    step_run = ParallelStep(lay, model_cfg, B, opt.clip_grad, guard,
                            (grain, run.token_tiles) if run.deterministic else None)
    if initial_state is not None and len(initial_state) > 2 and step_run.balance is not None:
        step_run.balance.load(initial_state[2])
    meter = Meter(ctx, lay, plan, run.device_memory, run.memory_ledger)
    hooks = [h for h in (straggler, *hooks) if h is not None]
    data, dp_rank = SyntheticData(data_cfg), lay.dp_group.rank
    positions = None if lay.context is None else lay.context.positions(data_cfg.block_size)
    for step in run.step_range:
        for h in hooks:
            h.on_step_start(step)
        lr_s = opt.lr_at(step, run.length)
        rows = None if straggler is None else straggler.rows        # uneven under rebalance
        first, mine = determinism.my_rows(rows, B, plan.dp, dp_rank)
        batches, n_tokens = micro_batching.micro_batches(
            data, step + run.data_offset, B, plan.dp, dp_rank,
            mine // grain if run.deterministic else plan.micro_batches, run.seed, positions,
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
                return step_run.compute(batches, n_tokens, first // grain, lr_s)

        loss = meter.compute(compute)          # timed, under the memory ledger if any
        norm = step_run.update(step, lr_s, loss, compute, meter.global_loss)
        end = meter.end(step, lr_s, norm, step_run.timeline, dp_rank, step_run.routing_bias)
        for h in hooks:
            h.on_step_end(end)
    return meter.result(step_run.timelines)


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
        self.balance, self.routing_bias = None, None
        if model_cfg.moe_every and model_cfg.bias_rate:   # aux-loss-free balancing, on the
            #                                             layers that run (twins included)
            algo = "direct" if getattr(lay.grad_group, "supports_shared", False) else "auto"
            self.balance = RoutingBalance(
                lay.model, [f"blocks.{i}.moe" for i in range(model_cfg.n_layer)
                            if model_cfg.is_moe(i)],
                model_cfg.n_experts, lay.grad_group, lay.pp_group, algo,
                None if lay.pipeline is None else lay.pipeline.mirror_group)

    def compute(self, batches: list, n_tokens: int, first: int, lr: float) -> float:
        """Forward and backward of `batches` (the first is grain `first` of the global
        batch, for the deterministic mode): the local loss."""
        lay, engine, stage = self.lay, self.lay.engine, self.stage
        if self.balance is not None:
            self.balance.begin()
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
        if stage is not None:                  # this step's actions: (Action, t0, t1)
            self.timeline = list(stage.record)
            self.timelines.append(self.timeline)
        return loss

    def update(self, step: int, lr: float, loss: float, compute: Callable[[], float],
               global_loss: Callable[[float], float]) -> float:
        """The optimizer step after compute, then the routing biases' (MoE with
        aux-loss-free balancing, parallel/expert/balancing.py); returns the gradient norm.
        guard (reliability/spike.py) sees the global loss and may skip the update or run
        compute again."""
        norm = self._update(step, lr, loss, compute, global_loss)
        if self.balance is not None:
            self.routing_bias = self.balance.step()
        return norm

    def _update(self, step: int, lr: float, loss: float, compute: Callable[[], float],
                global_loss: Callable[[float], float]) -> float:
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
    local losses, norms, lrs, bytes and seconds in calls per group (group.stats deltas),
    times, the memory peak (memory/ledger.py's Ledger under a budget or when asked, else
    the engine's model state) and each MoE layer's routing."""

    def __init__(self, ctx, lay, plan: Plan, device_memory, memory_ledger: bool) -> None:
        self.lay, self.engine, self.grad = lay, lay.engine, lay.grad_group
        self.algo = "direct" if getattr(self.grad, "supports_shared", False) else "auto"
        self.groups = {"dp": self.grad}            # the gradient sync: dp (x cp)
        if lay.mesh is not None:
            self.groups.update({"tp": lay.tp_group,
                                **({"cp": lay.cp_group} if plan.cp > 1 else {})})
        if lay.ep_group is not None:               # the tokens' all-to-alls; experts' sync
            self.groups.update({"ep": lay.ep_group, "edp": lay.expert_group})
        if lay.etp_group is not None:              # the experts' tensor parallelism
            self.groups["etp"] = lay.etp_group
        if lay.shard_group is not None:            # HSDP: ZeRO inside, replicas across
            self.groups.update({"shard": lay.shard_group, "replicate": lay.replica_group})
        if lay.pipeline is not None:
            self.groups["pp"] = lay.pipeline.links
            if lay.pipeline.embed_group is not None:
                self.groups["embed"] = lay.pipeline.embed_group
        # the layout's other groups (the norm's tp x pp, pp, dp alone under cp), each
        # counted once in the comm seconds
        self.others, seen = [], {id(g) for g in self.groups.values()}
        for g in (lay.sharding.model_group, lay.pp_group, lay.dp_group):
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                self.others.append(g)
        self.moe_layers = {name: m for name, m in lay.model.named_modules()
                           if hasattr(m, "take_totals")}
        self.offload = plan.offload != "none"
        self.ledger = None if device_memory is None and not memory_ledger else \
            _ledger(ctx, self.engine, device_memory)
        self.local, self.norms, self.lrs, self.traffic, self.by_axis = [], [], [], [], []
        self.comm_by_axis: list[dict[str, float]] = []
        self.recv_by_axis: list[dict[str, int]] = []
        self.inter_by_axis: list[dict[str, int]] = []
        self.moe: list[dict] = []
        self.routing_biases: list[dict] = []
        self.timing: dict[str, list[float]] = {"compute": [], "comm_wait": [], "step": [],
                                               "cpu": []}

    def compute(self, compute: Callable[[], float]) -> float:
        """Run the step's forward and backward, timed and under the ledger: the local loss."""
        self.before, self.s0 = _traffic(self.groups), _seconds(self.groups, self.others)
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        with contextlib.nullcontext() if self.ledger is None else self.ledger:
            self.local.append(compute())
        self.t1, self.s1 = time.perf_counter(), _seconds(self.groups, self.others)
        return self.local[-1]

    def global_loss(self, local: float, replace_last: bool = False) -> float:
        """COLLECTIVE: the step's global loss from this rank's local one (replace_last: it
        replaces the step's local loss, a step computed again)."""
        if replace_last:
            self.local[-1] = local
        return float(_global_loss([local], self.grad, self.lay.pp_group, self.algo)[0])

    def end(self, step: int, lr: float, norm: float, timeline, dp_rank: int,
            routing_bias: dict | None = None) -> StepEnd:
        """After the update: record the step; COLLECTIVE under MoE (the routing's sums)."""
        t2, s2, engine = time.perf_counter(), _seconds(self.groups, self.others), self.engine
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
        self.recv_by_axis.append({a: after[f"recv.{a}"] - self.before[f"recv.{a}"]
                                  for a in self.groups})
        self.inter_by_axis.append({a: after[f"inter.{a}"] - self.before[f"inter.{a}"]
                                   for a in self.groups})
        comm = {a: s2[a] - self.s0[a] for a in s2}          # seconds in calls, per axis
        self.comm_by_axis.append(comm)
        t = self.timing
        inside = sum(self.s1[a] - self.s0[a] for a in self.s1)   # of those, in fwd + bwd
        t["compute"].append(self.t1 - self.t0 - inside)
        t["comm_wait"].append(sum(comm.values()))
        t["step"].append(t2 - self.t0)
        t["cpu"].append(time.process_time() - self.c0)
        if self.moe_layers:
            self.moe.append(_moe_stats(self.moe_layers, self.grad, self.algo))
        if routing_bias is not None:
            self.routing_biases.append(routing_bias)
        loss = functools.lru_cache(maxsize=1)(lambda: self.global_loss(self.local[-1]))
        return StepEnd(step, engine, self.losses, (t["step"][-1], t["comm_wait"][-1],
                       t["compute"][-1]), int(peak), loss, norm, float(lr),
                       {k: v[-1] for k, v in t.items()}, self.traffic[-1], self.by_axis[-1],
                       (self.t0, t2), timeline, dp_rank, routing_bias,
                       self.moe[-1] if self.moe_layers else None)

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
                            comm_by_axis=tuple(self.comm_by_axis),
                            recv_by_axis=tuple(self.recv_by_axis),
                            inter_by_axis=tuple(self.inter_by_axis),
                            memory=_memory(engine, self.ledger),
                            timing={k: tuple(v) for k, v in self.timing.items()},
                            pipeline=None if stage is None else {
                                "stage": stage.cut.stage, "timeline": timelines,
                                "held_peak": stage.held_peak,
                                "held_bytes_peak": stage.held_bytes_peak},
                            moe=tuple(self.moe), routing_biases=tuple(self.routing_biases))
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
    batch: tokens routed to each expert ("load", before dropping), what the choice without
    the balancing bias would have given ("unbiased_load"), kept ("kept"), the share of
    assignments dropped, the max violation (max load / mean load - 1, 0 when balanced) of
    both loads, and the aux and z losses (means over
    routing groups); under expert parallelism "a2a_bytes", this rank's all-to-all bytes by
    the formula, and under expert tensor parallelism "etp_bytes", its etp traffic's."""
    out = {}
    for name, layer in layers.items():
        t = C.all_reduce(layer.take_totals(), group=grad, algo=algo)
        E, groups = layer.n_experts, max(t[-1], 1.0)
        load, unbiased = t[:E], t[2 * E:3 * E]
        out[name] = {"load": load.astype(int).tolist(), "kept": t[E:2 * E].astype(int).tolist(),
                     "unbiased_load": unbiased.astype(int).tolist(),
                     "max_violation": max_violation(load),
                     "unbiased_max_violation": max_violation(unbiased),
                     "drop_rate": float(t[3 * E] / max(t[3 * E + 1], 1.0)),
                     "aux": float(t[3 * E + 2] / groups), "z": float(t[3 * E + 3] / groups)}
        if hasattr(layer, "take_traffic"):      # expert parallel: this rank's a2a bytes
            out[name]["a2a_bytes"] = layer.take_traffic(layer.router.weight.data.itemsize)
        if hasattr(layer, "take_etp_traffic"):  # expert tensor parallel: its gathers
            out[name]["etp_bytes"] = layer.take_etp_traffic(
                layer.router.weight.data.itemsize)
    return out


def max_violation(load: np.ndarray) -> float:
    """max_e load[e] / mean_e load - 1: 0 for a perfectly balanced layer (DeepSeek-V3's and
    Wang et al.'s MaxVio)."""
    mean = float(np.mean(load))
    return float(np.max(load)) / mean - 1.0 if mean > 0 else 0.0


def _global_loss(local: list[float], grad, pp, algo: str) -> np.ndarray:
    """Sum of the losses over the gradient-sync ranks (dp x cp), then over the pipeline
    stages, whose losses are 0 but on the last (adding zeros is exact)."""
    losses = C.all_reduce(np.array(local, np.float64), group=grad, algo=algo)
    if pp is None:
        return losses                   # (pp may span emulated nodes where grad does not)
    return C.all_reduce(losses, group=pp,
                        algo=algo if getattr(pp, "supports_shared", False) else "auto")
