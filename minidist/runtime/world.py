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
parallel layers never use them: they are handed a group (DESIGN.md, SPMD).

Read next: runtime/mesh.py, runtime/launch.py
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import numpy as np

from minidist.runtime import call
from minidist.runtime.errors import CollectiveMismatch, rank_prefix
from minidist.runtime.group import ProcessGroup
from minidist.runtime.job import JobBoard
from minidist.runtime.shm import Arena, Ordering


def _env_num(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of the shared-memory runtime; defaults overridable by MINIDIST_* variables."""
    world_size: int
    timeout: float = field(default_factory=lambda: _env_num("MINIDIST_TIMEOUT", 60.0))
    group_bytes: int = field(default_factory=lambda: int(_env_num("MINIDIST_GROUP_BYTES", 2**30)))
    max_groups: int = field(default_factory=lambda: int(_env_num("MINIDIST_GROUPS", 64)))
    nslots: int = field(default_factory=lambda: int(_env_num("MINIDIST_SLOTS", 4)))
    slot_bytes: int = field(default_factory=lambda: int(_env_num("MINIDIST_SLOT_BYTES", 2**19)))

    def __post_init__(self):
        if self.timeout <= 0:
            raise ValueError(f"collective timeout must be > 0 s, got {self.timeout}")
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"MINIDIST_SLOT_BYTES={self.slot_bytes} must be a positive "
                             "multiple of 64 (so chunks never split an element)")
        if self.nslots < 1:
            raise ValueError(f"MINIDIST_SLOTS={self.nslots} must be >= 1")

    @property
    def spin(self) -> bool:
        """Busy-poll only when every rank can have a core of its own."""
        return self.world_size <= (os.cpu_count() or 1)

    def board_bytes(self) -> int:
        return 1 << 22 if self.world_size * self.max_groups < 4096 else 1 << 26

    def arena_bytes(self) -> int:
        return self.board_bytes() + self.max_groups * self.group_bytes


class Job:
    """One rank's view of the job (see the module docstring)."""

    def __init__(self, cfg: RuntimeConfig, arena: Arena, rank: int, launcher_pid: int,
                 lock=None):
        self.cfg, self.arena, self.rank = cfg, arena, rank
        self.board = JobBoard(arena.sub(cfg.board_bytes(), "job board"), cfg.world_size,
                              cfg.max_groups, launcher_pid)
        self.ordering = Ordering(lock)
        self.groups: list[ProcessGroup | None] = []
        self.group_names: dict[int, str] = {}
        self.world = self._create(tuple(range(cfg.world_size)), "world")

    def _create(self, ranks: tuple[int, ...], name: str) -> ProcessGroup | None:
        gid = len(self.groups)
        if gid >= self.cfg.max_groups:
            raise ValueError(f"{rank_prefix(self.rank, self.cfg.world_size)} cannot create "
                             f"group {name!r}: the job allows {self.cfg.max_groups} groups. "
                             "Set MINIDIST_GROUPS higher before launching.")
        region = self.arena.sub(self.cfg.group_bytes, f"group {name!r}")   # members or not
        self.group_names[gid] = name
        group = None
        if self.rank in ranks:
            group = ProcessGroup(gid=gid, name=name, ranks=ranks, global_rank=self.rank,
                                 world_size=self.cfg.world_size, board=self.board, arena=region,
                                 ordering=self.ordering, group_names=self.group_names,
                                 timeout=self.cfg.timeout, spin=self.cfg.spin,
                                 nslots=self.cfg.nslots, slot_bytes=self.cfg.slot_bytes)
        self.groups.append(group)
        return group

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
            self.world.barrier()
            for r in range(W):
                theirs = self.board.read_call(r, 0)       # stable: everyone is in this call
                if theirs is not None and not call.same_call(theirs, self.world.record):
                    raise CollectiveMismatch(
                        f"{rank_prefix(self.rank, W)} new_group({list(ranks)}, {name!r}) here, "
                        f"but rank {r} made [{call.describe(theirs, self.group_names)}]. "
                        "Every rank must create the same groups in the same order.")
            self.world.barrier()
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
    return current_job().cfg.world_size


def world() -> ProcessGroup:
    return current_job().world


def new_group(ranks, name: str | None = None) -> ProcessGroup | None:
    return current_job().new_group(ranks, name)
