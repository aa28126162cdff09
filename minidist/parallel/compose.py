"""Composition: a Plan lays W = dp x tp ranks out on one device mesh and builds the three jobs.

A training step is three separate jobs, each with its own module and its own groups
(DESIGN.md, "Composition"):
    1. model sharding   parallel/sharding.py   which slice of each parameter I hold (tp)
    2. gradient sync    parallel/data.py, zero.py   sum gradients over the replicas (dp)
    3. step schedule    parallel/schedules.py  who runs forward/backward of which micro-batch
`Plan` says how many ranks each axis gets; `build` makes one DeviceMesh with tp as the
fastest axis (neighbouring ranks, as Megatron places tp inside a node) and hands each
job only the group it needs.

    mesh (dp=2, tp=2):   tp ->  0  1          tp groups {0,1} {2,3}: split each layer
                         dp     2  3          dp groups {0,2} {1,3}: same shard, other rows

One rank's view (global rank q, coordinates (d, t) = divmod(q, tp)):
    1. validate the Plan against the model and the batch (before any process starts);
    2. mesh = DeviceMesh(("dp", "tp"), (dp, tp)): my dp group and my tp group;
    3. sharding = ModelSharding(cfg, seed, TensorParallel(tp group, sp)): my shards;
    4. engine = DataParallel or ZeroEngine over the dp group, on my shards;
    5. my rows of every global batch are those of dp rank d (tp ranks share them).
The axes pp, cp and ep are part of the Plan's shape so later layouts plug in here; until
their issues land, a Plan with one of them > 1 is refused with a ValueError.
Read next: parallel/schedules.py, then train.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from minidist.nn import GPTConfig
from minidist.parallel.data import ALGOS, DataParallel
from minidist.parallel.sharding import ModelSharding
from minidist.parallel.tensor import TensorParallel
from minidist.runtime.mesh import DeviceMesh


def _positive_int(value, minimum: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
        and value >= minimum


@dataclass(frozen=True)
class Plan:
    """How one training job is laid out over W = dp * tp ranks (pp, cp, ep: later axes)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batches: int = 1
    sequence_parallel: bool = False
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
        for axis in ("pp", "cp", "ep"):
            if getattr(self, axis) != 1:
                raise ValueError(f"Plan: {axis}={getattr(self, axis)} is not built yet; this "
                                 f"minidist composes dp, ZeRO and tp (+ sequence parallelism)."
                                 f" Set {axis}=1.")
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
        """Ranks the Plan needs: dp * tp."""
        return self.dp * self.tp

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
        if self.sequence_parallel and seq_len % tp:
            raise ValueError(f"Plan: sequence parallelism splits the T={seq_len} positions "
                             f"over tp={tp} ranks, which does not divide; use a sequence "
                             f"length that is a multiple of {tp}, or sequence_parallel=False.")
        if self.zero == 3 and cfg.moe_every:
            raise ValueError("Plan: ZeRO-3 of MoE blocks is not built (their auxiliary loss "
                             "does not cross the gathered units); use zero <= 2.")


@dataclass
class Layout:
    """What `build` hands one rank: its coordinates, groups and the three jobs' objects."""

    mesh: DeviceMesh | None                   # None on a one-rank job
    dp_group: object
    tp_group: object
    sharding: ModelSharding
    engine: object

    @property
    def model(self):
        return self.sharding.model


def build(ctx, plan: Plan, cfg: GPTConfig, seed: int, *, optimizer: str, lr: float,
          weight_decay: float, betas: tuple[float, float], momentum: float) -> Layout:
    """COLLECTIVE over the world: the mesh, this rank's model shard and its engine."""
    W = getattr(ctx, "world_size", None)
    if W != plan.world_size:
        raise ValueError(f"Plan: dp={plan.dp} x tp={plan.tp} = {plan.world_size} ranks, but "
                         f"the job has {W}. Spawn {plan.world_size} ranks or change the Plan.")
    if plan.world_size == 1:                      # one rank: its world is every axis
        mesh, dp, tp = None, ctx.world, ctx.world
    else:
        mesh = DeviceMesh(getattr(ctx, "job", ctx), ("dp", "tp"), (plan.dp, plan.tp))
        dp, tp = mesh.group("dp"), mesh.group("tp")
    algo = "direct" if plan.algo == "auto" and getattr(tp, "supports_shared", False) \
        else plan.algo
    tensor_parallel = TensorParallel(tp, plan.sequence_parallel,
                                     algo=algo if algo != "tree" else "ring")
    sharding = ModelSharding(cfg, seed, tensor_parallel, check=plan.checks)
    opt = dict(optimizer=optimizer, lr=lr, weight_decay=weight_decay, betas=betas,
               momentum=momentum)
    if plan.zero == 0:
        engine = DataParallel(sharding.model, dp, bucket_bytes=plan.bucket_bytes,
                              algo=plan.algo, overlap=plan.overlap,
                              replica_check_every=plan.replica_check_every,
                              sharding=sharding, **opt)
    else:
        from minidist.parallel.zero import ZeroEngine
        engine = ZeroEngine(sharding.model, dp, plan.zero, algo=plan.algo, sharding=sharding,
                            **opt)
    return Layout(mesh, dp, tp, sharding, engine)
