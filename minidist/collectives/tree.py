"""Binomial-tree collectives: ceil(log2 W) rounds, the whole message on every edge.

Number the ranks relative to the root, v = (rank - root) % W. In a binomial
tree the parent of v is v with its lowest set bit cleared, and the children
of v are v + 2^j for every 2^j below v's lowest set bit (below W for the
root) that is still < W. Rank v's subtree is the contiguous block of relative
ranks [v, v + lowbit(v)), clipped at W. Example, relative ranks for W = 6,
drawn by `render(6)` (tests/collectives/test_tree.py checks this picture):

    0
    ├── 1
    ├── 2
    │   └── 3
    └── 4
        └── 5

    reduce      round j = 0, 1, ...: a rank whose bit j is set sends its partial
                result to v - 2^j and stops; the others add the child v + 2^j.
    broadcast   the same tree run backwards: receive from the parent, then
                send to the children, largest subtree first.
    gather      like reduce, but children's blocks are appended, not added.
    scatter     like broadcast, but each child gets only its subtree's block.
    all_reduce  reduce to rank 0, then broadcast from rank 0.

The whole message crosses ceil(log2 W) edges in sequence, so the latency term
grows like log W (ring: W), but every edge carries all n bytes (ring: n/W per
step). Trees win for small messages, rings for large ones (cost.py decides).

One rank's view (reduce, relative rank v):
    1. for j = 0, 1, ... while 2^j < W:
         if bit j of v is set: send my partial result to v - 2^j; done.
         elif v + 2^j < W: receive the child's partial result and combine it in.
    2. v = 0 (the root) now holds the result for all W ranks.

Shapes: x identical shape and dtype on every rank (scatter: the root's
xs is (W, *shape)). Communication: send/recv along tree edges only.

References:
    Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
        operations in MPICH", IJHPCA 19(1), 49-66 (binomial broadcast and reduce).
    Sanders, Speck & Traeff 2009, "Two-tree algorithms for full bandwidth broadcast,
        reduction and scan", Parallel Computing 35(12) (pipelined double trees, not
        implemented here).
Read next: halving_doubling.py (log W rounds without the extra broadcast).
"""

from __future__ import annotations

import numpy as np

from minidist.collectives.reduce_ops import combine, finish

_META_DIMS = 8          # scatter's shape header holds up to 8 dimensions
_META_DTYPE_INTS = 3    # ... and a dtype string of up to 24 bytes


def _lowbit(v: int) -> int:
    return v & -v


def _subtree(v: int, W: int) -> int:
    """Number of relative ranks in v's subtree: [v, v + lowbit(v)) clipped at W."""
    top = 1 << (W - 1).bit_length() if v == 0 else _lowbit(v)
    return min(top, W - v)


def _children(v: int, W: int) -> list[int]:
    """v's children, largest subtree first: v + 2^j for 2^j < lowbit(v), v + 2^j < W."""
    span = 1 << (W - 1).bit_length() if v == 0 else _lowbit(v)
    masks = [1 << j for j in range(span.bit_length() - 1)]
    return [v + m for m in reversed(masks) if v + m < W]


def render(W: int) -> str:
    """The binomial tree over relative ranks 0..W-1 as text, children in ascending order."""
    lines = ["0"]

    def walk(v: int, indent: str) -> None:
        kids = sorted(_children(v, W))
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{indent}{'└── ' if last else '├── '}{child}")
            walk(child, indent + ("    " if last else "│   "))

    walk(0, "")
    return "\n".join(lines)


def _reduce_into(acc: np.ndarray, group, root: int, op: str) -> None:
    """Combine every rank's `acc` into the root's `acc` (in place) up a binomial tree."""
    rank, W = group.rank, group.size
    v = (rank - root) % W
    scratch = np.empty_like(acc)
    mask = 1
    while mask < W:
        if v & mask:                                   # my subtree is complete: hand it up
            group.send(acc, (v - mask + root) % W)
            return
        if v + mask < W:                               # child covers [v+mask, v+2*mask)
            group.recv((v + mask + root) % W, out=scratch)
            combine(op, acc, scratch, out=acc)         # lower relative ranks first
        mask <<= 1


def _broadcast_into(buf: np.ndarray, group, root: int) -> None:
    """Copy the root's `buf` into every rank's `buf` (in place) down a binomial tree."""
    rank, W = group.rank, group.size
    v = (rank - root) % W
    if v:
        group.recv((v - _lowbit(v) + root) % W, out=buf)
    for child in _children(v, W):
        group.send(buf, (child + root) % W)


def reduce(x: np.ndarray, group, root: int = 0, op: str = "sum") -> np.ndarray | None:
    """Return x_0 (op) ... (op) x_{W-1} on the root and None elsewhere.

    Algorithm (this rank's view, relative rank v = (rank - root) % W): in round
    j, if bit j of v is set send the partial result to v - 2^j and stop, else
    receive from v + 2^j (if it exists) and combine it in.
    Invariant: after round j, relative rank v (bits 0..j clear) holds the
        combination of relative ranks [v, min(v + 2^(j+1), W)).

    Shapes: x identical on every rank; the root gets a new array of x's shape.
    Cost: ceil(log2 W) (alpha + n beta + n gamma) for n = x.nbytes.
    Numerics: relative rank order with binomial association, e.g. W = 8:
        ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), x_i meaning relative rank i.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (binomial reduce).
    """
    acc = x.reshape(-1).copy()
    _reduce_into(acc, group, root, op)
    if group.rank != root:
        return None
    return finish(op, acc, group.size).reshape(x.shape)


def broadcast(x: np.ndarray, group, root: int = 0) -> np.ndarray:
    """Return a copy of the root's x on every rank.

    Algorithm (this rank's view, relative rank v): receive x from the parent
    v - lowbit(v) (unless v = 0), then send it to each child v + 2^j,
    largest subtree first, so the deepest branch starts earliest.
    Invariant: after round j every relative rank below 2^(j+1) has x.

    Shapes: x identical shape and dtype on every rank; only the root's values
        are read. Returns a new array.
    Cost: ceil(log2 W) (alpha + n beta).
    Numerics: copies only; bitwise the root's array everywhere.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (binomial broadcast).
    """
    buf = x.reshape(-1).copy()
    _broadcast_into(buf, group, root)
    return buf.reshape(x.shape)


def all_reduce(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return x_0 (op) ... (op) x_{W-1} on every rank: tree reduce to rank 0, then broadcast.

    Shapes: x any shape, identical on every rank; returns a new array, same shape.
    Cost: 2 ceil(log2 W) (alpha + n beta) + ceil(log2 W) n gamma. Twice the
        latency of recursive doubling (halving_doubling.py), but the broadcast
        half only copies, so ranks are bitwise identical by construction.
    Numerics: as reduce with root 0: rank order, binomial association.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (reduce + broadcast all-reduce).
    """
    acc = x.reshape(-1).copy()
    _reduce_into(acc, group, 0, op)
    if group.rank == 0:
        acc[...] = finish(op, acc, group.size)
    _broadcast_into(acc, group, 0)
    return acc.reshape(x.shape)


def gather(x: np.ndarray, group, root: int = 0) -> np.ndarray | None:
    """Return np.stack([x_0, ..., x_{W-1}]) on the root and None elsewhere.

    Algorithm (this rank's view, relative rank v): keep a block of rows for
    relative ranks [v, v + subtree); in round j receive the block of child
    v + 2^j into rows [2^j, ...) or, if bit j of v is set, send the block
    gathered so far to the parent and stop. The root rotates its rows from
    relative to absolute rank order.

    Shapes: x identical on every rank; the root gets (W, *x.shape).
    Cost: ceil(log2 W) alpha + (W-1) m beta for m = x.nbytes (the root receives
        W-1 rows in total; a subtree's rows travel together).
    Numerics: copies only.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (binomial trees).
    """
    rank, W = group.rank, group.size
    v = (rank - root) % W
    rows = np.empty((_subtree(v, W), x.size), x.dtype)
    rows[0] = x.reshape(-1)
    mask = 1
    while mask < W:
        if v & mask:
            group.send(rows[:min(mask, W - v)], (v - mask + root) % W)
            return None
        if v + mask < W:
            group.recv((v + mask + root) % W, out=rows[mask:mask + min(mask, W - v - mask)])
        mask <<= 1
    return np.roll(rows, root, axis=0).reshape(W, *x.shape)   # row r <- relative (r-root)


def scatter(xs: np.ndarray | None, group, root: int = 0) -> np.ndarray:
    """Return xs[rank] of the root's (W, *shape) array, on every rank.

    Algorithm (this rank's view, relative rank v): first the root broadcasts
    the row shape and dtype down the tree (the other ranks may pass xs=None);
    then receive the rows of my subtree [v, v + subtree) from the parent
    (the root rotates its rows to relative order) and send each child
    v + 2^j the rows of its subtree, largest first. Keep row 0.

    Shapes: xs (W, *shape) on the root, ignored elsewhere; returns (*shape).
    Cost: 2 ceil(log2 W) alpha + (W-1) m beta for row size m (the shape header
        costs the extra ceil(log2 W) alpha).
    Numerics: copies only.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (binomial trees).
    """
    rank, W = group.rank, group.size
    v = (rank - root) % W
    shape, dtype = _scatter_header(xs, group, root)
    size = int(np.prod(shape))
    if v == 0:
        rows = np.roll(xs.reshape(W, size), -root, axis=0)     # row i <- rank (i+root)
    else:
        rows = np.empty((_subtree(v, W), size), dtype)
        group.recv((v - _lowbit(v) + root) % W, out=rows)
    for child in _children(v, W):
        first = child - v
        group.send(rows[first:first + _subtree(child, W)], (child + root) % W)
    return rows[0].reshape(shape).copy()


def _scatter_header(xs: np.ndarray | None, group, root: int) -> tuple[tuple[int, ...], np.dtype]:
    """Broadcast the root's row shape and dtype, packed into a small int64 vector."""
    meta = np.zeros(1 + _META_DIMS + _META_DTYPE_INTS, np.int64)
    if group.rank == root:
        row_shape, code = xs.shape[1:], xs.dtype.str.encode()
        if len(row_shape) > _META_DIMS or len(code) > 8 * _META_DTYPE_INTS:
            raise ValueError(
                f"scatter: rows of shape {row_shape} and dtype {xs.dtype} do not fit the "
                f"scatter header (at most {_META_DIMS} dims, a dtype string of at most "
                f"{8 * _META_DTYPE_INTS} bytes). Reshape xs to (W, -1) first.")
        meta[0], meta[1:1 + len(row_shape)] = len(row_shape), row_shape
        meta[1 + _META_DIMS:].view(np.uint8)[:len(code)] = np.frombuffer(code, np.uint8)
    _broadcast_into(meta, group, root)
    shape = tuple(int(d) for d in meta[1:1 + meta[0]])
    code = meta[1 + _META_DIMS:].tobytes().rstrip(b"\0").decode()
    return shape, np.dtype(code)
