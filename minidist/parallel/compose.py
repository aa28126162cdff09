"""Composition: a Plan lays W = dp x cp x tp ranks out on one mesh and builds the three jobs.

A training step is three separate jobs, each with its own module and its own groups
(DESIGN.md, "Composition"):
    1. model sharding   parallel/sharding.py   which slice of each parameter I hold (tp),
                                               which positions I hold (cp, context.py)
    2. gradient sync    parallel/data.py, zero.py   sum gradients over the replicas: every
                                               rank holding the same shard, dp x cp
    3. step schedule    parallel/schedules.py  who runs forward/backward of which micro-batch
`Plan` says how many ranks each axis gets; `build` makes one DeviceMesh with axes
(dp, cp, tp), tp the fastest (neighbouring ranks, as Megatron places tp inside a node,
then cp), and hands each job only the group it needs.

    mesh (dp=2, tp=2):   tp ->  0  1          tp groups {0,1} {2,3}: split each layer
                         dp     2  3          dp groups {0,2} {1,3}: same shard, other rows
With cp = 2 as well (8 ranks, coordinates (d, c, t), rank = 4 d + 2 c + t), the cp groups
{0,2} {1,3} {4,6} {5,7} hold the same rows at other positions, and the gradient-sync
groups dp x cp {0,2,4,6} {1,3,5,7} every replica of one tp shard (DeviceMesh.flatten).

One rank's view (global rank q, coordinates (d, c, t)):
    1. validate the Plan against the model and the batch (before any process starts);
    2. mesh = DeviceMesh(("dp", "cp", "tp"), (dp, cp, tp)): my dp, cp and tp groups, and
       the dp x cp group for the gradient sync;
    3. sharding = ModelSharding(cfg, seed, TensorParallel(tp group, sp), ContextParallel(cp
       group, algo, layout)): my shards, my attention over cp;
    4. engine = DataParallel or ZeroEngine over the dp x cp group, on my shards;
    5. my rows of every global batch are those of dp rank d (cp ranks keep their positions
       of them, tp ranks share them).
The axes pp and ep are part of the Plan's shape so later layouts plug in here; until
their issues land, a Plan with one of them > 1 is refused with a ValueError.
Read next: parallel/schedules.py, then train.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from minidist.nn import GPTConfig
from minidist.parallel.context import ALGOS as CP_ALGOS
from minidist.parallel.context import LAYOUTS as CP_LAYOUTS
from minidist.parallel.context import ContextParallel
from minidist.parallel.data import ALGOS, DataParallel
from minidist.parallel.sharding import ModelSharding
from minidist.parallel.tensor import TensorParallel
from minidist.runtime.mesh import DeviceMesh


def _positive_int(value, minimum: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
        and value >= minimum


@dataclass(frozen=True)
class Plan:
    """How one training job is laid out over W = dp * cp * tp ranks (pp, ep: later axes)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batches: int = 1
    sequence_parallel: bool = False
    cp_algo: str = "ring"                     # context parallelism: "ring" or "ulysses"
    cp_layout: str = "zigzag"                 # "zigzag" (balanced causal work) or "contiguous"
    bucket_bytes: int = 1 << 20
    algo: str = "auto"
    overlap: bool = True
    replica_check_every: int = 0
    check_placements: bool | None = None     # None: MINIDIST_CHECK_PLACEMENTS decides

    def __post_init__(self) -> None:
        for field, minimum in (("dp", 1), ("tp", 1), ("pp", 1), ("cp", 1), ("ep", 1),
                               ("micro_batches", 1), ("bucket_bytes", 1),
                               ("replica_check_every", 0)):
            if not _positive_int(getattr(self, field), minimum):
                raise ValueError(f"Plan: {field}={getattr(self, field)!r} must be an int >= "
                                 f"{minimum}.")
        for axis in ("pp", "ep"):
            if getattr(self, axis) != 1:
                raise ValueError(f"Plan: {axis}={getattr(self, axis)} is not built yet; this "
                                 f"minidist composes dp, ZeRO, tp (+ sequence parallelism) "
                                 f"and cp. Set {axis}=1.")
        if self.cp_algo not in CP_ALGOS or self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"Plan: cp_algo={self.cp_algo!r} must be one of {CP_ALGOS} and "
                             f"cp_layout={self.cp_layout!r} one of {CP_LAYOUTS}.")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"Plan: zero={self.zero!r} must be 0 (plain DDP), 1 (shard the "
                             "optimizer state), 2 (+ gradients) or 3 (+ parameters).")
        if self.algo not in ALGOS:
            raise ValueError(f"Plan: algo={self.algo!r} is unknown; use one of {ALGOS}.")
        if self.zero and self.algo == "tree":
            raise ValueError("Plan: ZeRO needs a reduce-scatter, which the tree algorithm "
                             "does not have; use algo 'auto', 'direct', 'ring' or 'halving'.")
        for field in ("overlap", "sequence_parallel"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"Plan: {field}={getattr(self, field)!r} must be True or False.")
        if not (self.check_placements is None or isinstance(self.check_placements, bool)):
            raise ValueError(f"Plan: check_placements={self.check_placements!r} must be True, "
                             "False or None (None: the MINIDIST_CHECK_PLACEMENTS variable).")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Plan: sequence_parallel=True needs tp > 1 (it splits the "
                             "sequence over the tensor-parallel ranks); set tp or drop SP.")

    @property
    def world_size(self) -> int:
        """Ranks the Plan needs: dp * cp * tp."""
        return self.dp * self.cp * self.tp

    def describe(self) -> str:
        """'dp=2 x cp=2 x tp=2 (SP)': the axes (cp only when > 1)."""
        cp = f" x cp={self.cp} ({self.cp_algo})" if self.cp > 1 else ""
        return f"dp={self.dp}{cp} x tp={self.tp}{' (SP)' if self.sequence_parallel else ''}"

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
            fix = f"n_head={heads[0]}" if heads else \
                f"an n_head that is a multiple of {tp} and divides n_embd (none divides " \
                f"n_embd={cfg.n_embd}: make n_embd a multiple of {tp} too)"
            raise ValueError(f"Plan: tp={tp} splits attention by heads, but n_head="
                             f"{cfg.n_head} is not a multiple of {tp}; use {fix}, or a tp "
                             f"dividing {cfg.n_head}.")
        if tp > 1 and (cfg.mlp_ratio * cfg.n_embd) % tp:
            raise ValueError(f"Plan: tp={tp} splits the MLP's {cfg.mlp_ratio * cfg.n_embd} "
                             "hidden features, which do not divide; change n_embd or tp.")
        if tp > 1 and cfg.moe_every:
            raise ValueError(f"Plan: tp={tp} with MoE blocks (moe_every={cfg.moe_every}) is "
                             "not built; use tp=1 for a MoE model.")
        cp, chunks = self.cp, 2 * self.cp if self.cp_layout == "zigzag" else self.cp
        if cp > 1 and seq_len % chunks:
            raise ValueError(f"Plan: context parallelism ({self.cp_layout}) cuts the T="
                             f"{seq_len} positions into {chunks} equal chunks, which does not "
                             f"divide; use a sequence length that is a multiple of {chunks}"
                             + (", or cp_layout='contiguous'" if chunks > cp else "") + ".")
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
        if cp > 1 and cfg.moe_every:
            raise ValueError("Plan: context parallelism of MoE blocks is not built (their "
                             "capacity is decided over the tokens a rank holds); use cp=1.")
        if self.zero == 3 and cfg.moe_every:
            raise ValueError("Plan: ZeRO-3 of MoE blocks is not built (their auxiliary loss "
                             "does not cross the gathered units); use zero <= 2.")


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

    @property
    def model(self):
        return self.sharding.model


def build(ctx, plan: Plan, cfg: GPTConfig, seed: int, *, optimizer: str, lr: float,
          weight_decay: float, betas: tuple[float, float], momentum: float) -> Layout:
    """COLLECTIVE over the world: the mesh, this rank's model shard and its engine."""
    W = getattr(ctx, "world_size", None)
    if W != plan.world_size:
        raise ValueError(f"Plan: {plan.describe()} = {plan.world_size} ranks, but the job "
                         f"has {W}. Spawn {plan.world_size} ranks or change the Plan.")
    if plan.world_size == 1:                      # one rank: its world is every axis
        mesh, dp, cp, tp, grad = None, ctx.world, ctx.world, ctx.world, ctx.world
    else:
        mesh = DeviceMesh(getattr(ctx, "job", ctx), ("dp", "cp", "tp"),
                          (plan.dp, plan.cp, plan.tp))
        dp, cp, tp = mesh.group("dp"), mesh.group("cp"), mesh.group("tp")
        # the gradient sync gets a group of its own even when dp = 1, so that the cp
        # group's traffic (bytes_by_axis["cp"]) is attention and nothing else
        grad = dp if plan.cp == 1 else mesh.flatten(("dp", "cp"), "dp_cp")
    context = ContextParallel(cp, plan.cp_algo, plan.cp_layout) if plan.cp > 1 else None
    algo = "direct" if plan.algo == "auto" and getattr(tp, "supports_shared", False) \
        else plan.algo
    tensor_parallel = TensorParallel(tp, plan.sequence_parallel,
                                     algo=algo if algo != "tree" else "ring", context=context)
    sharding = ModelSharding(cfg, seed, tensor_parallel, check=plan.checks, context=context)
    opt = dict(optimizer=optimizer, lr=lr, weight_decay=weight_decay, betas=betas,
               momentum=momentum)
    if plan.zero == 0:
        engine = DataParallel(sharding.model, grad, bucket_bytes=plan.bucket_bytes,
                              algo=plan.algo, overlap=plan.overlap,
                              replica_check_every=plan.replica_check_every,
                              sharding=sharding, **opt)
    else:
        from minidist.parallel.zero import ZeroEngine
        engine = ZeroEngine(sharding.model, grad, plan.zero, algo=plan.algo,
                            sharding=sharding, **opt)
    return Layout(mesh, dp, cp, tp, grad, sharding, engine, context)
