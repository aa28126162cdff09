"""Process groups: a named subset of ranks that runs collectives together.

A ProcessGroup is this rank's handle on W ranks (`ranks`, global rank numbers
in group-rank order). Collective algorithms see only the group: its rank and
size, point-to-point messages between group ranks (`send`, `recv`,
`sendrecv`, from runtime/p2p.py), a `barrier`, and `shared` regions that every
member can read directly (zero-copy). Each group has its own mailboxes,
sequence numbers and worker thread, so collectives on different groups never
see each other's messages and can run at the same time.

One rank's view of one collective call:
    1. `with group.collective("all_reduce", x, reduce_op="sum", algo="ring"):`
       bump the group's sequence number s, publish the call record
       (runtime/call.py) in shared memory and in the flight recorder;
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

Barrier: each rank owns one counter in the group's region; arriving at
barrier e means writing e into it, leaving means seeing e in everyone's.
Cost: one store and W loads, no messages.

Read next: runtime/world.py (how groups are created), runtime/mesh.py.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable

import numpy as np

from minidist.runtime import call
from minidist.runtime.errors import CollectiveMismatch, CollectiveTimeout, RankFailure
from minidist.runtime.errors import rank_prefix
from minidist.runtime.job import DONE, EXITING, JobBoard, RankHealth
from minidist.runtime.p2p import Mailboxes
from minidist.runtime.shm import ALIGN, Arena, Ordering
from minidist.runtime.wait import wait_until

RUNTIME_ERRORS = (CollectiveMismatch, CollectiveTimeout, RankFailure)


class SharedBuffer:
    """`nbytes` per member, in shared memory: write your own part, read anyone's."""

    def __init__(self, arena: Arena, base: int, stride: int, rank: int, nbytes: int):
        self.arena, self.base, self.stride = arena, base, stride
        self.rank, self.nbytes = rank, nbytes

    def peer(self, r: int, dtype, count: int, offset: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        if offset + count * dtype.itemsize > self.nbytes:
            raise ValueError(f"shared buffer view of {count} x {dtype} at offset {offset} "
                             f"overruns the {self.nbytes} B region")
        return self.arena.view(self.base + r * self.stride + offset, dtype, count)

    def local(self, dtype, count: int, offset: int = 0) -> np.ndarray:
        return self.peer(self.rank, dtype, count, offset)


class Work:
    """Handle of an async collective: `wait()` returns its result or re-raises."""

    def __init__(self):
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
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
                 nslots: int, slot_bytes: int, health: RankHealth | None = None):
        self.gid, self.name, self.ranks = gid, name, tuple(ranks)
        self.rank, self.size = self.ranks.index(global_rank), len(self.ranks)
        self.global_rank, self.world_size = global_rank, world_size
        self.board, self.arena, self.ordering = board, arena, ordering
        self.group_names, self.timeout, self.spin = group_names, timeout, spin
        self.prefix = rank_prefix(global_rank, world_size)
        self._bar = arena.view(arena.alloc(ALIGN * self.size, "barrier"), np.int64,
                               8 * self.size)[::8]          # one counter per cache line
        self._meta = arena.view(arena.alloc(ALIGN * self.size, "shared() check"),
                                np.int64, 8 * self.size).reshape(self.size, 8)
        self._epoch = 0
        self.mail = Mailboxes(self, arena, self.rank, self.size, nslots, slot_bytes, ordering)
        self.stats = self.mail.stats
        self.seq = 0
        self._p2p_record = call.pack(gid, 0, "p2p", None)
        self.record = self._p2p_record
        self.ident = self._p2p_ident = self.record[call.IDENTITY].tobytes()
        self._templates: dict[tuple, np.ndarray] = {}
        self._mine = board.calls[global_rank, gid]          # my published call record
        self._version = board.versions[global_rank, gid:gid + 1]
        self._writes = 0                                    # the seqlock's version, even
        self._verified = True
        self._buffers: dict[str, SharedBuffer] = {}
        self.algo_state: dict = {}        # per-algorithm state, e.g. direct_small's flags
        self._recorder = board.recorder(global_rank)
        self._queue: queue.Queue | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self.health = RankHealth(board, global_rank) if health is None else health
        self.failed_call = ""             # the call an exception left, for async reports

    @staticmethod
    def region_bytes(size: int, nslots: int, slot_bytes: int) -> int:
        """Arena bytes a group of `size` ranks takes before any shared() buffer:
        barrier counters and shared() checks (64 B per member each), and mailboxes."""
        return 2 * ALIGN * size + Mailboxes.nbytes(size, nslots, slot_bytes)

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, rank {self.rank} of {self.size}, ranks {self.ranks})"

    # --- point to point (group ranks) ---
    def send(self, x: np.ndarray, dst: int) -> None:
        self.mail.send(np.ascontiguousarray(x), self._peer(dst, "dst"))

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
        self._epoch += 1
        e, bar, load = self._epoch, self._bar, self.ordering.load
        self.ordering.store(bar, self.rank, e)
        for r in range(self.size):
            if load(bar, r) < e:
                ready = lambda r=r: load(bar, r) >= e                  # noqa: E731
                wait_until(ready, self.watch(r, ready, "meet at a barrier with"), self.timeout,
                           self.spin)
        if not self._verified:
            self._verify_peers()

    def _verify_peers(self) -> None:
        """First barrier of a call: every member that is at this sequence number must be
        making the same call (algorithms that talk only through shared memory and
        barriers have no message header to compare)."""
        self._verified = True
        rec, seq, ident = self.record, self.record[call.SEQ], self.ident
        for r, peer in enumerate(self.ranks):
            theirs = self.board.read_call(peer, self.gid)
            if theirs is not None and theirs[call.SEQ] == seq and \
                    call.identity(theirs) != ident:
                names = self.group_names
                raise CollectiveMismatch(
                    f"{self.prefix} this rank is in [{call.describe(rec, names)}] but rank "
                    f"{self.ranks[r]} is in [{call.describe(theirs, names)}]. Every rank of a "
                    "group must make the same collective calls, with the same dtype, shape, "
                    "root and op, in the same order.")

    def shared(self, tag: str, nbytes: int) -> SharedBuffer:
        """COLLECTIVE: a region of `nbytes` per member (see module docstring)."""
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
        p2p = (src, dst, tag) for a send or recv."""
        key = (op, None if x is None else (x.dtype, x.shape), root, reduce_op, algo, p2p)
        template = self._templates.get(key)
        if template is None:                     # pack once per distinct call, reuse after
            if len(self._templates) > 4096:
                self._templates.clear()
            template = call.pack(self.gid, 0, op, x, root, reduce_op, algo, p2p)
            template[call.STATE] = call.STARTED
            self._templates[key] = template
        return CallScope(self, template)

    # --- async: one FIFO worker thread per group ---
    def submit(self, fn: Callable[[], Any]) -> Work:
        work = Work()
        with self._cv:
            if self._queue is None:
                self._queue = queue.Queue()
                threading.Thread(target=self._worker, name=f"minidist-{self.name}",
                                 daemon=True).start()
            self._pending += 1
        self._queue.put((fn, work))
        return work

    def drain(self) -> None:
        """Wait until every submitted call has run (keeps program order for sync calls)."""
        if self._pending == 0:                  # the common case: nothing queued, no lock
            return
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)

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
                work._done.set()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    # --- what a stalled wait checks (runtime/wait.py) ---
    def watch(self, peer: int, ready: Callable[[], bool], what: str) -> "PeerWatch":
        return PeerWatch(self, peer, ready, what)


class CallScope:
    """Entering: next sequence number, publish the record; leaving: mark it done/failed."""

    def __init__(self, group: ProcessGroup, template: np.ndarray):
        self.g, self.template = group, template

    def __enter__(self) -> ProcessGroup:
        g = self.g
        if g.health.error is not None:        # an async call failed: do not wait for peers
            g.health.check(g.prefix, f"{call.decode(int(self.template[call.OP]))} on "
                           f"'{g.name}' not started")
        g.seq += 1
        rec, version = g._mine, g._version    # my record on the board: peers read it
        g._writes += 2
        version[0] = g._writes - 1            # seqlock (job.py): odd while rewriting
        rec[:] = self.template
        rec[call.SEQ] = g.seq
        version[0] = g._writes
        g._recorder.start(rec)
        g.record, g.ident, g._verified = rec, call.identity(rec), False
        return g

    def __exit__(self, exc_type, exc, tb) -> None:
        g = self.g
        state = call.DONE if exc_type is None else call.FAILED
        if exc_type is not None:
            g.failed_call = call.describe(g.record, g.group_names)
        g._mine[call.STATE] = state
        g._recorder.finish(state)
        g.record, g.ident, g._verified = g._p2p_record, g._p2p_ident, True


class PeerWatch:
    """Decides whether a wait on group rank `peer` can still succeed."""

    def __init__(self, group: ProcessGroup, peer: int, ready: Callable[[], bool], what: str):
        self.g, self.peer, self.ready, self.what = group, peer, ready, what

    def _doing(self) -> str:
        g = self.g
        if g.record[call.OP] == call.encode("p2p"):
            return f"point-to-point on group '{g.name}'"
        return call.describe(g.record, g.group_names)

    def check(self, late: bool) -> None:
        g, board = self.g, self.g.board
        peer_global = g.ranks[self.peer]
        failed = board.first_failed()
        if failed == g.global_rank:          # this rank failed: an async call on another group
            g.health.check(g.prefix, f"stopped waiting to {self.what} group rank "
                           f"{self.peer} in {self._doing()}")
        if failed is not None:
            raise RankFailure(
                f"{g.prefix} rank {failed} {board.describe_status(failed)}; this rank stopped "
                f"while waiting to {self.what} group rank {self.peer} in {self._doing()}.",
                rank=failed)
        if not board.launcher_alive():
            raise RankFailure(f"{g.prefix} the launcher process is gone; stopping.", rank=-1)
        gone = board.status[peer_global] == DONE or (
            board.status[peer_global] == EXITING and g.record[call.OP] != call.encode("exit"))
        if gone and not self.ready():
            raise CollectiveMismatch(
                f"{g.prefix} rank {peer_global} returned from its function without making "
                f"{self._doing()}, which this rank is in (waiting to {self.what} it).")
        if g.record[call.OP] != call.encode("p2p"):
            theirs = board.read_call(peer_global, g.gid)
            if theirs is not None:
                self._probe_mismatch(theirs, peer_global)
        if late:
            missing = self._missing()
            raise CollectiveTimeout(self._timeout_text(), missing=missing,
                                    hung=tuple(g.ranks[r] for r in missing))

    def _probe_mismatch(self, theirs: np.ndarray, peer_global: int) -> None:
        g = self.g
        mine = g.record
        if theirs[call.SEQ] < mine[call.SEQ] or self.ready():
            return
        if theirs[call.SEQ] == mine[call.SEQ] and call.same_call(theirs, mine):
            return
        names = g.group_names
        raise CollectiveMismatch(
            f"{g.prefix} this rank is in [{call.describe(mine, names)}] but rank {peer_global} "
            f"is in [{call.describe(theirs, names)}]. Every rank of a group must make the same "
            "collective calls, with the same dtype, shape, root and op, in the same order.")

    def _missing(self) -> tuple[int, ...]:
        g = self.g
        seqs = g.board.calls[list(g.ranks), g.gid, call.SEQ]
        return tuple(r for r in range(g.size) if seqs[r] < g.record[call.SEQ])

    def _timeout_text(self) -> str:
        g = self.g
        missing = self._missing()
        who = (f"group ranks {list(missing)} (global {[g.ranks[r] for r in missing]}) have not "
               "reached this call" if missing else "every rank reached this call")
        return (f"{g.prefix} {self._doing()} waited {g.timeout:g} s to {self.what} group rank "
                f"{self.peer} (global rank {g.ranks[self.peer]}); {who}. Usually a rank is hung "
                "or called a different collective, or the same ones in a different order.\n"
                + g._recorder.render(g.ranks, g.group_names) + self._trace_file())

    def _trace_file(self) -> str:
        """With MINIDIST_TRACE_DIR set, write every member's last calls as a Chrome trace."""
        folder = os.environ.get("MINIDIST_TRACE_DIR")
        if not folder:
            return "\n(set MINIDIST_TRACE_DIR to also get these calls as a Chrome trace)"
        g = self.g
        path = os.path.join(folder, f"minidist-hang-rank{g.global_rank}-{os.getpid()}.json")
        g._recorder.trace(g.ranks, g.group_names).write(path)
        return f"\nChrome trace of these calls: {path} (open in ui.perfetto.dev)"
