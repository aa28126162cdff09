"""The per-rank training loop: baseline.py's loop, with a Plan saying how work is split.

`train_on_rank(ctx, ...)` runs on every rank (spawn it). It is baseline.train_single_process
with these changes, and nothing else may differ:
    1. parallel/compose.py builds the layout of the Plan: one DeviceMesh (pp x dp x cp x
       tp), this rank's shard of the model (its pipeline stage's layers; tp; attention over
       cp) and its gradient-sync engine (over dp x cp: DDP or ZeRO);
    2. this rank reads only the rows of its dp coordinate (under context parallelism only
       its positions of them), cut into plan.micro_batches micro-batches
       (parallel/schedules.py); the loss is still divided by the token count of the WHOLE
       global batch, so local losses and gradients simply add up across ranks;
    3. the step schedule runs forward and backward: gradient accumulation, or under pp > 1
       this stage's actions of the pipeline schedule (parallel/pipeline.py); the engine
       owns the gradient communication and the optimizer;
    4. the loss of a step is the sum over dp x cp ranks of their micro-batch losses (the
       last pipeline stage's: the others add 0), all-reduced once after the loop (so the
       per-step byte counts hold training traffic).

One rank's view of step s (dp rank d of dp, cp rank c, tp rank t, M micro-batches):
    1. batches, n = schedules.micro_batches(data, s, B, dp, d, M, seed, my positions)
    2. (check mode) schedules.check_token_count: n is the global count of targets
    3. loss_s = schedules.grad_accumulation(engine, batches, n)   (pp > 1: stage.step)
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

CLI: `python -m minidist train --pp 2 --dp 2 --cp 2 --tp 2 [--sp] [--zero 1] [--schedule
1f1b] [--check]` (train_cli.py).
Read next: parallel/compose.py, parallel/schedules.py, parallel/sharding.py.
"""

from __future__ import annotations

import contextlib
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
from minidist.parallel import placement, schedules
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
    """What on_step_end sees after step `step`: the engine (its full_params() and
    full_optimizer_state() are collective) and losses(), COLLECTIVE: the global losses
    of the steps this call of train_on_rank ran so far."""

    step: int
    engine: object
    losses: Callable[[], tuple[float, ...]]
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)   # this step: step, comm wait, compute
    memory: int = 0              # bytes: the ledger's peak of this step, else the model state


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
    """Train GPT(model_cfg, seed) on this rank's share of `steps` global batches.

    Same arguments as baseline.train_single_process (grad_accum is plan.micro_batches)
    and, for a dense model, the same result up to the order of additions (~1e-16).
    on_step(step, global loss), for progress output, is called on every rank after each
    step; it costs one extra 8-byte all-reduce per step (not counted in bytes_per_step).
    Resume: initial_state = (params, optimizer_state) in the global layout (a RankResult's
    or baseline's, under any Plan) is loaded by engine.load_full_state, and the steps run
    are start_step .. start_step + steps - 1: data, dropout and the lr schedule follow the
    global step index, so the result is those steps of the uninterrupted run. total_steps:
    the length of the whole run, over which the cosine schedule decays (default
    start_step + steps; set it on every part of a run cut into parts).
    injector (reliability/faults.Injector): this rank's injected faults, fired at the
    start and the end of their step (nan and corrupt change the step's data, slow delays its
    forward and backward).
    on_step_end(StepEnd), on every rank after each step's update: where checkpoints are
    taken (reliability/recovery.py); StepEnd's engine and losses() are collective.
    guard (reliability/spike.Guard): loss-spike handling around each update. data_offset:
    step s trains on the global batch of index s + data_offset (batches skipped after a
    spike rollback).
    straggler (reliability/straggler.Straggler): per-step timings gathered over the world
    group (not counted in bytes_per_step), stragglers named, and under rebalance uneven
    rows per dp rank (the same result up to the order of additions).
    observer (observe/run_dir.RankObserver): begin(step) before each step and end(step, its
    numbers, its span, its pipeline timeline) after it: the metrics lines and the trace of
    the run directory. It needs the global loss of each step: the same 8-byte all-reduce as
    on_step's (made once when both are given).
    device_memory (bytes, or a size such as "64MB"): the steps run under memory/ledger.py's
    Ledger with that per-rank budget, which raises DeviceOutOfMemory past it; memory_ledger:
    the same without a budget. RankResult.memory["ledger"] is then its summary() (peaks).
    deterministic (minidist/deterministic/): bitwise train_single_process(deterministic=
    True, grain=grain); every micro-batch is one grain of `grain` rows, whatever
    plan.micro_batches says, so each dp rank's rows must be a multiple of grain;
    token_tiles: runs of T / token_tiles positions summed in the tree too (context
    parallelism needs them; bitwise train_single_process(..., token_tiles=token_tiles)).
    """
    check_compatible(model_cfg, data_cfg)
    plan.validate(model_cfg, global_batch, data_cfg.block_size)
    if deterministic:                  # a grain per micro-batch: the grain decides, not M
        determinism.check(plan, model_cfg, guard, straggler, grain, global_batch, token_tiles)
        plan = replace(plan, micro_batches=global_batch // (plan.dp * grain))
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
    placement.set_checking(plan.checks)
    lay = build(ctx, plan, model_cfg, seed, optimizer=optimizer, lr=lr,
                weight_decay=weight_decay, betas=betas, momentum=momentum)
    if initial_state is not None:
        lay.engine.load_full_state(*initial_state)
    engine, grad, data = lay.engine, lay.grad_group, SyntheticData(data_cfg)
    if deterministic:                          # the tp-shardable matmuls over fixed tiles
        determinize_layout(lay.model, token_tiles)
        named = list(lay.model.named_parameters())
        experts = None if lay.ep_group is None else \
            ExpertGrains(lay.model, lay.ep_group, lay.expert_group)
    canonical = "direct" if getattr(grad, "supports_shared", False) else "auto"  # MPI: no shm
    groups = {"dp": grad}                     # the gradient sync: dp (x cp)
    if lay.mesh is not None:
        groups.update({"tp": lay.tp_group, **({"cp": lay.cp_group} if plan.cp > 1 else {})})
    if lay.ep_group is not None:              # the tokens' all-to-alls; experts' sync
        groups.update({"ep": lay.ep_group, "edp": lay.expert_group})
    stage = lay.pipeline
    if stage is not None:
        groups["pp"] = stage.links
        if stage.embed_group is not None:
            groups["embed"] = stage.embed_group
    positions = None if lay.context is None else lay.context.positions(data_cfg.block_size)
    local, norms, lrs, traffic, by_axis, timelines = [], [], [], [], [], []
    moe_layers = {name: m for name, m in lay.model.named_modules() if hasattr(m, "take_totals")}
    moe_steps: list[dict] = []
    timing: dict[str, list[float]] = {"compute": [], "comm_wait": [], "step": [], "cpu": []}
    ledger = None if device_memory is None and not memory_ledger else \
        _ledger(ctx, engine, device_memory)
    for step in range(start_step, start_step + steps):
        if observer is not None:
            observer.begin(step)
        lr_s = lr if lr_schedule == "constant" else optim.lr_at(
            step, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
        if injector is not None:
            injector.at("start", step)

        rows = None if straggler is None else straggler.rows
        first, mine = determinism.my_rows(rows, global_batch, plan.dp, lay.dp_group.rank)
        batches, n_tokens = schedules.micro_batches(data, step + data_offset, global_batch,
                                                    plan.dp, lay.dp_group.rank,
                                                    mine // grain if deterministic else
                                                    plan.micro_batches, seed, positions,
                                                    **({} if rows is None else {"rows": rows}))
        if injector is not None:               # random tokens instead of the batch
            batches = [replace(mb, x=injector.corrupt(step, mb.x, model_cfg.vocab_size))
                       for mb in batches]
        if plan.checks:
            schedules.check_token_count(batches, n_tokens, grad)

        def compute(step: int = step, batches=batches, n_tokens=n_tokens) -> float:
            """Forward and backward of this step's micro-batches: the local loss."""
            if injector is not None:           # a `slow` fault: this rank computes late
                injector.slow(step, sum(len(mb.x) for mb in batches))
            with contextlib.nullcontext() if injector is None else \
                    injector.nan_loss(lay.model, step):
                if deterministic and stage is None:     # deterministic/step.py: the
                    loss, norm = determinism.step(engine, named, batches, first // grain,
                                                  global_batch // grain, n_tokens,  # the
                                                  lay.dp_group, lr_s, clip_grad,    # update
                                                  lay.tp_group, experts,            # too
                                                  determinism.param_order(model_cfg), grad)
                    norms.append(norm)
                    return loss
                if stage is None:
                    return schedules.grad_accumulation(engine, batches, n_tokens)
                if deterministic:
                    loss, norm = determinism.pipeline_step(
                        engine, stage, batches, first // grain, global_batch // grain,
                        n_tokens, lay.dp_group,
                        lay.pp_group, determinism.param_order(model_cfg), lr_s, clip_grad,
                        lay.tp_group, grad, experts)
                    norms.append(norm)
                else:
                    loss = stage.step(engine, batches, n_tokens)
                timelines.append([(a.kind, a.micro_batch, a.chunk, t0_, t1_)
                                  for a, t0_, t1_ in stage.record])
                return loss

        before = _traffic(groups)
        t0, c0 = time.perf_counter(), time.process_time()
        with contextlib.nullcontext() if ledger is None else ledger:     # memory/ledger.py
            local.append(compute())
        t1 = time.perf_counter()
        inner = float(getattr(engine, "compute_wait_s", 0.0))    # ZeRO-2/3: waits inside
        if deterministic:
            pass                               # the update ran inside compute()
        elif guard is None:
            norms.append(float(engine.step(lr_s, clip_grad)))
        else:                                  # reliability/spike.py: the update, or not
            def again() -> float:
                local[-1] = compute()
                return float(_global_loss([local[-1]], grad, lay.pp_group, canonical)[0])
            loss_s = float(_global_loss([local[-1]], grad, lay.pp_group, canonical)[0])
            norms.append(float(guard.step(step, engine, lr_s, clip_grad, loss_s, again)[0]))
        t2 = time.perf_counter()
        if ledger is not None:                     # memory/ledger.py: this step's peak
            ledger.mark("optimizer")
            peak = ledger.end_step()
        else:
            peak = sum(v for v in engine.memory().values()         # model state and
                       if isinstance(v, (int, np.integer)))            # ZeRO's buffer peaks
        lrs.append(float(lr_s))
        after = _traffic(groups)
        traffic.append({k: after[k] - before[k] for k in ("sent", "recv")})
        by_axis.append({a: after[f"sent.{a}"] - before[f"sent.{a}"] for a in groups})
        timing["compute"].append(t1 - t0 - inner)
        timing["comm_wait"].append(float(getattr(engine, "comm_wait_s", t2 - t1)) + inner)
        timing["step"].append(t2 - t0)
        timing["cpu"].append(time.process_time() - c0)
        if straggler is not None:                  # COLLECTIVE: reliability/straggler.py
            straggler.end(lay.dp_group.rank, timing["compute"][-1], timing["comm_wait"][-1],
                          t2 - t0)
        if moe_layers:
            moe_steps.append(_moe_stats(moe_layers, grad, canonical))
        if on_step is not None or observer is not None:
            loss_s = float(_global_loss([local[-1]], grad, lay.pp_group, canonical)[0])
            if on_step is not None:
                on_step(step, loss_s)
        if observer is not None:                   # observe/run_dir.py: metrics, trace
            observer.end(step, {"loss": loss_s, "grad_norm": norms[-1], "lr": lrs[-1],
                                "time_s": {k: v[-1] for k, v in timing.items()},
                                "bytes_sent": by_axis[-1], "bytes": traffic[-1],
                                "memory": engine.memory()},
                         (t0, t2), timelines[-1] if stage is not None else None)
        if injector is not None:
            injector.at("end", step)
        if on_step_end is not None:
            on_step_end(StepEnd(step, engine, lambda: tuple(float(v) for v in _global_loss(
                local, grad, lay.pp_group, canonical)), (timing["step"][-1],
                timing["comm_wait"][-1], timing["compute"][-1]), int(peak)))
    losses = _global_loss(local, grad, lay.pp_group, canonical)
    result = RankResult(losses=tuple(float(v) for v in losses), grad_norms=tuple(norms),
                        lrs=tuple(lrs), params=engine.full_params(),
                        optimizer_state=engine.full_optimizer_state(),
                        bytes_per_step=tuple(traffic), bytes_by_axis=tuple(by_axis),
                        memory=_memory(engine, ledger),
                        timing={k: tuple(v) for k, v in timing.items()},
                        pipeline=None if stage is None else {
                            "stage": stage.cut.stage, "timeline": timelines,
                            "held_peak": stage.held_peak,
                            "held_bytes_peak": stage.held_bytes_peak},
                        moe=tuple(moe_steps))
    if plan.offload != "none":                 # memory/offload.py: remove its files now
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
