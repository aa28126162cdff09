"""Failure watching: what a stalled wait checks, and the report it raises.

runtime/wait.py polls; every millisecond or so it asks a watch whether the wait
can still succeed. A `PeerWatch` is built by a group for one wait on one peer
(group rank `peer`, for `what`: "receive from", "meet at a barrier with", ...)
and looks, in this order, at:
    the job's abort flag      another rank failed: RankFailure naming it
                              (this rank itself, if an async call of it failed);
    the launcher              gone: RankFailure, the rank stops;
    the peer's status         returned from its function without making this
                              call: CollectiveMismatch;
    the peer's call record    (runtime/records.py) at this sequence number, a
                              different call: CollectiveMismatch naming both;
    the deadline              passed: CollectiveTimeout, whose text opens with
                              one sentence on where every rank is (flight.py,
                              diagnose), names the hung ranks (`hung`) and
                              carries every member's last calls from the flight
                              recorder (and, with MINIDIST_TRACE_DIR, a Chrome
                              trace of them).
Which ranks are hung: each check stamps this rank's beat on the board, so a rank
whose beat is older than STALE is not in a wait (stopped, in a loop, asleep). A
rank that is waiting is not hung: it waits for the hung one. So the hung ranks
are those not waiting that are behind this call, else inside it, else anywhere
in the job (see `_hung`).
Nothing here runs while data flows: only a wait that is not satisfied at once
builds a watch, so it costs nothing on the fast path.

Read next: runtime/group.py
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np


from minidist.runtime import call
from minidist.runtime.errors import CollectiveMismatch, CollectiveTimeout, RankFailure
from minidist.runtime.job import DONE, EXITING, RUNNING

STALE = 0.5                    # seconds without a beat: the rank is not waiting (see above)


class PeerWatch:
    """Decides whether a wait on group rank `peer` can still succeed."""

    def __init__(self, group, peer: int, ready: Callable[[], bool], what: str):
        self.g, self.peer, self.ready, self.what = group, peer, ready, what

    def _doing(self) -> str:
        g = self.g
        if g.record[call.OP] == call.encode("p2p"):
            return f"point-to-point on group '{g.name}'"
        return call.describe(g.record, g.group_names)

    def check(self, late: bool) -> None:
        g, board = self.g, self.g.board
        board.beats[g.global_rank] = time.monotonic_ns()     # this rank is waiting, alive
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
            hung, why = self._hung(missing)
            raise CollectiveTimeout(self._timeout_text(hung, why), missing=missing, hung=hung)

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

    def _stale(self, peer: int) -> bool:
        """Global rank `peer` is not in a wait: its beat is older than STALE (or it never
        waited at all)."""
        stale = min(STALE, self.g.timeout / 2) * 1e9
        return time.monotonic_ns() - self.g.board.beats[peer] > stale

    def _hung(self, missing: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
        """(the hung global ranks, why): the first of these that names anyone.
            1. group ranks behind this call that are not waiting (a rank behind that IS
               waiting, in an earlier call or on another group, waits for the hung one);
            2. group ranks inside this call, not done with it, that are not waiting;
            3. ranks of the job outside this group that are running and not waiting
               (the members this rank waits for wait on one of them);
            4. the ranks behind this call, else the peer this rank waited for."""
        g, board = self.g, self.g.board
        behind = tuple(g.ranks[r] for r in missing if self._stale(g.ranks[r]))
        if behind:
            return behind, "not waiting for anyone and behind this call"
        inside = []
        for peer in g.ranks:
            rec = board.read_call(peer, g.gid)
            if peer != g.global_rank and rec is not None and rec[call.SEQ] == \
                    g.record[call.SEQ] and rec[call.STATE] == call.STARTED and self._stale(peer):
                inside.append(peer)
        if inside:
            return tuple(inside), ("inside this call but not waiting for anyone (stopped, "
                                   "looping or asleep)")
        outside = tuple(q for q in range(board.world_size) if q not in g.ranks and
                        board.status[q] == RUNNING and self._stale(q))
        if outside:
            return outside, ("outside this group, running and not waiting for anyone while "
                             "this group's ranks wait")
        if missing:
            return tuple(g.ranks[r] for r in missing), "behind this call (not reached)"
        return (g.ranks[self.peer],), "the peer this rank waited for, which never answered"

    def _timeout_text(self, hung: tuple[int, ...], why: str) -> str:
        g = self.g
        who = f"global rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))}: {why}"
        recorder = g.records.recorder                 # the hang in one sentence leads
        return (f"{g.prefix} {recorder.diagnose(g.group_names, hung)}\n"
                f"{g.prefix} {self._doing()} waited {g.timeout:g} s to {self.what} group rank "
                f"{self.peer} (global rank {g.ranks[self.peer]}); {who}, so "
                f"{'they are' if len(hung) > 1 else 'it is'} hung (or called a different "
                "collective, or the same ones in a different order).\n"
                + g.records.recorder.render(g.ranks, g.group_names) + self._trace_file())

    def _trace_file(self) -> str:
        """With MINIDIST_TRACE_DIR set, write every member's last calls as a Chrome trace."""
        folder = os.environ.get("MINIDIST_TRACE_DIR")
        if not folder:
            return "\n(set MINIDIST_TRACE_DIR to also get these calls as a Chrome trace)"
        g = self.g
        path = os.path.join(folder, f"minidist-hang-rank{g.global_rank}-{os.getpid()}.json")
        g.records.recorder.trace(g.ranks, g.group_names).write(path)
        return f"\nChrome trace of these calls: {path} (open in ui.perfetto.dev)"
