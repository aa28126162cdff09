"""Call records: how a rank numbers its calls on a group and shows them to its peers.

Every collective call on a group gets the next sequence number s of that
group, and its record (runtime/call.py: op, dtype, shape, root, op, algo) is
shown in two places:
    the job board   board.calls[rank, gid], the call this rank is in on this
                    group (or made last), so a waiting peer can compare its
                    own call with it (runtime/watch.py);
    the flight      this rank's ring of its last calls on any group, for hang
    recorder        reports (runtime/flight.py).

One rank's view of one call:
    1. begin: s += 1; make the board version odd, copy the call's template
       (packed once per distinct call, see `template`) and s into the board
       record, make the version even again (a seqlock: a reader that sees the
       same even version before and after its copy has a consistent record);
       copy the record into the flight ring, with the start time;
    2. the algorithm runs;
    3. end: write the state (done or failed) into the board record, and the
       state and end time into the flight ring.
That is one write of the record per call, two stores around it, and nothing
allocated: the template is reused, and every store goes through int64
memoryviews (runtime/flight.py, `cells`).

A call's `key` is a 63-bit digest of its identity without the sequence number:
the pair (s, key) names a call in two integers, which is how a barrier checks
that every rank arrived in the same call (runtime/group.py).

Read next: runtime/flight.py, runtime/watch.py
"""

from __future__ import annotations

import hashlib

import numpy as np

from minidist.runtime import call
from minidist.runtime.flight import FlightRecorder, cells


class Template:
    """A packed call with seq 0 and state STARTED (`cells`), and its identity `key`."""

    __slots__ = ("record", "cells", "key")

    def __init__(self, record: np.ndarray):
        record[call.STATE] = call.STARTED
        self.record, self.cells = record, cells(record)
        self.key = call_key(record)


def call_key(record: np.ndarray) -> int:
    """63-bit digest of a record's identity with the sequence number left out; a recv
    has the key of the send it expects (call.identity)."""
    ident = np.frombuffer(call.identity(record), np.int64).copy()
    ident[call.SEQ - 1] = 0
    return int.from_bytes(hashlib.blake2b(ident.tobytes(), digest_size=8).digest(),
                          "little") >> 1


MAX_TEMPLATES = 4096           # distinct calls remembered per group (then forgotten)


class CallRecords:
    """This rank's records on one group: `seq` (calls so far), `current` (the board record,
    a NumPy view peers read) and `key` (the identity key of the call in progress)."""

    def __init__(self, board, gid: int, rank: int, recorder: FlightRecorder):
        self.gid, self.seq, self.recorder = gid, 0, recorder
        self.current = board.calls[rank, gid]
        self._rec = cells(self.current)
        self._version = cells(board.versions[rank, gid:gid + 1])
        self._writes = 0                                    # the seqlock's version, even
        self._templates: dict[tuple, Template] = {}

    def template(self, op: str, x: np.ndarray | None, root: int | None = None,
                 reduce_op: str | None = None, algo: str = "",
                 p2p: tuple[int, int, int] | None = None) -> Template:
        """The template of a call, packed once per distinct call and reused after."""
        key = (op, None if x is None else (x.dtype, x.shape), root, reduce_op, algo, p2p)
        t = self._templates.get(key)
        if t is None:
            if len(self._templates) >= MAX_TEMPLATES:
                self._templates.clear()
            t = self._templates[key] = Template(
                call.pack(self.gid, 0, op, x, root, reduce_op, algo, p2p))
        return t

    def begin(self, t: Template) -> int:
        """Step 1: number the call, publish it (seqlock) and record it; returns seq."""
        self.seq = s = self.seq + 1
        rec, version = self._rec, self._version
        self._writes = w = self._writes + 2
        version[0] = w - 1                    # odd: a reader retries
        rec[:] = t.cells
        rec[call.SEQ] = s
        version[0] = w
        self.recorder.start(rec)
        return s

    def end(self, state: int) -> None:
        """Step 3: the call is done (or failed), on the board and in the flight ring."""
        self._rec[call.STATE] = state
        self.recorder.finish(state)
