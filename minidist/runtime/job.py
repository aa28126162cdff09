"""The job board: the few numbers every rank of a job can see about every other.

It lives at the start of the shared arena (runtime/shm.py) and holds:
    status (W,)        per rank: STARTING, RUNNING, EXITING (fn returned), DONE,
                       FAILED or DEAD. A rank
                       writes its own; the launcher writes DEAD when it reaps a
                       rank that died without saying why (a signal, os._exit).
    exit_info (W,)     exit code, or -signal for a rank killed by a signal
    abort (1,)         0, or 1 + the first rank that failed: every wait sees it
    calls (W, G, 16)   the call each rank is in (or last made) on each group gid,
                       so a waiting rank can compare its call with a peer's;
                       guarded by a seqlock, versions (W, G): odd while the owner
                       rewrites the record, so a reader never trusts a torn copy
    flight rings       the flight recorder (runtime/flight.py)
    beats (W,)         per rank, the time (CLOCK_MONOTONIC, ns) it last checked on a
                       wait: a rank stuck in a call whose beat is old is not waiting
                       for anyone, it is hung or slow (runtime/watch.py)
    sleeping (W,)      per rank, how many of its threads sleep at its doorbell, so a
                       peer rings only a rank that sleeps (runtime/doorbell.py)

One rank's view: write only your own rows; read anyone's. All of these are
single-writer cells, so no locks are needed for correctness (runtime/shm.py
explains the ordering).

A failure is a rank writing FAILED into its own status, from the main thread (an
error in fn, launch.py) or from a group's worker thread (an async call failed:
`RankHealth`, below). Either way the abort flag rises and every wait sees it.

Read next: runtime/wait.py
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

import numpy as np

from minidist.runtime import call
from minidist.runtime.errors import RankFailure
from minidist.runtime.flight import DEPTH, FlightRecorder
from minidist.runtime.shm import ALIGN, Arena

STARTING, RUNNING, DONE, FAILED, DEAD, EXITING = 0, 1, 2, 3, 4, 5
STATUS_NAMES = {STARTING: "starting", RUNNING: "running", DONE: "finished",
                FAILED: "failed", DEAD: "dead", EXITING: "returned from its function"}


def _layout(W: int, G: int) -> dict[str, tuple[int, ...]]:
    """The board's int64 arrays and their shapes, in allocation order."""
    F = call.NFIELDS
    return {"status": (W,), "exit_info": (W,), "abort": (1,), "calls": (W, G, F),
            "versions": (W, G), "rings": (W, DEPTH, F), "flight_pos": (W,), "beats": (W,),
            "sleeping": (W,)}


class JobBoard:
    """Views of the board's arrays; built identically by the launcher and each rank."""

    def __init__(self, arena: Arena, world_size: int, max_groups: int, launcher_pid: int):
        self.world_size, self.max_groups, self.launcher_pid = world_size, max_groups, launcher_pid
        for name, shape in _layout(world_size, max_groups).items():
            n = int(np.prod(shape))
            setattr(self, name, arena.view(arena.alloc(8 * n, name), np.int64, n).reshape(shape))

    @staticmethod
    def nbytes(world_size: int, max_groups: int) -> int:
        """Arena bytes the board takes (every array cache-line aligned)."""
        sizes = (8 * int(np.prod(s)) for s in _layout(world_size, max_groups).values())
        return sum(-(-n // ALIGN) * ALIGN for n in sizes)

    def read_call(self, rank: int, gid: int) -> np.ndarray | None:
        """Reader side of the seqlock (the owner, group.py's CallScope, makes the version
        odd, rewrites the record, makes it even again): a consistent copy of rank's record
        on gid, or None if it was being rewritten (the caller looks again next check)."""
        before = int(self.versions[rank, gid])
        rec = self.calls[rank, gid].copy()
        if before % 2 or int(self.versions[rank, gid]) != before:
            return None
        return rec

    def recorder(self, rank: int) -> FlightRecorder:
        return FlightRecorder(self.rings, self.flight_pos, rank)

    def mark(self, rank: int, status: int, info: int = 0) -> None:
        """Set a rank's status; a failure also raises the job-wide abort flag."""
        self.exit_info[rank] = info
        self.status[rank] = status
        if status in (FAILED, DEAD) and self.abort[0] == 0:
            self.abort[0] = 1 + rank

    def first_failed(self) -> int | None:
        a = int(self.abort[0])
        return a - 1 if a else None

    def launcher_alive(self) -> bool:
        return os.getppid() == self.launcher_pid

    def describe_status(self, rank: int) -> str:
        s = int(self.status[rank])
        info = int(self.exit_info[rank])
        if s == DEAD and info < 0:
            return f"died (killed by {signal.Signals(-info).name})"
        if s == DEAD:
            return f"died (exit code {info})"
        return STATUS_NAMES.get(s, f"status {s}")


class RankHealth:
    """This rank's failure switch, shared by all its groups and their worker threads.

    An error that leaves an async collective (raised on a group's worker thread, where
    no caller sees it until wait()) fails the rank at once, as an error in fn does:
    `fail` marks the rank FAILED on the board (which raises the job's abort flag, so
    every waiting rank stops within ~1 ms) and hands the error to `report` (set by
    launch.py: the launcher gets the text at once). From then on every new call on this
    rank raises at once (`check`) instead of waiting a timeout for peers that stopped.
    """

    def __init__(self, board: JobBoard, rank: int):
        self.board, self.rank = board, rank
        self.error: BaseException | None = None
        self.where = ""
        self.report: Callable[[BaseException, str], None] | None = None
        self._lock = threading.Lock()            # two groups' workers may fail at once
        self._failing = False

    def fail(self, error: BaseException, where: str) -> None:
        with self._lock:
            if self._failing:
                return
            self._failing = True
        try:
            if self.report is not None:
                self.report(error, where)       # marks FAILED, then tells the launcher
            else:
                self.board.mark(self.rank, FAILED)
        except Exception:                       # noqa: BLE001 -- e.g. the launcher is gone;
            self.board.mark(self.rank, FAILED)  # the board still tells the other ranks
        # Kept only now: a call that raises "failed earlier" (check) must not reach the
        # launcher before the error itself does.
        self.where, self.error = where, error

    def check(self, prefix: str, what: str) -> None:
        """Raise RankFailure (from the first error) if this rank has failed."""
        e = self.error
        if e is None:
            return
        first = (str(e).splitlines() or [""])[0]
        raise RankFailure(
            f"{prefix} {what}: {self.where} failed earlier on this rank "
            f"({type(e).__name__}: {first}), so this rank has failed and the job is "
            "stopping.", rank=self.rank) from e
