"""Device mesh: the world laid out as an n-dimensional grid with named axes.

A mesh with axes ("dp", "tp") and shape (2, 3) numbers the 6 ranks row-major,
last axis fastest, exactly like a NumPy array `np.arange(6).reshape(2, 3)`:

    tp ->   0  1  2
    dp      3  4  5

Along each axis, the ranks that differ only in that coordinate form one
group: here the tp groups are {0,1,2} and {3,4,5} (named tp0, tp1), the dp
groups {0,3}, {1,4}, {2,5} (dp0, dp1, dp2). A rank belongs to exactly one
group per axis; `mesh.group("tp")` is this rank's. Parallel layers receive
these groups and never the mesh itself. An axis of size one makes no groups:
its group is the job's `alone` (this rank by itself, runtime/world.py), so a
mesh of W ranks with k axes longer than one makes only those axes' groups.

The fastest axis holds neighbouring ranks: put the axis that talks most (tp)
last, as Megatron does, so that on a real cluster it stays inside a node.

Cost: creating the mesh is a sequence of `new_group` calls (all ranks, same
order), one per group of every axis longer than one; no data moves.

Read next: collectives/
"""

from __future__ import annotations

import numpy as np

from minidist.runtime.group import ProcessGroup
from minidist.runtime.world import Job


class DeviceMesh:
    """Named axes over the world; `group(axis)` gives this rank's group on that axis."""

    def __init__(self, job: Job, axes: tuple[str, ...] | list[str], shape: tuple[int, ...]):
        """job: the Job of a spawned rank (ctx.job), or anything with rank, world_size and
        new_group (runtime/mpi.py's MpiContext)."""
        axes, shape = tuple(axes), tuple(int(s) for s in shape)
        W = job.cfg.world_size if hasattr(job, "cfg") else job.world_size
        if len(axes) != len(shape) or len(set(axes)) != len(axes) or not axes:
            raise ValueError(f"DeviceMesh: axes {axes} and shape {shape} must have the same, "
                             "non-zero length and distinct names")
        if any(s < 1 for s in shape) or int(np.prod(shape)) != W:
            raise ValueError(f"DeviceMesh: shape {shape} has {int(np.prod(shape))} ranks but "
                             f"the world has {W}; choose sizes whose product is {W}.")
        self.axes, self.shape, self.rank, self._job = axes, shape, job.rank, job
        self.grid = np.arange(W).reshape(shape)                     # grid[coords] = global rank
        self.coords = dict(zip(axes, (int(c) for c in np.argwhere(self.grid == job.rank)[0])))
        self._groups: dict[str, ProcessGroup] = {}
        for a, axis in enumerate(axes):
            if shape[a] == 1 and hasattr(job, "alone"):     # this rank alone: no new group
                self._groups[axis] = job.alone
                continue
            lines = np.moveaxis(self.grid, a, -1).reshape(-1, shape[a])   # one row per group
            for i, ranks in enumerate(lines):
                g = job.new_group(tuple(int(r) for r in ranks), name=f"{axis}{i}")
                if g is not None:
                    self._groups[axis] = g

    def flatten(self, axes: tuple[str, ...], name: str) -> ProcessGroup:
        """COLLECTIVE over the world (same arguments on every rank): this rank's group of
        every rank that differs from it only along `axes`, e.g. ("dp", "cp"): all ranks
        holding a replica of the same tensor-parallel shard. Ranks in row-major order."""
        if not axes or any(a not in self.axes for a in axes) or len(set(axes)) != len(axes):
            raise ValueError(f"DeviceMesh.flatten: axes {axes} must be distinct axes of "
                             f"{self.axes}")
        picked = [self.axes.index(a) for a in axes]
        rest = [i for i in range(len(self.axes)) if i not in picked]
        size = int(np.prod([self.shape[i] for i in picked]))
        if size == 1 and hasattr(self._job, "alone"):
            return self._job.alone
        mine = None
        for i, ranks in enumerate(np.transpose(self.grid, rest + picked).reshape(-1, size)):
            g = self._job.new_group(tuple(int(r) for r in ranks), name=f"{name}{i}")
            if g is not None:
                mine = g
        return mine

    def group(self, axis: str) -> ProcessGroup:
        if axis not in self._groups:
            raise ValueError(f"DeviceMesh has no axis {axis!r}; its axes are {self.axes}")
        return self._groups[axis]

    def size(self, axis: str) -> int:
        return self.group(axis).size

    def coord(self, axis: str) -> int:
        """This rank's index along `axis` (equal to its rank in that axis's group)."""
        return self.group(axis).rank

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))
        return f"DeviceMesh({dims}; rank {self.rank} at {self.coords})"
