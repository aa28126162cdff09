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
    flight rings       the flight recorder (observe/flight.py)

One rank's view: write only your own rows; read anyone's. All of these are
single-writer cells, so no locks are needed for correctness (runtime/shm.py
explains the ordering).

Read next: runtime/wait.py
"""

from __future__ import annotations

import os

import numpy as np

from minidist.observe.flight import DEPTH, FlightRecorder
from minidist.runtime import call
from minidist.runtime.shm import Arena

STARTING, RUNNING, DONE, FAILED, DEAD, EXITING = 0, 1, 2, 3, 4, 5
STATUS_NAMES = {STARTING: "starting", RUNNING: "running", DONE: "finished",
                FAILED: "failed", DEAD: "dead", EXITING: "returned from its function"}


class JobBoard:
    """Views of the board's arrays; built identically by the launcher and each rank."""

    def __init__(self, arena: Arena, world_size: int, max_groups: int, launcher_pid: int):
        W, G, F = world_size, max_groups, call.NFIELDS
        self.world_size, self.max_groups, self.launcher_pid = W, G, launcher_pid
        i64 = np.int64
        self.status = arena.view(arena.alloc(8 * W, "status"), i64, W)
        self.exit_info = arena.view(arena.alloc(8 * W, "exit info"), i64, W)
        self.abort = arena.view(arena.alloc(8, "abort flag"), i64, 1)
        self.calls = arena.view(arena.alloc(8 * W * G * F, "calls"), i64, W * G * F)
        self.calls = self.calls.reshape(W, G, F)
        self.versions = arena.view(arena.alloc(8 * W * G, "call versions"), i64, W * G)
        self.versions = self.versions.reshape(W, G)
        rings = arena.view(arena.alloc(8 * W * DEPTH * F, "flight"), i64, W * DEPTH * F)
        self.rings = rings.reshape(W, DEPTH, F)
        self.flight_pos = arena.view(arena.alloc(8 * W, "flight pos"), i64, W)

    def read_call(self, rank: int, gid: int) -> np.ndarray | None:
        """Reader side of the seqlock (the owner, group.py's CallScope, makes the version
        odd, rewrites the record, makes it even again): a consistent copy of rank's record on gid, or None if it was
        being rewritten (the caller simply looks again on its next check)."""
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
            import signal
            return f"died (killed by {signal.Signals(-info).name})"
        if s == DEAD:
            return f"died (exit code {info})"
        return STATUS_NAMES.get(s, f"status {s}")
