"""The three ways a distributed run goes wrong, each a distinct exception.

A distributed bug is always named: which rank, which collective, which call
number, which group. These exceptions carry that information as attributes
as well as in their message, so tests (and users) can check it.

    RankFailure         a rank raised, died or was killed; raised by `spawn`
                        on the launching side and by the surviving ranks
                        that were waiting for it.
    CollectiveTimeout   a rank waited past its deadline: usually a peer is
                        hung (SIGSTOP, endless loop) or skipped a call.
    CollectiveMismatch  two ranks made different calls at the same point
                        (op, order, dtype, shape, root): never silent garbage.

Read next: runtime/wait.py (how every wait notices these).
"""

from __future__ import annotations


class RankFailure(RuntimeError):
    """A rank failed. `rank` is the one to blame (global rank): the first that failed,
    or, when that was a timeout, the first rank it found hung; `hung` lists every rank
    a timeout found hung; `failures` maps every failed rank to the text of its error."""

    def __init__(self, message: str, rank: int, failures: dict[int, str] | None = None,
                 hung: tuple[int, ...] = ()):
        super().__init__(message)
        self.rank = rank
        self.failures = dict(failures or {})
        self.hung = tuple(hung)


class CollectiveTimeout(RuntimeError):
    """A wait inside a collective passed its deadline. `missing` lists the
    group ranks that had not reached this call, `hung` the same ranks as
    global ranks (the ones the launcher's report names as hung)."""

    def __init__(self, message: str, missing: tuple[int, ...] = (),
                 hung: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = tuple(missing)
        self.hung = tuple(hung)


class CollectiveMismatch(RuntimeError):
    """Ranks of one group made different calls at the same sequence number."""


def rank_prefix(rank: int, world_size: int) -> str:
    """The tag every in-rank error message starts with: "[rank r/W]"."""
    return f"[rank {rank}/{world_size}]"
