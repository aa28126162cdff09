"""Process groups: a named subset of ranks that runs collectives together.

A ProcessGroup is this rank's handle on W ranks (`ranks`, global rank numbers
in group-rank order). Each group has its own mailboxes, sequence numbers and
worker thread, so collectives on different groups never see each other's
messages and can run at the same time.

What a collective algorithm may use (collectives/*.py use nothing else; the MPI
transport, runtime/mpi.py, offers the same, without `shared`):
    rank, size                 this rank's group rank, and W
    send(x, dst)               a message to group rank dst (runtime/p2p.py)
    recv(src, out, combine)    the next message from src, into out (or out =
                               combine(out, message), reducing as it arrives)
    sendrecv(x, dst, src, out) both at once (rings cannot deadlock)
    shared(tag, nbytes)        COLLECTIVE: a region of nbytes per member that
                               every member reads directly (zero-copy); the
                               same call again returns the same region, whose
                               `state` dict an algorithm may keep things in;
                               only where `supports_shared` (not for a group
                               whose ranks span emulated nodes, runtime/nodes.py)
    barrier()                  every member has arrived, in this same call
    stats                      bytes sent and received, for cost accounting, and
                               "seconds": the wall time the main thread spent in
                               calls on the group (CallScope), in Work.wait() and
                               in drain() (train.py's comm column adds them up)
Everything else here is the runtime's own: numbering and publishing calls
(runtime/records.py), watching for failures while waiting (runtime/watch.py),
the async worker, and the exit checks.

One rank's view of one collective call:
    1. `with group.collective("all_reduce", x, reduce_op="sum", algo="ring"):`
       the call gets the group's next sequence number s and its record is
       published (records.py);
    2. run the algorithm; every message sent inside is stamped with the
       record, so a peer in a different call raises CollectiveMismatch;
    3. leave the scope: the record is marked done (or failed).
Async calls (`submit`) run on the group's single worker thread in FIFO order;
a synchronous call first waits for that queue to drain, so the order of
calls on a group is the program order on every rank. An error that leaves an
async collective (or any runtime error: timeout, mismatch, a failed peer)
fails the whole rank at once (job.py, RankHealth), as an error in the caller
would, since its peers may be stuck in that call: the other ranks and the
launcher hear of it within a millisecond, and every later call on this rank
raises instead of waiting. (An error in a plain submitted function, outside
any collective, only waits in its Work.)

Barrier: each rank owns one cache line in the group's region; arriving at
barrier e means writing the call it is in, (s, key) (records.py), into the
line's half e % 2, then e into its first cell; leaving means seeing e or more
in everyone's, then finding everyone's half e % 2 equal to one's own (else a
CollectiveMismatch: the ranks met at this barrier from different calls). The
half e % 2 is not rewritten before barrier e + 2, which nobody reaches before
everyone has left barrier e. Cost: three stores and 2W loads, no messages.

Read next: runtime/records.py, runtime/watch.py, runtime/world.py
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from minidist.runtime import call
from minidist.runtime.doorbell import Doorbells
from minidist.runtime.errors import CollectiveMismatch, CollectiveTimeout, RankFailure
from minidist.runtime.errors import rank_prefix
from minidist.runtime.flight import cells
from minidist.runtime.job import JobBoard, RankHealth
from minidist.runtime.nodes import Nodes
from minidist.runtime.p2p import Mailboxes
from minidist.runtime.records import CallRecords, Template
from minidist.runtime.shm import ALIGN, Arena, Ordering
from minidist.runtime.wait import wait_until
from minidist.runtime.watch import PeerWatch

RUNTIME_ERRORS = (CollectiveMismatch, CollectiveTimeout, RankFailure)
INLINE_POLLS = 400             # looks at a barrier before the watched wait (~20 us, wait.py)


class SharedBuffer:
    """`nbytes` per member, in shared memory: write your own part, read anyone's.
    `state` is the algorithm's own (e.g. a call counter, typed views it made once)."""

    def __init__(self, arena: Arena, base: int, stride: int, rank: int, nbytes: int):
        self.arena, self.base, self.stride = arena, base, stride
        self.rank, self.nbytes = rank, nbytes
        self.state: dict = {}

    def peer(self, r: int, dtype, count: int, offset: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        if offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"shared buffer view of {count} x {dtype} at offset {offset} "
                             f"overruns the {self.nbytes} B region")
        return self.arena.view(self.base + r * self.stride + offset, dtype, count)

    def local(self, dtype, count: int, offset: int = 0) -> np.ndarray:
        return self.peer(self.rank, dtype, count, offset)


MAIN_THREAD = threading.main_thread().ident


class Work:
    """Handle of an async collective: `wait()` returns its result or re-raises. The time
    the main thread waits in wait() is communication it waited for: it adds to `stats`
    (its group's) "seconds", as a synchronous call's does (CallScope)."""

    def __init__(self, stats: dict | None = None):
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._stats = stats

    @classmethod
    def completed(cls, result: Any = None) -> "Work":
        """The handle of a call that already ran: wait() returns `result` at once."""
        work = cls()
        work._result = result
        work._done.set()
        return work

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        done = self._done.wait(timeout)
        if self._stats is not None and threading.get_ident() == MAIN_THREAD:
            self._stats["seconds"] += time.perf_counter() - t0
        if not done:
            raise TimeoutError(f"async collective not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


class ProcessGroup:
    """This rank's handle on a group; see the module docstring."""

    supports_shared = True              # `shared` regions exist (runtime/mpi.py: False)

    def __init__(self, *, gid: int, name: str, ranks: tuple[int, ...], global_rank: int,
                 world_size: int, board: JobBoard, arena: Arena, ordering: Ordering,
                 group_names: dict[int, str], timeout: float, spin: bool,
                 nslots: int, slot_bytes: int, health: RankHealth | None = None,
                 bells: Doorbells | None = None, nodes: Nodes | None = None):
        self.gid, self.name, self.ranks = gid, name, tuple(ranks)
        self.nodes = nodes                # emulated nodes (runtime/nodes.py), or None
        # nodes share no memory: a group across them has no shared() regions
        self.supports_shared = nodes is None or nodes.count(self.ranks) == 1
        self.rank, self.size = self.ranks.index(global_rank), len(self.ranks)
        self.global_rank, self.world_size = global_rank, world_size
        self.board, self.arena, self.ordering = board, arena, ordering
        self.group_names, self.timeout, self.spin = group_names, timeout, spin
        self.bells = bells                # wake a sleeping peer (runtime/doorbell.py)
        self._others = [g for g in self.ranks if g != global_rank]
        self.prefix = rank_prefix(global_rank, world_size)
        lines = arena.view(arena.alloc(ALIGN * self.size, "barrier"), np.int64, 8 * self.size)
        self._bar = [cells(lines[8 * r:8 * r + 8]) for r in range(self.size)]
        self._epoch = 0
        self._meta = arena.view(arena.alloc(ALIGN * self.size, "shared() check"),
                                np.int64, 8 * self.size).reshape(self.size, 8)
        self.mail = Mailboxes(self, arena, self.rank, self.size, nslots, slot_bytes, ordering)
        self.stats = self.mail.stats
        self.records = CallRecords(board, gid, global_rank, board.recorder(global_rank))
        self._p2p = Template(call.pack(gid, 0, "p2p", None))
        self.record, self.key = self._p2p.record, self._p2p.key   # the call in progress
        self._ident: bytes | None = None                         # its identity, when asked
        self._buffers: dict[str, SharedBuffer] = {}
        self.prepared: dict = {}          # collectives/api.py's validated calls, by signature
        self._queue: queue.Queue | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self.health = RankHealth(board, global_rank) if health is None else health
        self.failed_call = ""             # the call an exception left, for async reports

    @staticmethod
    def region_bytes(size: int, nslots: int, slot_bytes: int) -> int:
        """Arena bytes a group of `size` ranks takes before any shared() buffer:
        barrier lines and shared() checks (64 B per member each), and mailboxes."""
        return 2 * ALIGN * size + Mailboxes.nbytes(size, nslots, slot_bytes)

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, rank {self.rank} of {self.size}, ranks {self.ranks})"

    @property
    def seq(self) -> int:
        return self.records.seq

    def identity(self) -> bytes:
        """The identity bytes of the call in progress (call.identity), made when first
        asked: messages are checked against them (runtime/p2p.py)."""
        if self._ident is None:
            self._ident = call.identity(self.record)
        return self._ident

    # --- point to point (group ranks) ---
    def send(self, x: np.ndarray, dst: int) -> None:
        self.mail.send(np.ascontiguousarray(x), self._peer(dst, "dst"))

    def sends_eagerly(self, x: np.ndarray, dst: int) -> bool:
        """True if send(x, dst) would not wait now: nothing is queued on this group's
        worker and x fits in the free slots of the mailbox to dst (runtime/p2p.py)."""
        return self._pending == 0 and self.mail.fits(self._peer(dst, "dst"), x.nbytes)

    def recv(self, src: int, out: np.ndarray, combine: Callable | None = None) -> np.ndarray:
        return self.mail.recv(self._peer(src, "src"), out, combine)

    def sendrecv(self, x: np.ndarray, dst: int, src: int, out: np.ndarray | None = None,
                 combine: Callable | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x)
        out = np.empty_like(x) if out is None else out
        return self.mail.sendrecv(x, self._peer(dst, "dst"), self._peer(src, "src"), out, combine)

    def _peer(self, r: int, what: str) -> int:
        if not 0 <= r < self.size or r == self.rank:
            raise ValueError(f"{self.prefix} {what}={r} is not another rank of group "
                             f"'{self.name}' (size {self.size}, this rank is {self.rank})")
        return r

    # --- synchronisation and shared regions ---
    def barrier(self) -> None:
        self._epoch = e = self._epoch + 1
        half = 1 + 2 * (e & 1)                 # cells 1-2 or 3-4: the call, (s, key)
        mine, seq, key = self._bar[self.rank], self.records.seq, self.key
        mine[half], mine[half + 1] = seq, key
        ordering = self.ordering
        if ordering.lock is None:              # x86: plain stores and loads are ordered
            mine[0] = e                        # arrive: everything above is visible first
            if self.bells is not None:
                self.bells.ring_all(self._others)
            polls = INLINE_POLLS if self.spin else 0
            for line in self._bar:             # a short wait is polled right here (~40 ns
                while line[0] < e and polls:   # a look, no watch built): most barriers
                    polls -= 1                 # of small collectives end in it
                if line[0] < e:
                    break
            else:
                return self._check_barrier(half, seq, key)
        else:
            ordering.store(mine, 0, e)
            if self.bells is not None:
                self.bells.ring_all(self._others)
        load = ordering.load
        for r, line in enumerate(self._bar):
            if load(line, 0) < e:
                ready = lambda line=line: load(line, 0) >= e            # noqa: E731
                wait_until(ready, self.watch(r, ready, "meet at a barrier with"), self.timeout,
                           self.spin, self.bells)
        self._check_barrier(half, seq, key)

    def _check_barrier(self, half: int, seq: int, key: int) -> None:
        """Every member arrived at this barrier from the call (seq, key) too?"""
        for r, line in enumerate(self._bar):
            if line[half] != seq or line[half + 1] != key:
                self._barrier_mismatch(r, line[half])

    def _barrier_mismatch(self, r: int, their_seq: int) -> None:
        """Rank r met this rank at a barrier from another call: name both calls."""
        names, peer = self.group_names, self.ranks[r]
        theirs = self.board.read_call(peer, self.gid)
        what = (call.describe(theirs, names) if theirs is not None and theirs[call.SEQ] ==
                their_seq else f"call #{their_seq} on '{self.name}'")
        raise CollectiveMismatch(
            f"{self.prefix} this rank is in [{call.describe(self.record, names)}] but rank "
            f"{peer} is in [{what}]. Every rank of a group must make the same collective "
            "calls, with the same dtype, shape, root and op, in the same order.")

    def shared(self, tag: str, nbytes: int) -> SharedBuffer:
        """COLLECTIVE: a region of `nbytes` per member (see module docstring)."""
        if not self.supports_shared:
            raise NotImplementedError(
                f"{self.prefix} group '{self.name}' spans {self.nodes.count(self.ranks)} "
                "emulated nodes, which share no memory. Use algo='ring', 'tree', 'halving' "
                "or 'hierarchical' instead of 'direct'.")
        old = self._buffers.get(tag)
        if old is not None and nbytes <= old.nbytes:
            return old
        self._meta[self.rank, :2] = call.encode(tag), nbytes
        self.barrier()
        for r in range(self.size):
            if tuple(self._meta[r, :2]) != (call.encode(tag), nbytes):
                raise CollectiveMismatch(
                    f"{self.prefix} group '{self.name}': shared({tag!r}, {nbytes}) on this rank "
                    f"but rank {r} asked for tag code {int(self._meta[r, 0])} with "
                    f"{int(self._meta[r, 1])} B; every member must make the same shared() calls.")
        self.barrier()                                 # nobody overwrites _meta before all read it
        stride = -(-nbytes // ALIGN) * ALIGN
        base = self.arena.alloc(stride * self.size, f"shared buffer {tag!r}")
        buf = SharedBuffer(self.arena, base, stride, self.rank, nbytes)
        self._buffers[tag] = buf
        return buf

    # --- the header scope of one collective call ---
    def collective(self, op: str, x: np.ndarray | None, *, root: int | None = None,
                   reduce_op: str | None = None, algo: str = "",
                   p2p: tuple[int, int, int] | None = None) -> "CallScope":
        """`with group.collective(...)`: the scope of one call (see the module docstring);
        p2p = (src, dst, tag) for a send or recv. The scope can be kept and entered again
        for the next call with the same signature (collectives/api.py does)."""
        return CallScope(self, self.records.template(op, x, root, reduce_op, algo, p2p))

    def unread(self) -> list[str]:
        """A description of each message that arrived and was never received."""
        return [f"an unread message from rank {src} of group '{self.name}', sent in "
                f"[{call.describe(h[:call.NFIELDS], self.group_names)}] (chunk at byte {off})"
                for src, h, off in self.mail.unread()]

    # --- async: one FIFO worker thread per group ---
    def submit(self, fn: Callable[[], Any]) -> Work:
        work = Work(self.stats)
        with self._cv:
            if self._queue is None:
                self._queue = queue.Queue()
                threading.Thread(target=self._worker, name=f"minidist-{self.name}",
                                 daemon=True).start()
            self._pending += 1
        self._queue.put((fn, work))
        return work

    def drain(self) -> None:
        """Wait until every submitted call has run (keeps program order for sync calls).
        The main thread's wait here is a wait for communication: it adds to "seconds"."""
        if self._pending == 0:                  # the common case: nothing queued, no lock
            return
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)
        if threading.get_ident() == MAIN_THREAD:
            self.stats["seconds"] += time.perf_counter() - t0

    def _worker(self) -> None:
        while True:
            fn, work = self._queue.get()
            self.failed_call = ""
            try:
                work._result = fn()
            except BaseException as e:                 # handed to whoever waits, and if
                work._error = e                        # peers may be stuck, fails the rank
                if self.failed_call or isinstance(e, RUNTIME_ERRORS):
                    self.health.fail(e, f"async {self.failed_call}" if self.failed_call
                                     else f"an async call on group '{self.name}'")
            finally:                                   # a waiter never waits forever
                done = work._done
                del fn, work  # kept until the next call, they would keep its result alive
                done.set()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    # --- what a stalled wait checks (runtime/wait.py, runtime/watch.py) ---
    def watch(self, peer: int, ready: Callable[[], bool], what: str) -> PeerWatch:
        return PeerWatch(self, peer, ready, what)


class CallScope:
    """Entering: next sequence number, publish the record; leaving: mark it done/failed.
    A call the main thread makes (not an async one on the group's worker) adds its wall
    time to group.stats["seconds"]: the time this rank spent communicating on the group,
    which train.py's Meter counts as the step's communication."""

    __slots__ = ("g", "template", "t0")

    def __init__(self, group: ProcessGroup, template: Template):
        self.g, self.template, self.t0 = group, template, 0.0

    def __enter__(self) -> ProcessGroup:
        g, t = self.g, self.template
        if g.health.error is not None:        # an async call failed: do not wait for peers
            g.health.check(g.prefix, f"{call.decode(int(t.record[call.OP]))} on "
                           f"'{g.name}' not started")
        g.records.begin(t)
        g.record, g.key, g._ident = g.records.current, t.key, None
        self.t0 = time.perf_counter()
        return g

    def __exit__(self, exc_type, exc, tb) -> None:
        g = self.g
        if threading.get_ident() == MAIN_THREAD:
            g.stats["seconds"] += time.perf_counter() - self.t0
        if exc_type is None:
            g.records.end(call.DONE)
        else:
            g.failed_call = call.describe(g.record, g.group_names)
            g.records.end(call.FAILED)
        g.record, g.key, g._ident = g._p2p.record, g._p2p.key, None
