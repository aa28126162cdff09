"""The oracle: what every collective must return, computed in one process.

Each function takes the per-rank inputs as a list (xs[r] is what rank r
passes) and returns the per-rank outputs as a list (out[r] is what rank r
must get back). There are no messages, no chunks and no schedules here: this
file is deliberately boring, so that it is obviously right and every
algorithm in ring.py, tree.py, halving_doubling.py, direct.py and
all_to_all.py can be tested against it.

Reductions fold in rank order, ((x0 (op) x1) (op) x2) ..., then apply the
op's last step (avg divides by W). That is the canonical order: direct.py
must match it bitwise; the other algorithms add in other orders and match it
to rounding (exactly for integers, max and min).

Shapes: xs[r] has the same shape and dtype on every rank, except in
all_to_all where only the trailing dimensions must agree.
Read next: reduce_ops.py, then ring.py.
"""

from __future__ import annotations

import numpy as np

from minidist.collectives.reduce_ops import check_op, finish, fold_in_order


def _reduced(xs: list[np.ndarray], op: str) -> np.ndarray:
    """x0 (op) x1 (op) ... (op) x_{W-1} in rank order, then the op's last step."""
    check_op(op, xs[0].dtype, "simulated")
    return finish(op, fold_in_order(op, xs), len(xs))


def broadcast(xs: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
    """Every rank gets a copy of the root's array."""
    return [xs[root].copy() for _ in xs]


def reduce(xs: list[np.ndarray], root: int = 0, op: str = "sum") -> list[np.ndarray | None]:
    """The root gets the reduction over all ranks; every other rank gets None."""
    total = _reduced(xs, op)
    return [total if r == root else None for r in range(len(xs))]


def all_reduce(xs: list[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """Every rank gets the reduction over all ranks."""
    total = _reduced(xs, op)
    return [total.copy() for _ in xs]


def reduce_scatter(xs: list[np.ndarray], op: str = "sum") -> list[np.ndarray]:
    """Rank r gets chunk r of np.array_split(reduction.ravel(), W), a 1-D array."""
    total = _reduced(xs, op).reshape(-1)
    return [chunk.copy() for chunk in np.array_split(total, len(xs))]


def all_gather(xs: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank gets np.stack(xs): shape (W, *x.shape), row r from rank r."""
    stacked = np.stack(xs)
    return [stacked.copy() for _ in xs]


def gather(xs: list[np.ndarray], root: int = 0) -> list[np.ndarray | None]:
    """The root gets np.stack(xs); every other rank gets None."""
    return [np.stack(xs) if r == root else None for r in range(len(xs))]


def scatter(x_root: np.ndarray, W: int) -> list[np.ndarray]:
    """Rank r gets row r of the root's (W, ...) array."""
    return [x_root[r].copy() for r in range(W)]


def all_to_all(xs: list[np.ndarray], split_sizes: list[list[int]]) -> list[np.ndarray]:
    """Rank r gets the concatenation, over source ranks s = 0..W-1, of the r-th
    piece of xs[s] cut along axis 0 into pieces of split_sizes[s] rows."""
    W = len(xs)
    pieces = []  # pieces[s][r]: rows of rank s's input that go to rank r
    for x, sizes in zip(xs, split_sizes):
        bounds = np.cumsum([0, *sizes])
        pieces.append([x[bounds[r]:bounds[r + 1]] for r in range(W)])
    return [np.concatenate([pieces[s][r] for s in range(W)]) for r in range(W)]
