"""The launcher's failure report: one text that says who is to blame, and why.

When a job fails, every rank has something to say: the rank that raised sends
its error and traceback, the ranks that were waiting for it say they stopped
because of it, a rank that died says nothing (its exit code speaks for it),
and a hung rank can say nothing at all. The launcher (runtime/launch.py)
collects all of it in `Reports` and raises one RankFailure whose text reads
top down:

    headline     the rank to blame: "rank 2 of 4 is hung: rank 0 timed out
                 waiting for it" when the first failure was a timeout (the
                 ranks that never reached the call, CollectiveTimeout.hung),
                 else "rank 1 of 4 failed" (or "..., and every other rank the
                 same way", e.g. a setup error)
    the error    the first failing rank's error, once (a timeout's text opens
                 with the hang in one sentence, "rank 2 is stuck in all_reduce #17
                 on 'tp1'; ranks 0, 1, 3 are in #18.", runtime/flight.py, and
                 carries the flight recorder: the last calls of every member)
    the others   "ranks [...] failed the same way" (e.g. every rank hit the
                 same setup error), "ranks [...] stopped as a consequence"
    traceback    the first failing rank's stack, without repeating the error

`RankFailure.failures` keeps every rank's own text, `rank` the one to blame
and `hung` the ranks a timeout named.

Read next: runtime/group.py (where timeouts and mismatches are detected).
"""

from __future__ import annotations

import re
import signal
import textwrap

from minidist.runtime.errors import RankFailure


class Reports:
    """What the launcher has heard from a job of W ranks, and the report it raises."""

    def __init__(self, W: int):
        self.W = W
        self.failures: dict[int, str] = {}
        self.tracebacks: dict[int, str] = {}
        self.named: dict[int, tuple[int, ...]] = {}     # rank -> ranks its timeout found hung
        self.reported: set[int] = set()
        self.killed: set[int] = set()                   # ranks the launcher SIGKILLed

    def message(self, r: int, msg: tuple) -> None:
        """Rank r's one message: ("ok", result) or ("error", text, traceback[, hung])."""
        self.reported.add(r)
        if msg[0] == "error":
            self.failures[r], self.tracebacks[r] = msg[1], msg[2]
            if len(msg) > 3 and msg[3]:
                self.named[r] = tuple(msg[3])

    def hung(self) -> set[int]:
        return {h for named in self.named.values() for h in named}

    def died(self, r: int, code: int | None) -> None:
        """Rank r exited without a message, with exit code `code` (-signal if killed)."""
        if r in self.killed:
            why = "hung" if r in self.hung() else "still running when the job failed"
            self.failures[r] = f"{why}; killed by the launcher (SIGKILL)"
        elif code is not None and code < 0:
            self.failures[r] = f"killed by {signal.Signals(-code).name}"
        else:
            self.failures[r] = f"exited with code {code} without reporting a result"

    def failure(self, first: int | None) -> RankFailure:
        """The report; `first` is the first rank that failed (the board's abort flag)."""
        failures, W = self.failures, self.W
        if first is None or first not in failures:
            first = min(failures)
        hung = self.named.get(first, ())
        rest = sorted(set(failures) - {first} - set(hung))
        same = [r for r in rest if _gist(failures[r]) == _gist(failures[first])]
        others = [r for r in rest if r not in same]
        msg = _headline(first, hung, W, W > 1 and len(same) == W - 1)
        msg += "\n" + textwrap.indent(failures[first], "  ")
        if same and len(same) < W - 1:        # else the headline says it
            msg += f"\n  (ranks {same} failed the same way)"
        if others:
            msg += f"\n  (ranks {others} stopped as a consequence)"
        if first in self.tracebacks:
            msg += f"\n  (traceback from rank {first} follows)\n{self.tracebacks[first]}"
        return RankFailure(msg, rank=hung[0] if hung else first, failures=failures, hung=hung)


def _headline(first: int, hung: tuple[int, ...], W: int, all_same: bool) -> str:
    if all_same:
        return f"rank {first} of {W} failed, and every other rank the same way:"
    if not hung:
        return f"rank {first} of {W} failed; the other ranks were stopped."
    who = f"rank {hung[0]} of {W} is" if len(hung) == 1 else f"ranks {list(hung)} of {W} are"
    it = "it" if len(hung) == 1 else "them"
    return f"{who} hung: rank {first} timed out waiting for {it}; the other ranks were stopped."


def _gist(text: str) -> str:
    """An error's first line without its "[rank r/W]" tag: equal for ranks that failed
    the same way."""
    return re.sub(r"\[rank \d+/\d+\] ", "", text.split("\n", 1)[0])
