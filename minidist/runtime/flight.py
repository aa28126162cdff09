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
    3. on a timeout: read all rings, say in one sentence where every rank is
       (`diagnose`: "rank 2 is stuck in all_reduce #17 on 'tp1'; ranks 0, 1, 3
       are in #18."), then print them (`render`); with MINIDIST_TRACE_DIR set,
       also write them as a Chrome trace (`trace`).

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
from typing import Sequence

import numpy as np

from minidist.observe.trace import Event, Trace
from minidist.runtime import call

DEPTH = 16                      # calls remembered per rank
# Called as observer(row) when a call ends, when set: row = the call's record (call.py's
# layout, times from time.time_ns), in shared memory, to be copied, not kept.
# observe/run_dir.py's trace records every call this way. None: no cost but a test.
observer = None


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
        if observer is not None:
            observer(row)

    def last(self, rank: int, k: int = 4) -> list[np.ndarray]:
        """The k most recent records of `rank`, oldest first."""
        p = int(self.pos[rank])
        return [self.rings[rank, i % DEPTH].copy() for i in range(max(0, p - k), p)]

    def trace(self, ranks, names: dict[int, str]):
        """Every remembered call of `ranks` as a Chrome trace (observe/trace.py): one row
        per rank, one bar per call; a call still running ends at "now"."""
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

    def diagnose(self, names: dict[int, str], hung: Sequence[int] = ()) -> str:
        """The hang in one sentence, from every rank's ring (`hang_sentence`)."""
        return hang_sentence({r: _current(self.last(r, DEPTH))
                              for r in range(self.rings.shape[0])}, names, hung)


def _current(recs: list[np.ndarray]) -> np.ndarray | None:
    """The call a rank is in: its newest record still running (an async call may run on a
    worker thread beside a newer finished one), else its newest record; None: no call."""
    running = [rec for rec in recs if rec[call.STATE] == call.STARTED]
    return (running or recs or [None])[-1]


def _never_finished(rec: np.ndarray) -> bool:
    """Still running, or ended by an error (a timeout, an abort): the rank never left the
    call having done it, so the sentence puts it in the call, not after it."""
    return int(rec[call.STATE]) in (call.STARTED, call.FAILED)


def hang_sentence(current: dict[int, np.ndarray | None], names: dict[int, str],
                  hung: Sequence[int] = ()) -> str:
    """Where every rank is, in one sentence, the hung ranks first:
        "rank 2 is stuck in all_reduce #17 on 'tp1'; ranks 0, 1, 3 are in #18."
    current: global rank -> the record of the call it is in or made last (None: none); a
    call that ended in an error (a rank that timed out too while the report was written)
    still counts as the rank being in it;
    hung: the ranks a timeout blames (runtime/watch.py). Ranks in the same place share a
    clause; a clause on the same op and group as the one before names only the number."""
    clauses, prev = [], None
    places: dict[tuple, list[int]] = {}
    for r in sorted(current, key=lambda r: (r not in hung, r)):
        rec = current[r]
        key = (r in hung, None) if rec is None else \
            (r in hung, _never_finished(rec), int(rec[call.OP]),
             int(rec[call.GID]), int(rec[call.SEQ]))
        places.setdefault(key, []).append(r)
    for key, ranks in places.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
        one = len(ranks) == 1
        if key[1] is None:
            clauses.append(f"{who} {'has' if one else 'have'} made no collective call")
            continue
        running, op, gid, seq = key[1:]
        what = f"#{seq}" if prev == (op, gid) else \
            f"{call.decode(op)} #{seq} on '{names.get(gid, f'group#{gid}')}'"
        prev = (op, gid)
        if running:
            verb = ("is stuck in" if one else "are stuck in") if key[0] else \
                ("is in" if one else "are in")
            clauses.append(f"{who} {verb} {what}")
        else:
            clauses.append(f"{who} finished {what} and {'has' if one else 'have'} made no "
                           "call since")
    return "; ".join(clauses) + "."


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 3] -> "0, 1, 3"; a run of four or more consecutive ranks -> "4-7"."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 3 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return ", ".join(out)
