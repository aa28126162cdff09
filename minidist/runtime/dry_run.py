"""A dry run's transport: one rank runs its real code, nothing moves, every call is counted.

A dry run answers "what would rank R of a W-rank job hold and send?" without W processes.
Rank R runs its real training code in one process against a `DryContext` of W ranks: the
same mesh, the same groups, the same collectives with the same algorithms, on a transport
that moves no data. Every byte the real transport would count, this one counts the same
way, and every call is kept: (step, group, op, algorithm, bytes). W can be 4096 on a laptop:
only this rank's groups exist as objects, and a shared region is one rank's bytes, not W's.

What is exact, and why:
    bytes and calls   the algorithms (collectives/) run unchanged and pick the same
                      algorithm (collectives/api.py asks `supports_shared`, so a group here
                      offers `shared` exactly where the real transport does; a choice the
                      cost formulas make follows this machine's calibration, as a real run
                      here does); the counts follow runtime/p2p.py (a send counts x.nbytes
                      and one message, a recv out.nbytes, a sendrecv both) and
                      collectives/direct*.py count their own reads, through the same `stats`.
    memory            the same arrays are made, in the same order, with the same layout:
                      memory/ledger.py counts them as in a real run, shared regions included
                      (a private mapping of the same size stands for the shared one). The
                      layout matters: sendrecv's out takes a C-contiguous x's layout, as
                      group.py's does, since a later reshape makes a view or a new buffer
                      depending on it.
What is not: the values. A message carries nothing, so a rank sees "every peer holds what I
hold":
    send              counts, and forgets x;
    recv              fills `out` with zeros (without combine: never uninitialised memory,
                      which could hold NaN), or leaves `out` as it is (with combine: the
                      reduction is not applied, so values stay finite over any W);
    sendrecv          copies x into out where dtype and size agree (what I send is what I
                      get: an all-to-all's counts stay consistent), zeros elsewhere;
    shared            every peer's region IS mine (stride 0): a direct fold reads my own
                      bytes W times; W copies of a finite number stay finite;
    barrier, drain    return at once; submit runs its call inline (like runtime/mpi.py).
So any decision taken from other ranks' values is this rank's guess, not the real run's: the
caller must refuse such features or state the assumption (train_dry_run.py refuses expert
parallelism, whose token counts come from the other ranks' routing, the deterministic mode,
whose gradient tree is built from nodes the ranks exchange, fp16's overflow vote, the spike
guard and the straggler handler, and says that MoE routing follows its own values).

One rank's view:
    1. ctx = DryContext(rank=R, world_size=W): the world group and R's `alone`;
    2. run the rank's code with ctx: new_group(ranks, name) numbers every group as the
       real job does and returns R's DryGroup (None where R is not a member); each call
       on it counts bytes in `stats` and appends a Call to ctx.calls, labelled ctx.step;
    3. read ctx.calls and each group's stats.
Cost: a call costs its algorithm's Python and local copies; a group costs O(its size).
Read next: train_dry_run.py (the command), runtime/mpi.py (the other transport).
"""

from __future__ import annotations

import mmap
import time
from collections import namedtuple
from typing import Any, Callable

import numpy as np

from minidist.runtime.errors import rank_prefix
from minidist.runtime.group import SharedBuffer, Work
from minidist.runtime.shm import ALIGN, MAP_NORESERVE, Arena

# One call of this rank: the step it ran in (ctx.step: None outside the steps), the group's
# name, the op and algorithm of its header scope ("send", ""), the header array's bytes, and
# the bytes it counted as sent and received.
Call = namedtuple("Call", "step group op algo nbytes sent recv")


class DryGroup:
    """This rank's handle on a group of the dry job: the ProcessGroup interface
    (runtime/group.py), moving nothing (see the module docstring)."""

    def __init__(self, ctx: "DryContext", name: str, gid: int, ranks: tuple[int, ...]):
        self.ctx, self.name, self.gid, self.ranks = ctx, name, gid, ranks
        self.rank, self.size = ranks.index(ctx.rank), len(ranks)
        self.supports_shared = ctx.shared_memory
        self.group_names = ctx.group_names
        self.prefix = rank_prefix(ctx.rank, ctx.world_size)
        self.stats = {"bytes_sent": 0, "bytes_recv": 0, "messages_sent": 0, "seconds": 0.0}
        self.prepared: dict = {}          # collectives/api.py's validated calls, by signature
        self._buffers: dict[str, SharedBuffer] = {}

    def __repr__(self) -> str:
        return f"DryGroup({self.name!r}, rank {self.rank} of {self.size})"

    # --- point to point: counted as runtime/p2p.py counts, nothing moved ---
    def send(self, x: np.ndarray, dst: int) -> None:
        self._peer(dst, "dst")
        self.stats["bytes_sent"] += x.nbytes
        self.stats["messages_sent"] += 1

    def recv(self, src: int, out: np.ndarray, combine: Callable | None = None) -> np.ndarray:
        self._peer(src, "src")
        if combine is None:
            out[...] = 0
        self.stats["bytes_recv"] += out.nbytes
        return out

    def sendrecv(self, x: np.ndarray, dst: int, src: int, out: np.ndarray | None = None,
                 combine: Callable | None = None) -> np.ndarray:
        self._peer(dst, "dst")
        self._peer(src, "src")
        x = np.ascontiguousarray(x)           # as group.py does: out takes x's C layout
        out = np.empty_like(x) if out is None else out
        if combine is None:
            if out.dtype == x.dtype and out.size == x.size:
                np.copyto(out, x.reshape(out.shape))
            else:
                out[...] = 0
        self.stats["bytes_sent"] += x.nbytes
        self.stats["bytes_recv"] += out.nbytes
        self.stats["messages_sent"] += 1
        return out

    def _peer(self, r: int, what: str) -> None:
        if not 0 <= r < self.size or r == self.rank:
            raise ValueError(f"{self.prefix} {what}={r} is not another rank of group "
                             f"'{self.name}' (size {self.size}, this rank is {self.rank})")

    # --- synchronisation and shared regions ---
    def barrier(self) -> None:
        """Every peer is where I am: nothing to wait for."""

    def drain(self) -> None:
        """Nothing is ever queued: submit runs its call inline."""

    def shared(self, tag: str, nbytes: int) -> SharedBuffer:
        """A region of nbytes whose every peer view is this rank's own bytes (stride 0),
        in a private mapping like the real one's (memory/ledger.py counts them alike)."""
        if not self.supports_shared:
            raise NotImplementedError(
                f"{self.prefix} group '{self.name}' stands for an MPI group: there is no "
                "memory shared between its ranks. Use algo='ring', 'tree' or 'halving'.")
        old = self._buffers.get(tag)
        if old is not None and nbytes <= old.nbytes:
            return old
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        arena = Arena(size, mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | MAP_NORESERVE))
        buf = SharedBuffer(arena, arena.alloc(size, f"shared buffer {tag!r}"), 0, self.rank,
                           nbytes)
        self._buffers[tag] = buf
        return buf

    # --- one call: counted and kept ---
    def collective(self, op: str, x: np.ndarray | None, *, root: int | None = None,
                   reduce_op: str | None = None, algo: str = "",
                   p2p: tuple[int, int, int] | None = None) -> "DryScope":
        return DryScope(self, op, algo, 0 if x is None else int(x.nbytes))

    def submit(self, fn: Callable[[], Any]) -> Work:
        work = Work()                       # run inline: there is no peer to wait for
        try:
            work._result = fn()
        except BaseException as e:          # handed to whoever waits, as a worker would
            work._error = e
        work._done.set()
        return work


class DryScope:
    """One call on a DryGroup: its bytes (stats deltas) go to ctx.calls when it ends, its
    wall time to stats["seconds"]. Reusable, like group.py's CallScope (prepared.py keeps
    one per signature)."""

    __slots__ = ("g", "op", "algo", "nbytes", "t0", "sent", "recv")

    def __init__(self, g: DryGroup, op: str, algo: str, nbytes: int):
        self.g, self.op, self.algo, self.nbytes = g, op, algo, nbytes
        self.t0, self.sent, self.recv = 0.0, 0, 0

    def __enter__(self) -> DryGroup:
        stats = self.g.stats
        self.sent, self.recv = stats["bytes_sent"], stats["bytes_recv"]
        self.t0 = time.perf_counter()
        return self.g

    def __exit__(self, exc_type, exc, tb) -> None:
        g, stats = self.g, self.g.stats
        stats["seconds"] += time.perf_counter() - self.t0
        if exc_type is None:
            g.ctx.calls.append(Call(g.ctx.step, g.name, self.op, self.algo, self.nbytes,
                                    stats["bytes_sent"] - self.sent,
                                    stats["bytes_recv"] - self.recv))


class DryContext:
    """Rank `rank` of a dry job of `world_size` ranks: what a spawned rank's ctx offers
    (rank, world_size, world, new_group) and what runtime/world.py's Job adds (alone), plus
    what the dry run keeps: `groups` (this rank's, in creation order), `calls` (every Call)
    and `step` (the label of the calls made now; the caller sets it).
    shared_memory: True for the shared-memory runtime's groups (direct algorithms, shared
    regions), False for MPI's (runtime/mpi.py: neither)."""

    def __init__(self, rank: int, world_size: int, shared_memory: bool = True):
        for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DryContext: {name}={value!r} must be an int >= {low}.")
        if rank >= world_size:
            raise ValueError(f"DryContext: rank={rank} is not a rank of a job of "
                             f"{world_size}; use a rank in 0..{world_size - 1}.")
        self.rank, self.world_size, self.shared_memory = rank, world_size, shared_memory
        self.group_names: dict[int, str] = {}
        self.groups: list[DryGroup] = []
        self.calls: list[Call] = []
        self.step: int | None = None
        self.world = self._make(tuple(range(world_size)), "world")
        self.alone = self._make((rank,), "alone")     # every one-rank axis (runtime/mesh.py)

    def _make(self, ranks: tuple[int, ...], name: str) -> DryGroup:
        gid = len(self.group_names)
        self.group_names[gid] = name
        group = DryGroup(self, name, gid, ranks)
        self.groups.append(group)
        return group

    def new_group(self, ranks, name: str | None = None) -> DryGroup | None:
        """As the real job's: the same checks and numbering; this rank's group, or None
        (a group this rank is not in costs a name, no object)."""
        W = self.world_size
        ranks = tuple(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0 or max(ranks) >= W:
            raise ValueError(f"new_group: ranks {list(ranks)} must be distinct global ranks "
                             f"in 0..{W - 1}, at least one")
        name = name or f"group{len(self.group_names)}"
        if self.rank in ranks:
            return self._make(ranks, name)
        self.group_names[len(self.group_names)] = name
        return None
