"""The MPI transport: the same collective algorithms, across machines, under mpiexec.

Collective algorithms only ask a group for `send`, `recv`, `sendrecv`,
`barrier` and a `collective(...)` scope (runtime/group.py). `MpiGroup`
provides exactly those over an mpi4py communicator, so ring, tree, halving
and pairwise algorithms run unchanged between processes on different
machines. What it cannot provide is `shared`: there is no memory shared
between machines, so the zero-copy `direct` algorithm is shared-memory only
(`supports_shared` is False here; the collectives API checks it).

Every message is preceded by its header, the sender's call record plus the
byte count and dtype (runtime/call.py), so mismatched calls still raise
CollectiveMismatch naming both calls. Waits poll MPI requests through the
same loop as the shared-memory transport (runtime/wait.py), so a wait still
ends at its deadline with CollectiveTimeout instead of hanging forever.

Run:  mpiexec -n 4 python script.py   where the script calls
      `ctx = minidist.runtime.mpi.init_mpi()` (or minidist.init(), which does
      so when it finds itself under mpiexec).

Reference: MPI Forum, "MPI: A Message-Passing Interface Standard", v4.0, 2021,
Ch. 3 (point-to-point) and 7 (groups, communicators).
Read next: collectives/
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from minidist.runtime import call
from minidist.runtime.errors import CollectiveMismatch, CollectiveTimeout, rank_prefix
from minidist.runtime.group import Work
from minidist.runtime.p2p import CHUNK_NBYTES, HDR, MSG_DTYPE, MSG_NBYTES
from minidist.runtime.wait import wait_until

MPI_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID", "PMIX_RANK")


def under_mpiexec() -> bool:
    """True when this process was started by mpiexec/mpirun."""
    return any(v in os.environ for v in MPI_ENV)


class _Deadline:
    """Watch for MPI waits: there is no job board across machines, only the deadline."""

    def __init__(self, group: "MpiGroup", peer: int, what: str):
        self.g, self.peer, self.what = group, peer, what

    def check(self, late: bool) -> None:
        if late:
            g = self.g
            raise CollectiveTimeout(
                f"{g.prefix} {call.describe(g.record, g.group_names)} waited {g.timeout:g} s "
                f"to {self.what} rank {self.peer} of MPI group '{g.name}'. Usually a rank is "
                "hung or called a different collective.", missing=(self.peer,))


class MpiGroup:
    """The ProcessGroup interface over an mpi4py communicator (no `shared`)."""

    supports_shared = False

    def __init__(self, comm, name: str, gid: int, group_names: dict[int, str],
                 timeout: float, ranks: tuple[int, ...]):
        self.comm, self.name, self.gid, self.ranks = comm, name, gid, tuple(ranks)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.group_names, self.timeout = group_names, timeout
        self.prefix = rank_prefix(self.rank, self.size)
        self.seq = 0
        self._p2p = call.pack(gid, 0, "p2p", None)
        self.record = self._p2p
        self.stats = {"bytes_sent": 0, "bytes_recv": 0, "messages_sent": 0, "seconds": 0.0}
        self.prepared: dict = {}          # collectives/api.py's validated calls, by signature

    # --- messages: header, then payload ---
    def _header(self, x: np.ndarray) -> np.ndarray:
        h = np.zeros(HDR, np.int64)
        h[:call.NFIELDS] = self.record
        h[MSG_NBYTES], h[MSG_DTYPE], h[CHUNK_NBYTES] = x.nbytes, call.dtype_code(x.dtype), x.nbytes
        return h

    def _wait(self, req, peer: int, what: str) -> None:
        wait_until(req.Test, _Deadline(self, peer, what), self.timeout, spin=False)

    def _check(self, h: np.ndarray, src: int, out: np.ndarray) -> None:
        # identities, not raw fields: a sendrecv's header names two ranks its identity
        # leaves out (runtime/call.py)
        same = call.identity(h[:call.NFIELDS]) == call.identity(self.record)
        if same and h[MSG_NBYTES] == out.nbytes and h[MSG_DTYPE] == call.dtype_code(out.dtype):
            return
        raise CollectiveMismatch(
            f"{self.prefix} rank {src} of MPI group '{self.name}' sent {int(h[MSG_NBYTES])} B "
            f"from call [{call.describe(h[:call.NFIELDS], self.group_names)}] while this rank "
            f"expected {out.nbytes} B {out.dtype} in call "
            f"[{call.describe(self.record, self.group_names)}].")

    def send(self, x: np.ndarray, dst: int) -> None:
        x = np.ascontiguousarray(x)
        tag = 2 * self.gid
        self._wait(self.comm.Isend(self._header(x), dest=dst, tag=tag), dst, "send to")
        self._wait(self.comm.Isend(x.reshape(-1).view(np.uint8), dest=dst, tag=tag + 1), dst,
                   "send to")
        self.stats["bytes_sent"] += x.nbytes
        self.stats["messages_sent"] += 1

    def recv(self, src: int, out: np.ndarray, combine: Callable | None = None) -> np.ndarray:
        h = np.empty(HDR, np.int64)
        tag = 2 * self.gid
        self._wait(self.comm.Irecv(h, source=src, tag=tag), src, "receive from")
        self._check(h, src, out)
        target = out if combine is None else np.empty_like(out)
        self._wait(self.comm.Irecv(target.reshape(-1).view(np.uint8), source=src, tag=tag + 1),
                   src, "receive from")
        if combine is not None:
            combine(out, target, out=out)
        self.stats["bytes_recv"] += out.nbytes
        return out

    def sendrecv(self, x: np.ndarray, dst: int, src: int, out: np.ndarray | None = None,
                 combine: Callable | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty_like(x) if out is None else out
        tag = 2 * self.gid
        hs, hr = self._header(x), np.empty(HDR, np.int64)
        reqs = [self.comm.Isend(hs, dest=dst, tag=tag), self.comm.Irecv(hr, source=src, tag=tag)]
        for req in reqs:
            self._wait(req, src, "exchange with")
        self._check(hr, src, out)
        target = out if combine is None else np.empty_like(out)
        reqs = [self.comm.Isend(x.reshape(-1).view(np.uint8), dest=dst, tag=tag + 1),
                self.comm.Irecv(target.reshape(-1).view(np.uint8), source=src, tag=tag + 1)]
        for req in reqs:
            self._wait(req, src, "exchange with")
        if combine is not None:
            combine(out, target, out=out)
        self.stats["bytes_sent"] += x.nbytes
        self.stats["bytes_recv"] += out.nbytes
        self.stats["messages_sent"] += 1
        return out

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), -1, "meet at a barrier with")

    def drain(self) -> None:
        """No queue to drain: `submit` runs MPI work inline (one thread talks to MPI)."""

    def shared(self, tag: str, nbytes: int):
        raise NotImplementedError(
            f"{self.prefix} group '{self.name}' runs over MPI: there is no memory shared "
            "between its ranks. Use algo='ring', 'tree' or 'halving' instead of 'direct'.")

    def collective(self, op: str, x: np.ndarray | None, *, root: int | None = None,
                   reduce_op: str | None = None, algo: str = "",
                   p2p: tuple[int, int, int] | None = None) -> "_MpiScope":
        return _MpiScope(self, call.pack(self.gid, 0, op, x, root, reduce_op, algo, p2p))

    def submit(self, fn):
        work = Work()                       # MPI calls from one thread at a time: run inline
        try:
            work._result = fn()
        except BaseException as e:          # handed to whoever waits
            work._error = e
        work._done.set()
        return work


class _MpiScope:
    """One call: its sequence number and record, and its wall time added to
    stats["seconds"] (as group.py's CallScope; every MPI call runs on the main thread)."""

    def __init__(self, g: MpiGroup, rec: np.ndarray):
        self.g, self.rec, self.t0 = g, rec, 0.0

    def __enter__(self) -> MpiGroup:
        self.g.seq += 1
        self.rec[call.SEQ] = self.g.seq
        self.g.record = self.rec
        self.t0 = time.perf_counter()
        return self.g

    def __exit__(self, *exc) -> None:
        self.g.stats["seconds"] += time.perf_counter() - self.t0
        self.g.record = self.g._p2p


class MpiContext:
    """What init_mpi() returns: rank, world size, the world group, and new_group."""

    def __init__(self, timeout: float = 60.0):
        from mpi4py import MPI
        self.MPI, self.timeout = MPI, timeout
        self.group_names: dict[int, str] = {0: "world"}
        W = MPI.COMM_WORLD.Get_size()
        self.world = MpiGroup(MPI.COMM_WORLD, "world", 0, self.group_names, timeout,
                              tuple(range(W)))
        self.rank, self.world_size = self.world.rank, self.world.size

    def new_group(self, ranks, name: str | None = None) -> MpiGroup | None:
        """COLLECTIVE over the world, like the shared-memory runtime's new_group."""
        gid = len(self.group_names)
        ranks = tuple(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(
                0 <= r < self.world_size for r in ranks):
            raise ValueError(f"new_group: ranks {list(ranks)} must be distinct global ranks "
                             f"in 0..{self.world_size - 1}, at least one")
        name = name or f"group{gid}"
        self.group_names[gid] = name
        mpi_group = self.world.comm.Get_group().Incl(list(ranks))
        comm = self.world.comm.Create_group(mpi_group)
        if comm == self.MPI.COMM_NULL:
            return None
        return MpiGroup(comm, name, gid, self.group_names, self.timeout, tuple(ranks))


def init_mpi(timeout: float = 60.0) -> MpiContext:
    """Start (or join) the MPI job this process belongs to."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        raise RuntimeError("the MPI transport needs mpi4py and an MPI library: "
                           "pip install -e '.[mpi]'") from None
    return MpiContext(timeout)
