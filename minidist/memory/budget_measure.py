"""Measuring the memory budget: one training step on real ranks, counted by category.

memory/budget.py predicts the bytes of each category; this module runs the step and
counts them, so that every formula there is checked against the arrays themselves:
    params, grads, optimizer, buffers   engine.memory() after the step (parallel/data/ddp.py,
                                        zero/engine.py: the arrays' nbytes, ZeRO's peaks)
    activations                         autograd/saved.py: the distinct buffers the graph
                                        of a micro-batch keeps for its backward (parameters
                                        excluded), at the end of its forward; a pipeline
                                        stage's peak over the schedule (pipeline/stage.py's
                                        measure_memory, held_bytes_peak)
    recompute                           the largest output a recomputation rebuilds and
                                        what its graph keeps (recompute.on_recompute), less
                                        its inputs and the parameters: q, k, v or the block
                                        input are kept arrays, not new ones
Each micro-batch gets arrays of its own (copies), as a data loader hands them out:
micro_batching.micro_batches cuts views of one global batch, and a view counts as its whole
base buffer. train.py's train_on_rank returns engine.memory() (RankResult.memory)
but cannot look into a step's graphs, so the step here is assembled from the same parts
(compose.build, micro_batching.micro_batches, grad_accumulation or PipelineStage.step); the
tests check that its engine.memory() is RankResult.memory.

One rank's view (COLLECTIVE over the world; every rank runs `_on_rank`):
    1. build the Plan's layout (parallel/compose.build): mesh, my shard, my engine
    2. my micro-batches of step 0 (micro_batching.micro_batches), copied
    3. no pipeline: micro_batching.grad_accumulation through an engine whose forward records
       saved_bytes(loss); pipeline: stage.measure_memory, stage.step; both watching the
       recomputations
    4. engine.step, then engine.memory()
Communication: that of one training step of the Plan (train.py's, without its loss
all-reduce).
Read next: memory/budget_fit.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from minidist.autograd.saved import ctx_arrays, distinct_bytes, graph_nodes, saved_bytes
from minidist.data import DataConfig, SyntheticData
from minidist.memory import recompute
from minidist.memory.budget import MemoryPlan, estimate_stages
from minidist.nn import GPTConfig
from minidist.parallel import micro_batching
from minidist.parallel import placement
from minidist.parallel.compose import build
from minidist.runtime.launch import spawn

MEASURED = ("params", "grads", "optimizer", "activations", "buffers", "recompute")
OPTIMIZERS = {"adamw": ("adamw", 0.0), "sgd_momentum": ("sgd", 0.9), "sgd": ("sgd", 0.0)}
DTYPES = {"fp64": "float64", "fp32": "float32"}


@dataclass(frozen=True)
class Measured:
    """What one rank counted: its stage, and bytes by category (MEASURED)."""

    rank: int
    stage: int
    bytes: dict


class _Recording:
    """An engine whose forward also records the bytes the loss's graph keeps (the peak
    over the micro-batches); everything else is the engine's."""

    def __init__(self, engine, params) -> None:
        self.engine, self.params, self.peak = engine, params, 0

    def no_sync(self):
        return self.engine.no_sync()

    def forward(self, *args, **kwargs):
        logits, loss = self.engine.forward(*args, **kwargs)
        self.peak = max(self.peak, saved_bytes(loss, exclude=self.params))
        return logits, loss


def _rebuilt_bytes(root) -> int:
    """Bytes a recomputation holds at its largest: `root`, the rebuilt output, and what its
    graph keeps, less the buffers of the leaves that take a gradient: the recomputation's
    inputs and the parameters, arrays that exist anyway (a constant leaf, e.g. a dropout
    mask made in the rebuild, is new and counts)."""
    leaves, seen, stack = [], set(), [root]
    while stack:                                   # the walk of saved.graph_nodes
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t._node is None:
            leaves += [t] if t.requires_grad else []
        else:
            stack.extend(p for p in t._node[2] if p is not None)
    arrays = [root.data] + [a for _, ctx in graph_nodes(root) for a in ctx_arrays(ctx)]
    return distinct_bytes(arrays, exclude=leaves)


def _on_rank(ctx, cfg: GPTConfig, data_cfg: DataConfig, plan: MemoryPlan, batch: int,
             seed: int) -> Measured:
    placement.set_checking(False)
    name, momentum = OPTIMIZERS[plan.optimizer]
    lay = build(ctx, plan.to_plan(), cfg, seed, optimizer=name, lr=1e-3, weight_decay=0.0,
                betas=(0.9, 0.999), momentum=momentum)
    positions = None if lay.context is None else lay.context.positions(data_cfg.block_size)
    batches, n = micro_batching.micro_batches(SyntheticData(data_cfg), 0, batch, plan.dp,
                                         lay.dp_group.rank, plan.micro_batches, seed,
                                         positions)
    batches = [replace(mb, x=mb.x.copy(), y=mb.y.copy()) for mb in batches]
    rebuilt = [0]
    with recompute.on_recompute(lambda _, y: rebuilt.append(_rebuilt_bytes(y))):
        if lay.pipeline is not None:
            lay.pipeline.measure_memory = True
            lay.pipeline.step(lay.engine, batches, n)
            activations, stage = lay.pipeline.held_bytes_peak, lay.pipeline.cut.stage
        else:
            rec = _Recording(lay.engine, lay.model.parameters())
            micro_batching.grad_accumulation(rec, batches, n)
            activations, stage = rec.peak, 0
    lay.engine.step(1e-3, None)
    mem = lay.engine.memory()
    buffers = mem.get("peak_unsharded_grads", 0) + mem.get("peak_gathered_params", 0)
    return Measured(ctx.rank, stage, {
        "params": mem["params"], "grads": mem["grads"], "optimizer": mem["optimizer"],
        "activations": activations, "buffers": buffers,
        "recompute": max(rebuilt)})


def check_measurable(cfg: GPTConfig, plan: MemoryPlan) -> None:
    """ValueError unless this plan can be run here: minidist trains in the model's one
    dtype, fp64 or fp32."""
    if DTYPES.get(plan.precision) != cfg.dtype:
        raise ValueError(f"--measure: precision={plan.precision} but the model trains in "
                         f"{cfg.dtype}; minidist's step runs in one dtype, so measure with "
                         f"precision={'fp64' if cfg.dtype == 'float64' else 'fp32'} (bf16 "
                         "and fp16 are estimated only).")


def measure(cfg: GPTConfig, data_cfg: DataConfig, plan: MemoryPlan, batch: int,
            seed: int = 0) -> list[Measured]:
    """Run one step of `plan` on plan.world_size ranks; per rank, bytes by category."""
    check_measurable(cfg, plan)
    estimate_stages(cfg, plan, batch, data_cfg.block_size)       # ValueError: cannot run
    cfg = dataclasses.replace(cfg, recompute=plan.recompute)
    return spawn(plan.world_size, _on_rank, cfg, data_cfg, plan, batch, seed)


def compare(cfg: GPTConfig, data_cfg: DataConfig, plan: MemoryPlan, batch: int,
            seed: int = 0) -> dict[int, dict[str, tuple[int, int]]]:
    """{stage: {category: (estimated, measured)}} after one step on real ranks; measured
    is the value of the stage's rank farthest from the estimate (all ranks of a stage
    should agree)."""
    stages = estimate_stages(cfg, plan, batch, data_cfg.block_size)
    runs = measure(cfg, data_cfg, plan, batch, seed)
    out: dict[int, dict] = {}
    for est in stages:
        mine = [m.bytes for m in runs if m.stage == est.stage]
        out[est.stage] = {}
        for c in MEASURED:
            got = max((m[c] for m in mine), key=lambda v: abs(v - getattr(est, c)))
            out[est.stage][c] = (getattr(est, c), got)
    return out


def relative_error(estimated: int, measured: int) -> float:
    """|estimated - measured| / measured (0 when both are 0)."""
    if measured == 0:
        return 0.0 if estimated == 0 else float("inf")
    return abs(estimated - measured) / measured


__all__ = ["MEASURED", "Measured", "measure", "compare", "check_measurable",
           "relative_error"]
