"""Composition: a Plan lays W = pp x dp x cp x tp ranks out on one mesh and applies each
parallelism to the plain model in one order.

A training step is three separate jobs, each with its own subpackage and its own groups
(README, "Layouts"):
    1. model sharding   which slice of each parameter I hold (tp: parallel/tensor/), which
                        positions (cp: parallel/context/), which experts (ep: parallel/expert/),
                        which layers (pp: parallel/pipeline/); recorded by parallel/sharding.py
    2. gradient sync    sum gradients over the replicas, every rank holding the same shard,
                        dp x cp: DDP (parallel/data/) or ZeRO (parallel/zero/)
    3. step schedule    who runs forward/backward of which micro-batch: parallel/micro_batches.py,
                        and a pipeline schedule across the pp stages (parallel/pipeline/)
`Plan` says how many ranks each axis gets; `build` makes one DeviceMesh with axes
(pp, dp, cp, tp), tp the fastest (neighbouring ranks, as Megatron places tp inside a node,
then cp; pp the slowest, across nodes), and hands each job only the group it needs.

    mesh (dp=2, tp=2):   tp ->  0  1          tp groups {0,1} {2,3}: split each layer
                         dp     2  3          dp groups {0,2} {1,3}: same shard, other rows
With cp = 2 as well (8 ranks, coordinates (d, c, t), rank = 4 d + 2 c + t), the cp groups
{0,2} {1,3} {4,6} {5,7} hold the same rows at other positions, and the gradient-sync
groups dp x cp {0,2,4,6} {1,3,5,7} every replica of one tp shard (DeviceMesh.flatten).

One rank's view (global rank q, coordinates (d, c, t)), `build` top to bottom:
    1. validate the Plan against the model and the batch (before any process starts);
    2. mesh = DeviceMesh(("dp", "cp", "tp"), (dp, cp, tp)): my dp, cp and tp groups, and
       the dp x cp group for the gradient sync (`_groups`);
    3. `parallelize`: GPT(cfg, seed) as the single process draws it, then in this order
       apply_tensor (tp), apply_context (cp), apply_experts (ep), the pipeline cut (pp);
    4. mixed precision: the model keeps a rounded copy (memory/precision.py);
    5. `gradient_sync`: DDP, its shared-memory fast path or ZeRO-1/2/3 over dp x cp;
       offloading and fp32 master weights wrap that engine (memory/);
    6. pp > 1: my PipelineStage runs the schedule;
    7. my rows of every global batch are those of dp rank d (cp ranks keep their positions
       of them, tp ranks share them).
With pp > 1 (rank = (p dp + d) cp tp + ...), the pp groups hold the stages of one pipeline,
each stage cut from the same (seed, name) draw (pipeline.PipelineCut), its 2-rank link
groups carry activations and gradients (pipeline.make_links), the embedding group (first
and last stage) sums the tied wte's gradient, and the model group (pp x tp) sums norms.
With ep > 1 (expert parallelism, parallel/expert/) the dp axis is split into (edp, ep),
ep the faster: the ep groups (consecutive dp ranks) share the experts of each MoE layer,
E/ep each, and exchange tokens; an expert's gradient is summed over its replicas, the
ranks with the same ep coordinate (edp x cp), the dense ones over dp x cp as before.
Read next: parallel/micro_batching.py, parallel/data/ (the first engine), then train.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from minidist.memory.mixed_precision import MixedPrecision
from minidist.memory.offload import check_plan, offload_engine
from minidist.memory.precision import cast_parameters, plan_policy
from minidist.memory.precision import check_plan as check_precision
from minidist.nn import GPT, GPTConfig
from minidist.parallel.context.context_parallel import ALGOS as CP_ALGOS
from minidist.parallel.context.context_parallel import ContextParallel, apply_context
from minidist.parallel.context.context_parallel import LAYOUTS as CP_LAYOUTS
from minidist.parallel.data.buckets import BucketedDataParallel
from minidist.parallel.data.ddp import ALGOS, DataParallel
from minidist.parallel.data.diloco import DiLoCo
from minidist.parallel.data.onebit_adam import OneBitAdam
from minidist.parallel.data.powersgd import PowerSGD
from minidist.parallel.expert.expert_parallel import apply_experts, is_expert_parameter
from minidist.parallel.expert.expert_tensor import apply_expert_tensor
from minidist.parallel.pipeline.schedule_validate import validate
from minidist.parallel.pipeline.family import AUTOMATIC, SCHEDULES, chunks_of, make_schedule
from minidist.parallel.pipeline.schedules import PipelineSchedule, pieces_of
from minidist.parallel.pipeline.stage import PipelineCut, PipelineStage, make_links, split_layers
from minidist.parallel.sharding import ModelSharding
from minidist.parallel.tensor.tensor_parallel import TensorParallel, apply_tensor
from minidist.parallel.zero.engine import ZeroEngine
from minidist.parallel.zero.zeropp import WEIGHT_BITS, ZeroPlusPlus, parse_parts
from minidist.runtime.mesh import DeviceMesh


PARAM_GATHERS = ("model", "fp8")          # ZeRO-3's weight gathers: as stored, or E4M3


def _positive_int(value, minimum: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
        and value >= minimum


@dataclass(frozen=True)
class Plan:
    """How one training job is laid out over W = pp * dp * cp * tp ranks (ep divides dp).

    Pipeline: `schedule` is a name in family.SCHEDULES or a PipelineSchedule (e.g.
    from_csv) for pp stages and micro_batches; virtual_stages V (interleaved; default 2
    there, 1 otherwise); layers_per_stage: layer counts per virtual stage (default even);
    schedule_costs (F, B, W): the costs the searched schedules (zb-1p, zb-2p, zbv) are
    found for (default 1, 1, 1: at those ZB-1p and ZB-2p are ZB-H1 and ZB-H2).
    Mixed precision (memory/precision.py; dp and ZeRO only): precision "bf16", "fp16" or
    "fp8" makes the model hold a rounded copy and wraps the engine in mixed_precision.py's
    MixedPrecision; grad_reduce "low" stores and sums the gradients in that format.
    Offloading (memory/offload.py): offload "host" or "disk" moves the optimizer state (and
    ZeRO-3's parameter shards) off the device; offload_dir: the disk tier's root directory.
    Infrequent sync: local_steps H > 0 trains each dp replica alone for H steps, then takes
    DiLoCo's outer step (outer_lr, outer_momentum) on the replicas' mean progress
    (parallel/data/diloco.py): 1/H of DDP's bytes; not an exact method. onebit_warmup T > 0:
    Adam on summed gradients for T steps, then 1-bit compressed momentum with error feedback
    (parallel/data/onebit_adam.py): about 1/32 of DDP's bytes; not exact either.
    powersgd_rank r > 0: each gradient matrix summed as a rank-r factorisation with error
    feedback (parallel/data/powersgd.py): r (n + m) numbers for n x m.
    Hybrid sharding (HSDP): hsdp S > 0 shards ZeRO's state over groups of S dp ranks (the
    mesh's "shard" axis, the faster: inside a node) and replicates it over the dp / S
    groups ("replicate"): a gradient is reduce-scattered in its shard group, then its shard
    all-reduced over the replicas (parallel/zero/engine.py); 0: ZeRO over all dp ranks.
    ZeRO++ (parallel/zero/zeropp.py): zeropp L > 0 runs ZeRO-3 over all dp ranks seen as
    dp / L nodes of L ("replicate" x "shard", as HSDP lays them out) with zeropp_parts of
    qwZ (int8 weight all-gather), hpZ (the backward's gather inside the node) and qgZ (int4
    two-hop gradient reduce-scatter).
    The fast paths: algo "auto" reduces in rank order over shared memory ("direct",
    collectives/direct.py) where the group has it, and `buckets` makes DDP keep its
    gradients in shared-memory buckets (parallel/data/buckets.py); `textbook()` turns both
    off (ring reductions, one all-reduce per parameter) and `algorithms()` names those in use.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int = 1                        # experts' own tensor parallelism (folded)
    hsdp: int = 0                             # ZeRO sharded over this many dp ranks, 0: all
    zeropp: int = 0                           # ZeRO++ with nodes of this many dp ranks, 0: off
    zeropp_parts: str = "qwz,hpz,qgz"         # which of ZeRO++'s three collectives
    param_gather: str = "model"               # ZeRO-3's weight gathers: "model" dtype, "fp8"
    local_steps: int = 0                      # DiLoCo: sync every this many steps, 0: DDP
    outer_lr: float = 0.7                     # DiLoCo's outer Nesterov step
    outer_momentum: float = 0.9
    onebit_warmup: int = 0                    # 1-bit Adam after this many Adam steps, 0: off
    powersgd_rank: int = 0                    # PowerSGD of this rank, 0: off
    zero: int = 0
    micro_batches: int = 1
    sequence_parallel: bool = False
    async_tp: bool = False                    # SP's collectives overlapped with the matmuls
    cp_algo: str = "ring"                     # context parallelism: "ring" or "ulysses"
    cp_layout: str = "zigzag"                 # "zigzag" (balanced causal work) or "contiguous"
    bucket_bytes: int = 1 << 20
    algo: str = "auto"
    buckets: bool = True                      # DDP: the shared-memory bucket fast path
    overlap: bool = True
    replica_check_every: int = 0
    check_placements: bool | None = None     # None: MINIDIST_CHECK_PLACEMENTS decides
    schedule: str | PipelineSchedule = "1f1b"    # pipeline schedule (pp > 1)
    virtual_stages: int | None = None        # chunks per pp rank; None: 2 interleaved, else 1
    schedule_costs: tuple[float, float, float] | None = None   # F, B, W for zb-1p, zb-2p, zbv
    layers_per_stage: tuple[int, ...] | None = None
    precision: str = "fp32"                  # "fp32", "bf16", "fp16", "fp8" (memory/precision.py)
    fp8_recipe: str = "delayed"              # under fp8: memory/fp8_recipes.RECIPES
    grad_reduce: str = "fp32"                # gradients stored and summed in "fp32" or "low"
    offload: str = "none"                    # optimizer state on "none", "host", "disk"
    offload_dir: str | None = None           # disk: where the run's memmap files go

    def __post_init__(self) -> None:
        for field, minimum in (("dp", 1), ("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1),
                               ("expert_tp", 1), ("micro_batches", 1), ("bucket_bytes", 1),
                               ("replica_check_every", 0)):
            if not _positive_int(getattr(self, field), minimum):
                raise ValueError(f"Plan: {field}={getattr(self, field)!r} must be an int >= "
                                 f"{minimum}.")
        if self.dp % (self.ep * self.expert_tp):
            ex = self.ep * self.expert_tp
            what = f"ep={self.ep}" if self.expert_tp == 1 else \
                f"ep={self.ep} x expert_tp={self.expert_tp} = {ex}"
            raise ValueError(f"Plan: {what} must divide dp={self.dp}: the expert-"
                             "parallel ranks are data-parallel ranks that share the experts "
                             f"(Megatron's layout); use dp={-(-self.dp // ex) * ex} "
                             f"or another multiple of {ex}.")
        if not isinstance(self.schedule, PipelineSchedule) and self.schedule not in SCHEDULES:
            raise ValueError(f"Plan: schedule={self.schedule!r} must be one of {SCHEDULES} or a "
                             "schedules.PipelineSchedule (e.g. schedule_csv.from_csv(text)).")
        if self.virtual_stages is not None and (not _positive_int(self.virtual_stages, 1) or (
                self.virtual_stages > 1 and self.schedule != "interleaved")):
            raise ValueError(f"Plan: virtual_stages={self.virtual_stages!r} must be an int >= 1,"
                             " and > 1 only with schedule='interleaved'.")
        if self.schedule_costs is not None and (
                self.schedule not in AUTOMATIC or len(self.schedule_costs) != 3
                or not all(isinstance(c, (int, float)) and c > 0 for c in self.schedule_costs)):
            raise ValueError(f"Plan: schedule_costs={self.schedule_costs!r} must be three "
                             "positive numbers (F, B, W: a stage's forward, input gradient and "
                             f"weight gradient), and only with a searched schedule "
                             f"({', '.join(AUTOMATIC)}), not {self.schedule!r}.")
        if self.cp_algo not in CP_ALGOS or self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"Plan: cp_algo={self.cp_algo!r} must be one of {CP_ALGOS} and "
                             f"cp_layout={self.cp_layout!r} one of {CP_LAYOUTS}.")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"Plan: zero={self.zero!r} must be 0 (plain DDP), 1 (shard the "
                             "optimizer state), 2 (+ gradients) or 3 (+ parameters).")
        if self.algo not in ALGOS:
            raise ValueError(f"Plan: algo={self.algo!r} is unknown; use one of {ALGOS}.")
        if not _positive_int(self.local_steps, 0):
            raise ValueError(f"Plan: local_steps={self.local_steps!r} must be an int >= 0 "
                             "(0: sum the gradients every step).")
        if not _positive_int(self.powersgd_rank, 0):
            raise ValueError(f"Plan: powersgd_rank={self.powersgd_rank!r} must be an int >= "
                             "0 (0: no compression).")
        if not _positive_int(self.onebit_warmup, 0):
            raise ValueError(f"Plan: onebit_warmup={self.onebit_warmup!r} must be an int >= 0 "
                             "(0: no compression).")
        syncs = (("local_steps", "DiLoCo"), ("onebit_warmup", "1-bit Adam"),
                 ("powersgd_rank", "PowerSGD"))
        for i, (field, what) in enumerate(syncs):          # each engine replaces DDP's
            if not getattr(self, field):
                continue
            clash = [f"{name}={value}" for name, value, on in (
                ("zero", self.zero, self.zero > 0), ("pp", self.pp, self.pp > 1),
                ("cp", self.cp, self.cp > 1), ("ep", self.ep, self.ep > 1)) if on]
            clash += [f"{f}={getattr(self, f)}" for f, _ in syncs[:i] if getattr(self, f)]
            if clash:
                raise ValueError(f"Plan: {field}={getattr(self, field)} ({what}) runs on dp "
                                 f"(and tp) only, not with {', '.join(clash)}; use {field}=0.")
        if self.local_steps:
            if not (self.outer_lr > 0 and 0 <= self.outer_momentum < 1):
                raise ValueError(f"Plan: outer_lr={self.outer_lr} must be > 0 and "
                                 f"outer_momentum={self.outer_momentum} in [0, 1).")
        if not _positive_int(self.hsdp, 0):
            raise ValueError(f"Plan: hsdp={self.hsdp!r} must be an int >= 0 (0: shard over "
                             "every dp rank).")
        if self.hsdp:
            if not self.zero:
                raise ValueError(f"Plan: hsdp={self.hsdp} shards ZeRO's state, but zero=0 "
                                 "shards nothing; use zero=1, 2 or 3.")
            if self.dp % self.hsdp:
                fits = [s for s in range(1, self.dp + 1) if self.dp % s == 0]
                raise ValueError(f"Plan: hsdp={self.hsdp} must divide dp={self.dp} (shard "
                                 "groups of hsdp ranks, dp / hsdp replicas); use "
                                 + " or ".join(f"hsdp={s}" for s in fits[1:]) + ".")
            if self.cp > 1 or self.ep * self.expert_tp > 1:
                raise ValueError(f"Plan: hsdp={self.hsdp} with {'cp' if self.cp > 1 else 'ep'}"
                                 " > 1 is not built (the shard group would have to span the "
                                 "context or expert ranks too); use hsdp=0.")
        if self.param_gather not in PARAM_GATHERS:
            raise ValueError(f"Plan: param_gather={self.param_gather!r} must be one of "
                             f"{PARAM_GATHERS}.")
        if self.zeropp or self.param_gather != "model":
            self._check_zeropp()
        if self.zero and self.algo == "tree":
            raise ValueError("Plan: ZeRO needs a reduce-scatter, which the tree algorithm "
                             "does not have; use algo 'auto', 'direct', 'ring' or 'halving'.")
        for field in ("overlap", "sequence_parallel", "async_tp"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"Plan: {field}={getattr(self, field)!r} must be True or False.")
        if not (self.check_placements is None or isinstance(self.check_placements, bool)):
            raise ValueError(f"Plan: check_placements={self.check_placements!r} must be True, "
                             "False or None (None: the MINIDIST_CHECK_PLACEMENTS variable).")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Plan: sequence_parallel=True needs tp > 1 (it splits the "
                             "sequence over the tensor-parallel ranks); use tp=2 or more, or "
                             "sequence_parallel=False.")
        if self.async_tp and not self.sequence_parallel:
            raise ValueError("Plan: async_tp=True overlaps sequence parallelism's all-gather "
                             "and reduce-scatter with the matmuls; use sequence_parallel=True "
                             "(and tp > 1) with it.")
        self.policy()                            # validates precision and grad_reduce
        if self.fp8_recipe != "delayed" and self.precision != "fp8":
            raise ValueError(f"Plan: fp8_recipe={self.fp8_recipe!r} quantises GEMMs to fp8; "
                             f"precision={self.precision!r} has none. Use precision='fp8', or "
                             "drop the recipe.")
        if self.offload != "none" or self.offload_dir is not None:
            check_plan(self)                     # memory/offload.py owns its options

    def _check_zeropp(self) -> None:
        if not _positive_int(self.zeropp, 0) or (self.zeropp and self.dp % self.zeropp):
            raise ValueError(f"Plan: zeropp={self.zeropp!r} must be an int dividing dp="
                             f"{self.dp} (the dp ranks on one node; dp / zeropp nodes).")
        parse_parts(self.zeropp_parts)
        clash = [f"{name}={value}" for name, value, on in (
            ("hsdp", self.hsdp, self.hsdp), ("cp", self.cp, self.cp > 1),
            ("ep", self.ep * self.expert_tp, self.ep * self.expert_tp > 1),
            ("offload", self.offload, self.offload != "none")) if on]
        what = f"zeropp={self.zeropp}" if self.zeropp else f"param_gather={self.param_gather!r}"
        if self.zero != 3 or clash:
            raise ValueError(f"Plan: {what} changes ZeRO-3's collectives: it needs zero=3"
                             + (f" and is not built with {', '.join(clash)}"
                                if clash else f", not zero={self.zero}") + ".")

    def policy(self):
        """memory/precision.Policy of a mixed-precision Plan; None for fp32 (nothing changes)."""
        if self.precision == "fp32" and self.grad_reduce == "fp32":
            return None
        return plan_policy(self)

    @property
    def world_size(self) -> int:
        """Ranks the Plan needs: pp * dp * cp * tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def chunks(self) -> int:
        """Model chunks per pp rank: V (interleaved 1F1B; default 2), 2 (the V placement
        of zbv), else 1."""
        if isinstance(self.schedule, PipelineSchedule):
            return self.schedule.chunks
        return chunks_of(self.schedule, self.virtual_stages or 2)

    def pipeline_schedule(self) -> PipelineSchedule:
        """The schedule of the pipeline: the named one for (pp, micro_batches, V), or the
        user's PipelineSchedule."""
        if isinstance(self.schedule, PipelineSchedule):
            return self.schedule
        costs = None if self.schedule_costs is None else dict(zip("FBW", self.schedule_costs))
        return make_schedule(self.schedule, self.pp, self.micro_batches, self.chunks, costs)

    def mesh_axes(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(axes, sizes) of the mesh `build` makes, slowest first: (pp,) dp, cp, tp, with
        dp = (edp, ep, etp) under expert parallelism; rank = row-major index, so tp's ranks
        are neighbours (inside a node) and pp's the farthest apart (across nodes)."""
        axes = (("pp",) if self.pp > 1 else ()) + ("dp", "cp", "tp")
        shape = ((self.pp,) if self.pp > 1 else ()) + (self.dp, self.cp, self.tp)
        if self.hsdp or self.zeropp:                  # dp = (replicate, shard), shard fastest
            i, node = axes.index("dp"), self.hsdp or self.zeropp
            axes = axes[:i] + ("replicate", "shard") + axes[i + 1:]
            shape = shape[:i] + (self.dp // node, node) + shape[i + 1:]
        if self.ep * self.expert_tp > 1:              # dp = (edp, ep, etp), etp the fastest
            i = axes.index("dp")
            axes = axes[:i] + ("edp", "ep", "etp") + axes[i + 1:]
            shape = shape[:i] + (self.dp // (self.ep * self.expert_tp), self.ep,
                                 self.expert_tp) + shape[i + 1:]
        return axes, shape

    def group_ranks(self, rank: int = 0) -> dict[str, tuple[int, ...]]:
        """The global ranks of `rank`'s group on each mesh axis ("tp", "cp", "dp", "pp", and
        "ep", "etp", "edp" under expert parallelism; "grad": dp x cp, the gradient sync),
        as `build` lays them out: where each group lies on a topology of nodes."""
        axes, shape = self.mesh_axes()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Plan.group_ranks: rank={rank} is not in 0..{self.world_size - 1}.")
        grid = np.arange(self.world_size).reshape(shape)
        me = tuple(int(c) for c in np.argwhere(grid == rank)[0])

        def along(names: tuple[str, ...]) -> tuple[int, ...]:
            index = tuple(slice(None) if a in names else c for a, c in zip(axes, me))
            return tuple(int(r) for r in grid[index].reshape(-1))
        out = {a: along((a,)) for a in axes}
        dp_axes = tuple(a for a in ("replicate", "shard", "edp", "ep", "etp", "dp")
                        if a in axes)
        out["dp"] = along(dp_axes)
        out["grad"] = along(dp_axes + ("cp",))
        out.setdefault("pp", (rank,))
        return out

    def describe(self) -> str:
        """'pp=2 (1f1b) x dp=2 (ep=2) x cp=2 x tp=2 (SP)': the axes (pp, ep, cp when > 1)."""
        name = getattr(self.schedule, "name", self.schedule)
        pp = f"pp={self.pp} ({name}{f', V={self.chunks}' if self.chunks > 1 else ''}) x " \
            if self.pp > 1 else ""
        cp = f" x cp={self.cp} ({self.cp_algo})" if self.cp > 1 else ""
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        if self.expert_tp > 1:
            ep = f" (ep={self.ep}, expert-tp={self.expert_tp})"
        recipe = f" {self.fp8_recipe}" if self.precision == "fp8" else ""
        low = f", {self.precision}{recipe} (grads {self.grad_reduce})" \
            if self.policy() is not None else ""
        if self.hsdp:
            ep = f" (HSDP: shard {self.hsdp} x replicate {self.dp // self.hsdp})"
        if self.zeropp:
            ep = f" (ZeRO++ {self.zeropp_parts}: {self.dp // self.zeropp} nodes of " \
                f"{self.zeropp})"
        if self.param_gather == "fp8":
            low += ", fp8 weight gathers"
        sp = " (SP, async)" if self.async_tp else " (SP)" if self.sequence_parallel else ""
        return f"{pp}dp={self.dp}{ep}{cp} x tp={self.tp}{sp}{low}"

    def textbook(self) -> "Plan":
        """This plan with the plain algorithms a reader meets first: DDP with one all-reduce
        per parameter (parallel/data/ddp.py), every reduction by the ring (collectives/ring.py)."""
        return replace(self, algo="ring", buckets=False)

    def algorithms(self, shared_memory: bool = True) -> str:
        """The gradient sync and reduction algorithms this plan runs (on a runtime with
        shared memory, or without: MPI), each with the file that holds it."""
        algo = "direct" if self.algo == "auto" and shared_memory else self.algo
        where = {"direct": "in rank order (collectives/direct.py)",
                 "ring": "(collectives/ring.py)", "tree": "(collectives/tree.py)",
                 "halving": "(collectives/halving_doubling.py)",
                 "auto": "chosen by size (collectives/api.py)"}[algo]
        if self.powersgd_rank:
            sync = f"PowerSGD of rank {self.powersgd_rank} (parallel/data/powersgd.py)"
        elif self.onebit_warmup:
            sync = (f"1-bit Adam after {self.onebit_warmup} Adam steps "
                    "(parallel/data/onebit_adam.py)")
        elif self.local_steps:
            sync = (f"DiLoCo, an outer step every {self.local_steps} steps "
                    "(parallel/data/diloco.py)")
        elif self.zero:
            sync = f"ZeRO-{self.zero} (parallel/zero/engine.py)"
        elif self.buckets and shared_memory:
            sync = "DDP with shared-memory buckets (parallel/data/buckets.py)"
        else:
            sync = "DDP, one all-reduce per parameter (parallel/data/ddp.py)"
        return f"{sync} · {algo} reductions {where}"

    @property
    def checks(self) -> bool:
        """Placement checks on? (check_placements, else MINIDIST_CHECK_PLACEMENTS.)"""
        if self.check_placements is not None:
            return self.check_placements
        return os.environ.get("MINIDIST_CHECK_PLACEMENTS", "") not in ("", "0")

    def rows_per_micro_batch(self, global_batch: int) -> int:
        """B / (dp M), or ValueError saying how to fix a batch that does not split."""
        parts = self.dp * self.micro_batches
        if not _positive_int(global_batch, 1) or global_batch % parts:
            near = max(parts, (global_batch // parts) * parts) if _positive_int(
                global_batch, 1) else parts
            raise ValueError(
                f"global_batch={global_batch!r} does not split over dp={self.dp} ranks x "
                f"micro_batches={self.micro_batches} (= {parts} equal parts). Use a multiple "
                f"of {parts}, e.g. {near} or {near + parts}, or change dp / micro_batches.")
        return global_batch // parts

    def validate(self, cfg: GPTConfig, global_batch: int, seq_len: int) -> None:
        """ValueError, one line saying what to change, if the model or batch cannot split."""
        self.rows_per_micro_batch(global_batch)
        tp = self.tp
        if tp > 1 and cfg.n_head % tp:
            heads = [h for h in range(tp, cfg.n_embd + 1, tp) if cfg.n_embd % h == 0]
            fixes = [f"tp={max(d for d in range(1, tp) if cfg.n_head % d == 0)}"]
            fixes += [f"n_head={heads[0]}"] if heads else []
            raise ValueError(f"Plan: tp={tp} splits attention by heads, but n_head="
                             f"{cfg.n_head} is not a multiple of {tp}; use "
                             f"{' or '.join(fixes)}.")
        if tp > 1 and (cfg.mlp_ratio * cfg.n_embd) % tp:
            raise ValueError(f"Plan: tp={tp} splits the MLP's {cfg.mlp_ratio * cfg.n_embd} "
                             "hidden features, which do not divide; change n_embd or tp.")
        cp, chunks = self.cp, 2 * self.cp if self.cp_layout == "zigzag" else self.cp
        if cp > 1 and seq_len % chunks:
            contiguous = chunks > cp and seq_len % cp == 0   # suggested only where it divides
            raise ValueError(f"Plan: context parallelism ({self.cp_layout}) cuts the T="
                             f"{seq_len} positions into {chunks} equal chunks, which does not "
                             f"divide; use a sequence length that is a multiple of {chunks}"
                             + (", or cp_layout='contiguous'" if contiguous else "") + ".")
        if self.sequence_parallel and (seq_len // cp) % tp:
            raise ValueError(f"Plan: sequence parallelism splits the T={seq_len // cp} "
                             f"positions{' of each cp rank' if cp > 1 else ''} over tp={tp} "
                             "ranks, which does not divide; use a sequence length that is a "
                             f"multiple of {tp * cp}, or sequence_parallel=False.")
        if cp > 1 and self.cp_algo == "ulysses" and (cfg.n_head // tp) % cp:
            raise ValueError(f"Plan: Ulysses gives each cp rank n_head / (tp cp) heads, but "
                             f"n_head={cfg.n_head} does not split over tp={tp} x cp={cp}; "
                             "use cp_algo='ring', or an n_head that is a multiple of "
                             f"{tp * cp}.")
        if cfg.moe_every:
            self._validate_routing_groups(cfg, global_batch, seq_len)
        if self.expert_tp > 1 and not cfg.moe_every:
            raise ValueError(f"Plan: expert_tp={self.expert_tp} splits the experts of MoE "
                             "layers, but the model has none (moe_every=0); use moe_every=1.")
        width, etp = cfg.expert_hidden or cfg.mlp_ratio * cfg.n_embd, self.expert_tp
        if etp > 1 and width % etp:
            raise ValueError(f"Plan: expert_tp={etp} splits each expert's hidden width {width} "
                             f"into equal column pieces, and it does not divide; use "
                             f"expert_hidden={-(-width // etp) * etp} or an expert tp that "
                             f"divides {width}.")
        if self.ep > 1 and not cfg.moe_every:
            raise ValueError(f"Plan: ep={self.ep} splits the experts of MoE layers, but the "
                             f"model has none (moe_every=0); use moe_every=1 (every block a "
                             f"MoE) or 2 (every second).")
        if self.ep > 1 and cfg.n_experts % self.ep:
            raise ValueError(f"Plan: ep={self.ep} gives each rank n_experts / ep experts, but "
                             f"n_experts={cfg.n_experts} does not divide; use n_experts="
                             f"{-(-cfg.n_experts // self.ep) * self.ep}.")
        if self.pp > 1:
            self._validate_pipeline(cfg)
        if self.policy() is not None:
            check_precision(self, cfg)           # memory/precision.py owns its limits

    def _validate_routing_groups(self, cfg: GPTConfig, global_batch: int, seq_len: int) -> None:
        """ValueError unless every rank holds whole MoE routing groups (nn/moe.py): groups
        of G tokens inside a sequence chunk, or of G / T whole rows inside a micro-batch."""
        G, T, rows = cfg.routing_group, seq_len, self.rows_per_micro_batch(global_batch)
        chunks = (2 * self.cp if self.cp_layout == "zigzag" else self.cp) if self.cp > 1 else 1
        if self.sequence_parallel:
            raise ValueError("Plan: sequence parallelism of MoE blocks is not built (their "
                             "routing groups would be cut over tp); drop sequence_parallel.")
        if G <= T and (T // chunks) % G == 0 and T % chunks == 0:
            return
        if G % T == 0 and chunks == 1 and rows % (G // T) == 0:
            return
        where = f"context parallelism cuts each row into chunks of T / {chunks} = " \
            f"{T / chunks:g} positions" if chunks > 1 else \
            f"a rank's micro-batch holds {rows} rows of T={T} positions"
        raise ValueError(f"Plan: MoE routing groups of moe_group_size={G} tokens would be cut "
                         f"by this layout ({where}); use a group "
                         f"size dividing {T // chunks if T % chunks == 0 else T}, or a "
                         "multiple of T whose rows divide the rows per micro-batch.")

    def _validate_pipeline(self, cfg: GPTConfig) -> None:
        if self.zero == 3:
            raise ValueError("Plan: ZeRO-3 with pipeline parallelism is refused, as DeepSpeed "
                             "does: it would all-gather every unit again for the forward and "
                             "the backward of each of the M micro-batches. Use zero <= 2 "
                             "(they reduce once, after the stage's last backward).")
        s = self.pipeline_schedule()
        split_layers(cfg.n_layer, pieces_of(s.placement, self.pp, self.chunks),
                     self.layers_per_stage)
        if (s.stages, s.micro_batches) != (self.pp, self.micro_batches):
            raise ValueError(f"Plan: the schedule {s.name!r} is for P={s.stages} stages and "
                             f"M={s.micro_batches} micro-batches, the Plan has pp={self.pp} "
                             f"and micro_batches={self.micro_batches}.")
        validate(s)


@dataclass
class Layout:
    """What `build` hands one rank: its coordinates, groups and the three jobs' objects."""

    mesh: DeviceMesh | None                   # None on a one-rank job
    dp_group: object
    cp_group: object
    tp_group: object
    grad_group: object                        # gradient sync: dp x cp (dp when cp = 1)
    sharding: ModelSharding
    engine: object
    context: ContextParallel | None = None    # cp > 1: the cp group, algorithm and layout
    pp_group: object = None                   # pp > 1: the stages of my pipeline
    pipeline: PipelineStage | None = None     # pp > 1: my stage and its schedule
    ep_group: object = None                   # ep > 1: the ranks sharing the experts
    expert_group: object = None               # ep > 1: my experts' replicas (edp x cp)
    etp_group: object = None                  # expert_tp > 1: the ranks splitting my experts
    shard_group: object = None                # hsdp > 0: the dp ranks sharing my ZeRO shards
    replica_group: object = None              # hsdp > 0: the replicas of my shards

    @property
    def model(self):
        return self.sharding.model


def build(ctx, plan: Plan, cfg: GPTConfig, seed: int, *, optimizer: str, lr: float,
          weight_decay: float, betas: tuple[float, float], momentum: float) -> Layout:
    """COLLECTIVE over the world: the mesh, this rank's model shard and its engine (steps 2-6
    of the module docstring, in that order)."""
    W = getattr(ctx, "world_size", None)
    if W != plan.world_size:
        raise ValueError(f"Plan: {plan.describe()} = {plan.world_size} ranks, but the job "
                         f"has {W}. Spawn {plan.world_size} ranks or change the Plan.")
    groups = _groups(ctx, plan, cfg)                                    # 2. the mesh
    context = ContextParallel(groups["cp"], plan.cp_algo, plan.cp_layout) \
        if plan.cp > 1 else None
    sharding = parallelize(cfg, seed, plan, groups, context)           # 3. the model
    policy = plan.policy()
    if policy is not None:                        # 4. the model holds the low-precision copy
        cast_parameters(sharding.model, policy)
    opt = dict(optimizer=optimizer, lr=lr, weight_decay=weight_decay, betas=betas,
               momentum=momentum)
    engine = gradient_sync(sharding, plan, groups, opt)                # 5. the engine
    if plan.offload != "none":                    # memory/offload.py: state off the device
        offload_engine(engine, plan.offload, plan.offload_dir)
    if policy is not None:                        # fp32 master weights, loss scaling; an
        engine = MixedPrecision(engine, policy, ctx.world, **opt)   # inf anywhere skips all
    stage = None
    if plan.pp > 1:                                                     # 6. the schedule
        stage = PipelineStage(sharding.model, groups["cut"], groups["links"],
                              plan.pipeline_schedule(), sequence_shards=plan.tp,
                              sequence=plan.sequence_parallel, embed_group=groups["embed"],
                              mirror_group=groups["mirror"])
    return Layout(groups["mesh"], groups["dp"], groups["cp"], groups["tp"], groups["grad"],
                  sharding, engine, context, groups.get("pp"), stage, groups.get("ep"),
                  groups.get("edp"), groups.get("etp"), groups.get("shard"),
                  groups.get("replicate"))


def parallelize(cfg: GPTConfig, seed: int, plan: Plan, groups: dict,
                context: ContextParallel | None = None) -> ModelSharding:
    """This rank's model: the single process's GPT with each model-parallel axis applied.

    Every rank draws the whole GPT(cfg, seed), as baseline.py does, so a shard is the exact
    slice of the single process's parameter; then, in this order:
        tp > 1  apply_tensor   Megatron's column/row-parallel layers, vocab-parallel
                               embedding and loss, SP's LayerNorm (parallel/tensor/)
        cp > 1  apply_context  attention over the cp group, ring or Ulysses (parallel/context/)
        ep > 1  apply_experts  my E/ep experts of every MoE layer (parallel/expert/)
        pp > 1  cut            only my stage's layers (parallel/pipeline/stage.py)
    tp comes first because apply_context gives the (tensor-parallel) attention its core,
    and a MoE block stays whole over tp; the cut comes last, so each axis sees the whole
    model and every parameter keeps its global name.
    """
    model = GPT(cfg, seed)
    whole = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    algo = "direct" if plan.algo == "auto" and getattr(groups["tp"], "supports_shared",
                                                         False) else plan.algo
    tensor_parallel = TensorParallel(groups["tp"], plan.sequence_parallel,
                                     algo=algo if algo != "tree" else "ring", context=context,
                                     async_tp=plan.async_tp)
    if plan.tp > 1:
        apply_tensor(model, tensor_parallel)
    if context is not None:                       # every rank holds the whole weights
        apply_context(model, context)
    if plan.expert_tp > 1:
        apply_expert_tensor(model, groups["ep"], groups["etp"])
    elif plan.ep > 1:
        apply_experts(model, groups["ep"])
    cut = groups.get("cut")
    if cut is not None:
        cut.cut(model)
    return ModelSharding(model, whole, tensor_parallel, check=plan.checks, cut=cut,
                         pp=groups.get("pp"), model_group=groups.get("model"),
                         ep=groups.get("ep"), etp=groups.get("etp"),
                         experts_group=groups.get("emp", groups.get("ep")))


def gradient_sync(sharding: ModelSharding, plan: Plan, groups: dict, opt: dict):
    """The engine that sums gradients over dp x cp and steps the optimizer, chosen here:

        zero 0, groups with shared memory    BucketedDataParallel (parallel/data/buckets.py)
        zero 0, MPI                          DataParallel, one all-reduce per parameter
        local_steps H > 0                    DiLoCo (parallel/data/diloco.py)
        onebit_warmup T > 0                  OneBitAdam (parallel/data/onebit_adam.py)
        powersgd_rank r > 0                  PowerSGD (parallel/data/powersgd.py)
        zero 1, 2, 3                         ZeroEngine (parallel/zero/engine.py), over
                                             the shard group under HSDP (its replicas
                                             all-reduce the shards)
        zero 3 with zeropp L > 0             ZeroPlusPlus (parallel/zero/zeropp.py)
    Experts' gradients sum over their own replicas (edp x cp), the rest over dp x cp.
    Plan.textbook() turns the fast path off; Plan.algorithms() names the choice."""
    grad, edp = groups["grad"], groups.get("edp")
    if plan.powersgd_rank:
        return PowerSGD(sharding.model, grad, rank=plan.powersgd_rank, algo=plan.algo,
                        sharding=sharding, **opt)
    if plan.onebit_warmup:
        return OneBitAdam(sharding.model, grad, warmup=plan.onebit_warmup, algo=plan.algo,
                          sharding=sharding, **opt)
    if plan.local_steps:
        return DiLoCo(sharding.model, grad, local_steps=plan.local_steps,
                      outer_lr=plan.outer_lr, outer_momentum=plan.outer_momentum,
                      algo=plan.algo, sharding=sharding, **opt)
    if plan.zeropp or plan.param_gather == "fp8":     # one node of every dp rank without
        node, rail = (groups["shard"], groups["replicate"]) if plan.zeropp else \
            (grad, groups["alone"])                     # zeropp: fp8 weight gathers only
        parts = parse_parts(plan.zeropp_parts) if plan.zeropp else ("qwz",)
        bits = "e4m3" if plan.param_gather == "fp8" else WEIGHT_BITS
        return ZeroPlusPlus(sharding.model, grad, node, rail, parts=parts, weight_bits=bits,
                            algo=plan.algo, sharding=sharding, **opt)
    if plan.zero:
        experts = {"expert_group": edp} if edp is not None else {}
        hybrid = {"replica_group": groups["replicate"]} if plan.hsdp else {}
        return ZeroEngine(sharding.model, groups["shard"] if plan.hsdp else grad, plan.zero,
                          algo=plan.algo, sharding=sharding, **experts, **hybrid, **opt)
    group_of = {} if edp is None else {id(p): edp for n, p in zip(
        sharding.names, sharding.params) if is_expert_parameter(n)}
    buckets = plan.buckets and all(getattr(g, "supports_shared", False)
                                   for g in (grad, edp) if g is not None)
    return (BucketedDataParallel if buckets else DataParallel)(
        sharding.model, grad, bucket_bytes=plan.bucket_bytes, algo=plan.algo,
        overlap=plan.overlap, replica_check_every=plan.replica_check_every,
        sharding=sharding, group_of=group_of, **opt)


def group_count(plan: Plan, cfg: GPTConfig) -> int:
    """How many process groups `build` makes on a job of plan.world_size ranks, the world
    and `alone` included: `_groups` run against a stand-in job that only counts (no rank,
    no memory). The launcher sizes the job's group table with it (runtime/world.py)."""
    return 2 + _CountingJob(plan.world_size).count(lambda job: _groups(job, plan, cfg))


class _CountingJob:
    """A job of W ranks, seen from rank 0, whose new_group only counts the calls."""

    class Group:
        def __init__(self, ranks: tuple[int, ...]) -> None:
            self.ranks, self.size, self.rank = ranks, len(ranks), ranks.index(0)

    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank, self.calls = world_size, 0, 0
        self.alone = self.world = self.Group((0,))

    def new_group(self, ranks, name: str | None = None):
        self.calls += 1
        return self.Group(tuple(int(r) for r in ranks)) if 0 in ranks else None

    def count(self, make) -> int:
        make(self)
        return self.calls


def _groups(ctx, plan: Plan, cfg: GPTConfig) -> dict:
    """COLLECTIVE over the world: {"mesh", "dp", "cp", "tp", "grad" (dp x cp)}, with ep > 1
    "ep" and "edp" (x cp), with pp > 1 those of _pipeline_groups."""
    if plan.world_size == 1:                      # one rank: its world is every axis
        w = ctx.world
        return {"mesh": None, "dp": w, "cp": w, "tp": w, "grad": w, "alone": w}
    job = getattr(ctx, "job", ctx)
    axes, shape = plan.mesh_axes()
    experts = plan.ep * plan.expert_tp > 1
    mesh = DeviceMesh(job, axes, shape)
    dp_axes = ("edp", "ep", "etp") if experts else ("replicate", "shard") \
        if plan.hsdp or plan.zeropp else ("dp",)
    dp = mesh.flatten(dp_axes, "dp") if len(dp_axes) > 1 else mesh.group("dp")
    # the gradient sync gets a group of its own even when dp = 1, so that the cp
    # group's traffic (bytes_by_axis["cp"]) is attention and nothing else
    groups = {"mesh": mesh, "dp": dp, "cp": mesh.group("cp"), "tp": mesh.group("tp"),
              "alone": getattr(job, "alone", None),
              "grad": dp if plan.cp == 1 else mesh.flatten(dp_axes + ("cp",), "dp_cp")}
    if plan.hsdp or plan.zeropp:
        groups["shard"], groups["replicate"] = mesh.group("shard"), mesh.group("replicate")
    if experts:
        groups["ep"] = mesh.group("ep")
        groups["edp"] = mesh.group("edp") if plan.cp == 1 else \
            mesh.flatten(("edp", "cp"), "edp_cp")
        if plan.expert_tp > 1:                    # the experts' model-parallel ranks
            groups["etp"] = mesh.group("etp")
            groups["emp"] = mesh.flatten(("ep", "etp"), "ep_etp")
    if plan.pp > 1:
        groups.update(_pipeline_groups(job, mesh, plan, cfg))
    return groups


def _pipeline_groups(job, mesh: DeviceMesh, plan: Plan, cfg: GPTConfig) -> dict:
    """COLLECTIVE over the world: this rank's pp group, its stage's cut, the links, the
    model group (pp x tp: sums of norms) and the embedding group (first and last stage)."""
    P = plan.pp
    pp = mesh.group("pp")
    grid = mesh.grid.reshape(P, -1)                       # grid[s, line] = global rank
    placement = plan.pipeline_schedule().placement
    pieces = tuple(split_layers(cfg.n_layer, pieces_of(placement, P, plan.chunks),
                                plan.layers_per_stage))
    links = make_links(job, grid, P, plan.chunks, placement)
    model = pp if plan.tp == 1 else mesh.flatten(("pp", "tp"), "pp_tp")
    embed = None
    if cfg.tie_weights and placement == "loop":   # wte on the first and the last stage
        # (the V placement has both on stage 0: one wte, nothing to sum)
        for line in range(grid.shape[1]):
            g = pp if P == 2 else job.new_group((int(grid[0, line]), int(grid[-1, line])),
                                                name=f"embed{line}")
            if g is not None and job.rank in (grid[0, line], grid[-1, line]) and (
                    P > 2 or job.rank in pp.ranks):
                embed = g
    mirror = None
    if placement == "dual":                   # stage s and P-1-s hold the same pieces
        for line in range(grid.shape[1]):
            for s in range(P // 2):
                pair = (int(grid[s, line]), int(grid[P - 1 - s, line]))
                g = pp if P == 2 else job.new_group(pair, name=f"mirror{line}.{s}")
                if g is not None and job.rank in pair and (P > 2 or job.rank in pp.ranks):
                    mirror = g
    return {"pp": pp, "cut": PipelineCut(pp.rank, P, pieces, placement), "links": links,
            "model": model, "embed": embed, "mirror": mirror}
