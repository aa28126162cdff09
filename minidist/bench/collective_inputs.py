"""Collective inputs: what a collective benchmark feeds each rank, and how it checks the answer.

Both the benchmark of minidist's own collectives (bench/collectives.py, on shared memory)
and the one of MPI's (bench/mpi_collectives.py, under mpiexec) time the same calls on the
same data, so that their rows compare: rank r passes x_r = r + 1 everywhere (scatter's
root passes row r = r + 1), whose sum, gather and scatter are known in closed form, and
every timed result is counted element by element against that answer.

Sizes: a row's "size" is the bytes one rank contributes (all_gather, gather, scatter: the
bytes of the whole result), rounded so that every op splits evenly over W ranks.
Read next: bench/collectives.py, bench/mpi_collectives.py
"""

from __future__ import annotations

import numpy as np


def counts(op: str, size: int, W: int, itemsize: int) -> tuple[int, int]:
    """(elements of one rank's input -- scatter: of one row --, bytes in the size column)."""
    if op in ("all_gather", "gather", "scatter"):
        per_rank = max(1, size // (W * itemsize))
        return per_rank, per_rank * W * itemsize
    n = max(1, size // itemsize)
    if op in ("reduce_scatter", "all_to_all"):
        n = max(W, n // W * W)                  # even splits: every rank gets n / W
    return n, n * itemsize


def default_iters(nbytes: int) -> tuple[int, int]:
    """(warm-up calls, timed repeats) for a message of nbytes: fewer for big messages."""
    return (3, 20) if nbytes <= 1 << 20 else (1, 7) if nbytes <= 16 << 20 else (1, 3)


def make_input(op: str, count: int, W: int, rank: int, dtype):
    """Rank r passes x_r = r + 1 everywhere; scatter's root (rank 0) passes row r = r + 1."""
    if op != "scatter":
        return np.full(count, rank + 1, dtype)
    rows = np.repeat(np.arange(1, W + 1, dtype=dtype), count).reshape(W, count)
    return rows if rank == 0 else None


def count_wrong(op: str, out, count: int, W: int, rank: int, dtype) -> int:
    """Elements of `out` that differ from the exact answer for make_input's inputs (root 0)."""
    total, ranks = W * (W + 1) // 2, np.arange(1, W + 1, dtype=dtype)
    exp = {"all_reduce": lambda: np.full(count, total, dtype),
           "reduce": lambda: np.full(count, total, dtype) if rank == 0 else None,
           "broadcast": lambda: np.full(count, 1, dtype),
           "reduce_scatter": lambda: np.full(count // W, total, dtype),
           "all_gather": lambda: np.repeat(ranks, count),
           "gather": lambda: np.repeat(ranks, count) if rank == 0 else None,
           "scatter": lambda: np.full(count, rank + 1, dtype),
           "all_to_all": lambda: np.repeat(ranks, count // W)}[op]()
    if exp is None or out is None:
        return 0 if exp is None and out is None else count
    got = np.asarray(out).reshape(-1)
    return int(np.count_nonzero(got != exp)) if got.size == exp.size else max(got.size, exp.size)
