"""Flight recorder: each rank's last few collective calls, kept in shared memory.

When a distributed job hangs, the question is always "what was every rank
doing?". The answer must be readable even for a rank that cannot answer: one
that is stopped (SIGSTOP), spinning in a loop, or dead. So every rank writes
a record of each collective call (op, group, sequence number, bytes, state,
start and end time; see runtime/call.py) into its own ring of R slots in the
job's shared memory, and any rank can read every ring.

One rank's view:
    1. on entering a call: write the record into slot pos % R with state
       "started", then advance pos;
    2. on leaving it: set the same slot's state to "done" (or "failed") and
       its end time;
    3. on a timeout: read all rings and print them (`render`); with
       MINIDIST_TRACE_DIR set, also write them as a Chrome trace (`trace`).

Cost: two small writes into shared memory per call; no communication. (The
writes go through `cells`, int64 memoryviews: a store there takes ~40 ns, against
~60-150 ns through a NumPy element, and this sits on every call's path.)

The recorder is part of the runtime (every wait's report needs it); drawing its
calls as a timeline uses observe/trace.py, which knows nothing of the runtime.

Reference: the idea (and the name) follow PyTorch's NCCL flight recorder.
Read next: runtime/records.py
"""

from __future__ import annotations

import time

import numpy as np

from minidist.runtime import call

DEPTH = 16                      # calls remembered per rank


def cells(a: np.ndarray) -> memoryview:
    """A flat int64 memoryview of a C-contiguous int64 array (shared memory included):
    the fastest way to store or load one number from Python."""
    return memoryview(a).cast("B").cast("q")


class FlightRecorder:
    """The rings of every rank, `rings` (W, DEPTH, NFIELDS) int64 and `pos` (W,),
    both in shared memory; this rank writes only its own row."""

    def __init__(self, rings: np.ndarray, pos: np.ndarray, rank: int):
        self.rings, self.pos, self.rank = rings, pos, rank
        self._rows = [cells(row) for row in rings[rank]]    # my DEPTH slots
        self._row = self._rows[0]
        self._pos = cells(pos)

    def start(self, rec: memoryview) -> None:
        """Record a call entering (`rec`: the cells of its record, state STARTED, end time
        0). The position is read from shared memory: every group of this rank writes the
        same ring."""
        p = self._pos[self.rank]
        self._row = row = self._rows[p % DEPTH]
        row[:] = rec
        row[call.T_START] = time.time_ns()
        self._pos[self.rank] = p + 1

    def finish(self, state: int = call.DONE) -> None:
        row = self._row
        row[call.T_END] = time.time_ns()
        row[call.STATE] = state

    def last(self, rank: int, k: int = 4) -> list[np.ndarray]:
        """The k most recent records of `rank`, oldest first."""
        p = int(self.pos[rank])
        return [self.rings[rank, i % DEPTH].copy() for i in range(max(0, p - k), p)]

    def trace(self, ranks, names: dict[int, str]):
        """Every remembered call of `ranks` as a Chrome trace (observe/trace.py): one row
        per rank, one bar per call; a call still running ends at "now"."""
        from minidist.observe.trace import Event, Trace
        now_us = time.time_ns() / 1e3
        events = []
        for r in ranks:
            for rec in self.last(r, DEPTH):
                end = rec[call.T_END] / 1e3 if rec[call.T_END] else now_us
                state = call.STATE_NAMES[int(rec[call.STATE])]
                events.append(Event(call.describe(rec, names), int(r), rec[call.T_START] / 1e3,
                                    max(end, rec[call.T_START] / 1e3),
                                    {"state": state, "bytes": int(rec[call.NBYTES])},
                                    cat=call.decode(int(rec[call.OP]))))
        return Trace(events).shifted()

    def render(self, ranks, names: dict[int, str], k: int = 4) -> str:
        """Text table of the last k calls of each rank in `ranks` (global ranks)."""
        now = time.time_ns()
        lines = ["flight recorder (last calls per rank, oldest first):"]
        for r in ranks:
            recs = self.last(r, k)
            if not recs:
                lines.append(f"  rank {r}: no collective calls yet")
            for rec in recs:
                state = call.STATE_NAMES[int(rec[call.STATE])]
                end = rec[call.T_END] if rec[call.T_END] else now
                ms = (end - rec[call.T_START]) / 1e6
                what = call.describe(rec, names)
                lines.append(f"  rank {r}: {what:<60} {int(rec[call.NBYTES]):>10} B"
                             f"  {state:<7} {ms:9.1f} ms")
        return "\n".join(lines)
