"""The job as one rank sees it: its rank, the world group, and new groups.

Every rank process holds one `Job`: the shared arena it inherited from the
launcher, the job board, and the groups it has created. Groups are created
the way torch.distributed creates them: EVERY rank calls `new_group(ranks)`
with the same arguments in the same order, members and non-members alike.
That is what lets each rank carve the same region of the arena for each
group without any message (runtime/shm.py), and give the group the same id.
Non-members get None.

The module-level functions (`get_rank`, `get_world_size`, `world`,
`new_group`) read the process's current job, set once by the launcher (or by
`init()` for a one-rank job in a plain Python process). Collectives and
parallel layers never use them: they are handed a group (SPMD:
the same program on every rank, its group an argument).

Sizing the arena from the world size W (RuntimeConfig). Every group gets a
region of the same size, `group_bytes`, big enough for a W-rank group: its
mailboxes, W(W-1) channels of nslots = 4 slots (runtime/p2p.py), plus room
for shared() buffers (1 GiB, or 64 MiB per rank when W > 16). The slot size
is 512 KiB while the mailboxes fit in 512 MiB (W <= 16), then halves:
128 KiB for W = 24 and 32, 32 KiB for W = 64. The arena is the board plus
one such region per group of the job's table: MINIDIST_GROUPS, else 64 or what
the caller of spawn says it makes (the main job: parallel/compose.group_count,
up to 246 groups for W = 64): 64 GiB of address space for W = 2, 160 GiB for
W = 32, 290 GiB (64 groups) to 1.1 TiB (246) for W = 64, reserved but never
touched unless used (runtime/shm.py). Every group takes a region on every rank,
member or not, so that all ranks carve the same offsets; a group of one rank
(every one-rank mesh axis) is the job's `alone` and takes none. MINIDIST_GROUP_BYTES and MINIDIST_SLOT_BYTES, when set,
replace the computed sizes; a region too small for its mailboxes is an error
at group creation that names the bytes needed.

Memory per rank: its process (about 4-5 MB private after the fork, measured
for W = 2..64), plus the arena pages it touches. Per group, those are at most
(W - 1) outgoing channels x nslots x slot_bytes: 30 MiB for W <= 16, 15.5 MiB
for W = 32, 8 MiB for W = 64 (an all_to_all of 1 MiB per peer touches exactly
that: 497 MiB of shared memory in all for W = 32, 509 MiB for W = 64),
plus its shared() buffers, and a few KiB of the board. A hello job (barrier,
all_reduce, a 2-D mesh) touches 1.4 MiB in all for W = 64, and 64 ranks fit
in well under 1 GiB.

Read next: runtime/mesh.py, runtime/launch.py
"""

from __future__ import annotations

import math
import mmap
import os
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from minidist.runtime.doorbell import Doorbells
from minidist.runtime.errors import CollectiveMismatch, rank_prefix
from minidist.runtime.group import ProcessGroup
from minidist.runtime.job import JobBoard, RankHealth
from minidist.runtime.nodes import Nodes
from minidist.runtime.shm import MAP_NORESERVE, Arena, Ordering


SLOT_BYTES = 1 << 19             # default slot size, 512 KiB, while a group's...
MAILBOX_BYTES = 1 << 29          # ...W(W-1) channels x nslots slots fit in 512 MiB
MIN_SLOT_BYTES = 1 << 12
DATA_BYTES = 1 << 30             # per group for shared() regions: 1 GiB,
DATA_BYTES_PER_RANK = 1 << 26    # or 64 MiB per rank when that is more
PAGE = 1 << 12


def _env_num(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give one") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}={raw!r} must be a finite number; unset it or give one")
    return value


def _env_int(name: str, default: int | None) -> int | None:
    value = _env_num(name, default)
    return None if value is None else int(value)


def default_slot_bytes(world_size: int, nslots: int) -> int:
    """512 KiB, halved until a W-rank group's W(W-1) channels of `nslots` slots fit in
    MAILBOX_BYTES (W <= 16: 512 KiB; 24 and 32: 128 KiB; 64: 32 KiB), at least 4 KiB."""
    slot, channels = SLOT_BYTES, world_size * (world_size - 1)
    while slot > MIN_SLOT_BYTES and channels * nslots * slot > MAILBOX_BYTES:
        slot //= 2
    return slot


def default_group_bytes(world_size: int, nslots: int, slot_bytes: int) -> int:
    """A group region big enough for a W-rank group's mailboxes plus its shared() data."""
    fixed = ProcessGroup.region_bytes(world_size, nslots, slot_bytes)
    data = max(DATA_BYTES, world_size * DATA_BYTES_PER_RANK)
    return -(-(fixed + data) // PAGE) * PAGE


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of the shared-memory runtime; defaults overridable by MINIDIST_* variables.
    group_bytes and slot_bytes left unset (None) are sized from the world size."""
    world_size: int
    timeout: float = field(default_factory=lambda: _env_num("MINIDIST_TIMEOUT", 60.0))
    group_bytes: int | None = field(
        default_factory=lambda: _env_int("MINIDIST_GROUP_BYTES", None))
    max_groups: int = field(default_factory=lambda: _env_int("MINIDIST_GROUPS", 64))
    nslots: int = field(default_factory=lambda: _env_int("MINIDIST_SLOTS", 4))
    slot_bytes: int | None = field(default_factory=lambda: _env_int("MINIDIST_SLOT_BYTES", None))
    nodes: Nodes | None = field(default_factory=Nodes.from_env)   # emulated nodes, or None

    def __post_init__(self):
        W = self.world_size
        if self.timeout <= 0:
            raise ValueError(f"collective timeout must be > 0 s, got {self.timeout}")
        if self.nslots < 1:
            raise ValueError(f"MINIDIST_SLOTS={self.nslots} must be >= 1")
        if self.max_groups < 2:
            raise ValueError(f"MINIDIST_GROUPS={self.max_groups} must be >= 2 (the world "
                             "and each rank alone are groups)")
        if self.nodes is not None:
            self.nodes.check(W)
        if self.slot_bytes is None:
            object.__setattr__(self, "slot_bytes", default_slot_bytes(W, self.nslots))
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"MINIDIST_SLOT_BYTES={self.slot_bytes} must be a positive "
                             "multiple of 64 (so chunks never split an element)")
        if self.group_bytes is None:
            object.__setattr__(self, "group_bytes",
                               default_group_bytes(W, self.nslots, self.slot_bytes))
        need = ProcessGroup.region_bytes(W, self.nslots, self.slot_bytes)
        if self.group_bytes < need:          # the world group must fit: say it before launch
            raise ValueError(f"MINIDIST_GROUP_BYTES={self.group_bytes} is too small: the world "
                             f"group of {W} ranks needs {need} B for its mailboxes ({W * (W - 1)} "
                             f"channels x {self.nslots} slots x {self.slot_bytes} B, plus "
                             f"headers); set it to at least {need}, or unset it (sized from "
                             "the world size)")

    @property
    def spin(self) -> bool:
        """Busy-poll only when every rank can have a core of its own."""
        return self.world_size <= (os.cpu_count() or 1)

    def board_bytes(self) -> int:
        return -(-JobBoard.nbytes(self.world_size, self.max_groups) // PAGE) * PAGE

    def arena_bytes(self) -> int:
        return self.board_bytes() + self.max_groups * self.group_bytes


class Job:
    """One rank's view of the job (see the module docstring)."""

    def __init__(self, cfg: RuntimeConfig, arena: Arena, rank: int, launcher_pid: int,
                 lock=None, bells: Sequence[int] | None = None):
        self.cfg, self.arena, self.rank = cfg, arena, rank
        self.board = JobBoard(arena.sub(cfg.board_bytes(), "job board"), cfg.world_size,
                              cfg.max_groups, launcher_pid)
        self.bells = None if bells is None else Doorbells(bells, self.board.sleeping, rank)
        self.ordering = Ordering(lock)
        self.health = RankHealth(self.board, rank)
        self.groups: list[ProcessGroup | None] = []
        self.group_names: dict[int, str] = {}
        self.world = self._create(tuple(range(cfg.world_size)), "world")
        self.alone = self._alone()

    def _alone(self) -> ProcessGroup:
        """This rank by itself, the group of every mesh axis of size one (gid 1 on every
        rank, each rank its own). Nothing is ever sent in it, so it takes no region of
        the shared arena: its mailboxes and shared() buffers live in a private mapping of
        this process (reserved, touched only if used), and making it is no collective.
        A mesh with one-rank axes therefore makes no group per rank for them: dp = 64
        needs the world, this and one dp group, not three groups of 64 one-rank groups."""
        gid = len(self.groups)
        self.group_names[gid] = "alone"
        private = mmap.mmap(-1, self.cfg.group_bytes, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
        group = ProcessGroup(gid=gid, name="alone", ranks=(self.rank,), global_rank=self.rank,
                             world_size=self.cfg.world_size, board=self.board,
                             arena=Arena(self.cfg.group_bytes, private), ordering=self.ordering,
                             group_names=self.group_names, timeout=self.cfg.timeout,
                             spin=self.cfg.spin, nslots=self.cfg.nslots,
                             slot_bytes=self.cfg.slot_bytes, health=self.health)
        self.groups.append(group)
        return group

    def _create(self, ranks: tuple[int, ...], name: str) -> ProcessGroup | None:
        gid = len(self.groups)
        if gid >= self.cfg.max_groups:
            raise ValueError(f"{rank_prefix(self.rank, self.cfg.world_size)} cannot create "
                             f"group {name!r}: the job allows {self.cfg.max_groups} groups. "
                             "Set MINIDIST_GROUPS higher before launching.")
        self._check_fits(ranks, name)
        hint = (f"Raise MINIDIST_GROUP_BYTES (now {self.cfg.group_bytes} B per group) "
                "before launching.")
        region = self.arena.sub(self.cfg.group_bytes, f"group {name!r}", hint)  # members or not
        self.group_names[gid] = name
        group = None
        if self.rank in ranks:
            group = ProcessGroup(gid=gid, name=name, ranks=ranks, global_rank=self.rank,
                                 world_size=self.cfg.world_size, board=self.board, arena=region,
                                 ordering=self.ordering, group_names=self.group_names,
                                 timeout=self.cfg.timeout, spin=self.cfg.spin,
                                 nslots=self.cfg.nslots, slot_bytes=self.cfg.slot_bytes,
                                 health=self.health, bells=self.bells, nodes=self.cfg.nodes)
        self.groups.append(group)
        return group

    def _check_fits(self, ranks: tuple[int, ...], name: str) -> None:
        """A group's region must hold its mailboxes: say so, with the numbers, if not."""
        c, n = self.cfg, len(ranks)
        need = ProcessGroup.region_bytes(n, c.nslots, c.slot_bytes)
        if need > c.group_bytes:
            raise MemoryError(
                f"{rank_prefix(self.rank, c.world_size)} shared arena too small: group "
                f"{name!r} of {n} ranks needs {need} B for its mailboxes ({n * (n - 1)} "
                f"channels x {c.nslots} slots x {c.slot_bytes} B, plus headers) but "
                f"MINIDIST_GROUP_BYTES={c.group_bytes} gives each group {c.group_bytes} B. "
                f"Raise MINIDIST_GROUP_BYTES to at least {need} (unset, it is sized from the "
                "world size), or lower MINIDIST_SLOT_BYTES or MINIDIST_SLOTS.")

    def new_group(self, ranks, name: str | None = None) -> ProcessGroup | None:
        """COLLECTIVE over the world: every rank calls it with the same ranks."""
        W = self.cfg.world_size
        ranks = tuple(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < W for r in ranks):
            raise ValueError(f"new_group: ranks {list(ranks)} must be distinct global ranks "
                             f"in 0..{W - 1}, at least one")
        name = name or f"group{len(self.groups)}"
        key = zlib.crc32(repr((ranks, name)).encode()) & 0x7FFFFFFF
        with self.world.collective("new_group", np.asarray(ranks), root=key):
            try:                          # the barrier compares every rank's call (group.py)
                self.world.barrier()
            except CollectiveMismatch as e:
                raise CollectiveMismatch(
                    f"{rank_prefix(self.rank, W)} new_group({list(ranks)}, {name!r}) here, but "
                    f"{str(e).split(' but ', 1)[-1].split('. Every', 1)[0]}. Every rank must "
                    "create the same groups in the same order.") from None
        return self._create(ranks, name)


_JOB: Job | None = None


def set_job(job: Job | None) -> None:
    global _JOB
    _JOB = job


def current_job() -> Job:
    if _JOB is None:
        raise RuntimeError("minidist is not initialised in this process: run under "
                           "`spawn(...)` or `python -m minidist run -n N script.py`, or call "
                           "minidist.init() for a one-rank job.")
    return _JOB


def is_initialized() -> bool:
    return _JOB is not None


def get_rank() -> int:
    return current_job().rank


def get_world_size() -> int:
    job = current_job()                 # a Job, or under mpiexec an MpiContext
    return job.cfg.world_size if hasattr(job, "cfg") else job.world_size


def world() -> ProcessGroup:
    return current_job().world


def new_group(ranks, name: str | None = None) -> ProcessGroup | None:
    return current_job().new_group(ranks, name)
