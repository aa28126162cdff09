"""Ring collectives: every rank talks only to its two neighbours, bandwidth-optimally.

Arrange the W ranks of a group in a circle: rank r sends to right = r+1 and
receives from left = r-1 (mod W). Cut the message into W chunks. In each of
W-1 steps every rank passes one chunk to the right while it receives another
from the left, so all W links are busy all the time and every rank sends only
(W-1)/W of the message per phase, which is the least any algorithm can send.
The price is latency: W-1 sequential steps per phase.

    reduce_scatter   W-1 steps: add the arriving partial sum to your own chunk,
                     pass it on; rank r ends with the finished chunk r.
    all_gather       W-1 steps: pass the finished chunks round the circle.
    all_reduce       reduce_scatter then all_gather (2(W-1) steps).
    broadcast/reduce a chain root -> root+1 -> ... (or towards the root), with
                     the message cut into segments so that all links
                     work at once once the pipeline has filled.

One rank's view (all_reduce, rank r of W, chunks c_0..c_{W-1} of x):
    1. step s = 0..W-2: send c_{(r-s-1) % W} right, receive c_{(r-s-2) % W} from the
       left and add it into my copy of that chunk.
    2. now c_r is finished on this rank (and only here); apply the op's last step.
    3. step s = 0..W-2: send c_{(r-s) % W} right, receive c_{(r-s-1) % W} from the left
       and overwrite my copy with it.

Shapes: x is any shape, identical on every rank; chunks follow
np.array_split(x.ravel(), W), so any N works (N < W leaves chunks empty).
Communication: sendrecv with the two ring neighbours only (send/recv for the
chains). Costs are in cost.py with alpha (per message), beta (per byte sent)
and gamma (per byte reduced).

References:
    Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters
        of workstations", J. Parallel Distrib. Comput. 69(2), 117-124.
    Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
        operations in MPICH", IJHPCA 19(1), 49-66 (ring all_gather, cost model).
    Sanders, Speck & Traeff 2009, "Two-tree algorithms for full bandwidth broadcast,
        reduction and scan", Parallel Computing 35(12) (pipelined chains and trees).
Read next: tree.py (fewer steps, more bytes: better for small messages).
"""

from __future__ import annotations

import math

import numpy as np

from minidist.collectives.reduce_ops import combine, finish, ufunc

# A chain (broadcast / reduce) forwards the message in segments of about this many bytes,
# so the next rank can start forwarding before the whole message has arrived (message
# pipelining, nothing to do with pipeline parallelism). A fixed constant (not a tuned
# one) keeps the schedule identical on every rank.
SEGMENT_BYTES = 64 * 1024


def segments(nbytes: int, count: int) -> int:
    """Number of segments for a chain carrying `count` elements in `nbytes` bytes."""
    return max(1, min(count, math.ceil(nbytes / SEGMENT_BYTES)))


def reduce_scatter_steps(chunks: list[np.ndarray], group, op: str) -> None:
    """W-1 ring steps that leave chunks[rank] holding the reduction over all ranks.
    `chunks`: W contiguous arrays (views), any sizes; `group`: anything with rank, size and
    sendrecv (a ProcessGroup, or hierarchical.Members: a subset of one).

    Invariant: after step s, chunks[(rank-s-2) % W] on this rank holds the
    contributions of the s+2 ranks rank-s-1, ..., rank (combined left to
    right along the ring), so after step W-2 chunks[rank] holds all W.
    """
    rank, W = group.rank, group.size
    right, left = (rank + 1) % W, (rank - 1) % W
    for step in range(W - 1):
        send_i, recv_i = (rank - step - 1) % W, (rank - step - 2) % W
        # the incoming partial is combined straight out of the mailbox into chunks[recv_i]
        # (no temporary); the ops are commutative, so mine (op) partial has the same bits
        # as partial (op) mine
        group.sendrecv(chunks[send_i], dst=right, src=left, out=chunks[recv_i],
                       combine=ufunc(op))


def all_gather_steps(chunks: list[np.ndarray], group) -> None:
    """W-1 ring steps that copy every rank's finished chunks[r] into chunks[r] everywhere
    (`chunks` and `group` as reduce_scatter_steps').

    Invariant: after step s this rank holds the finished chunks of ranks
    rank-s-1, ..., rank; they are copied, never re-combined.
    """
    rank, W = group.rank, group.size
    right, left = (rank + 1) % W, (rank - 1) % W
    for step in range(W - 1):
        send_i, recv_i = (rank - step) % W, (rank - step - 1) % W
        group.sendrecv(chunks[send_i], dst=right, src=left, out=chunks[recv_i])


def all_reduce(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return x_0 (op) x_1 (op) ... (op) x_{W-1} over the ranks of `group`, on every rank.

    Algorithm (this rank's view): ring reduce-scatter leaves this rank with the
    finished chunk `rank` of np.array_split(x.ravel(), W); the op's last step
    (avg: divide by W) is applied to it; a ring all-gather then brings every
    other finished chunk round the circle.

    Shapes: x any shape, identical on every rank; returns a new array, same shape.
        Notation: x[N] {U_group} -> [N].
    Cost: 2(W-1) messages; 2(W-1)/W * N numbers sent per rank:
        2(W-1) alpha + 2(W-1)/W * n beta + (W-1)/W * n gamma for n bytes.
        Bandwidth-optimal, latency linear in W.
    Numerics: chunk c is combined along the ring starting at rank c+1:
        ((x_{c+1} + x_{c+2}) + ...) + x_c, so the rounding differs per chunk and
        from the rank-order oracle in the last bits; ranks end bitwise identical
        because finished chunks are copied, not re-added.
    Reference: Patarasuk & Yuan 2009, JPDC 69(2).
    """
    W = group.size
    flat = x.reshape(-1).copy()
    chunks = np.array_split(flat, W)           # views into flat, sizes differ by <= 1
    reduce_scatter_steps(chunks, group, op)
    mine = chunks[group.rank]
    mine[...] = finish(op, mine, W)
    all_gather_steps(chunks, group)
    return flat.reshape(x.shape)


def reduce_scatter(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return chunk `rank` of np.array_split((x_0 (op) ... (op) x_{W-1}).ravel(), W).

    Algorithm (this rank's view): W-1 ring steps; each passes a partial sum to
    the right and adds the one arriving from the left into this rank's copy of
    that chunk (see reduce_scatter_steps for the invariant).

    Shapes: x any shape with N elements, identical on every rank; returns a new
        1-D array of N // W or N // W + 1 elements. Notation: [N] {U} -> [N_group].
    Cost: (W-1) alpha + (W-1)/W * n (beta + gamma) for n = x.nbytes.
    Numerics: as all_reduce; the result matches all_reduce's chunk bitwise.
    Reference: Patarasuk & Yuan 2009, JPDC 69(2) (its first phase).
    """
    W = group.size
    chunks = np.array_split(x.reshape(-1).copy(), W)
    reduce_scatter_steps(chunks, group, op)
    return finish(op, chunks[group.rank], W).copy()


def all_gather(x: np.ndarray, group) -> np.ndarray:
    """Return np.stack([x_0, ..., x_{W-1}]) on every rank: shape (W, *x.shape).

    Algorithm (this rank's view): put x in row `rank`; W-1 times pass the most
    recently received row to the right and receive the next from the left.

    Shapes: x any shape, identical on every rank. Notation: [N] -> [W, N].
    Cost: (W-1) alpha + (W-1) * m beta for m = x.nbytes (Thakur et al. write
        (p-1)/p * n beta with n = W * m the gathered size).
    Numerics: pure copies; bitwise identical on every rank.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (ring allgather).
    """
    W = group.size
    out = np.empty((W, *x.shape), x.dtype)
    rows = list(out.reshape(W, x.size))        # W contiguous row views
    rows[group.rank][...] = x.reshape(-1)
    all_gather_steps(rows, group)
    return out


def broadcast(x: np.ndarray, group, root: int = 0) -> np.ndarray:
    """Return a copy of the root's x on every rank, sent down a pipelined chain.

    Algorithm (this rank's view, position p = (rank - root) % W on the chain
    root -> root+1 -> ... -> root-1): cut x into k pieces; for each piece in
    order, receive it from the left (unless p = 0) and pass it right (unless
    p = W-1). Piece i reaches position p at step i + p, so the chain is full
    after W-1 steps and then moves one piece per step.

    Shapes: x identical shape and dtype on every rank (only the root's values
        are read). Returns a new array.
    Cost: (W-2+k) (alpha + n/k beta) for k = segments(n, N) segments:
        about n beta for large n, independent of W; (W-1) alpha when k = 1.
    Numerics: copies only; bitwise the root's array everywhere.
    Reference: Sanders, Speck & Traeff 2009, Parallel Computing 35(12).
    """
    rank, W = group.rank, group.size
    pos = (rank - root) % W
    out = x.reshape(-1).copy()
    for piece in np.array_split(out, segments(x.nbytes, x.size)):
        if pos > 0:
            group.recv((rank - 1) % W, out=piece)
        if pos < W - 1:
            group.send(piece, (rank + 1) % W)
    return out.reshape(x.shape)


def reduce(x: np.ndarray, group, root: int = 0, op: str = "sum") -> np.ndarray | None:
    """Return x_0 (op) ... (op) x_{W-1} on the root and None elsewhere, along a chain.

    Algorithm (this rank's view, position p = (rank - root - 1) % W on the
    chain root+1 -> root+2 -> ... -> root): for each segment, receive
    the partial result of positions 0..p-1 from the left (unless p = 0), combine
    this rank's piece into it and pass it right (unless this rank is the root).

    Shapes: x identical on every rank; the root gets a new array of x's shape.
    Cost: (W-2+k) (alpha + n/k (beta + gamma)) for k = segments(n, N):
        the last piece leaves position 0 at step k-1 and needs W-1 more hops.
    Numerics: ((x_{root+1} (op) x_{root+2}) (op) ...) (op) x_root: rank order
        rotated to start after the root, identical for every element.
    Reference: Sanders, Speck & Traeff 2009, Parallel Computing 35(12).
    """
    rank, W = group.rank, group.size
    pos = (rank - root - 1) % W
    acc = x.reshape(-1).copy()
    scratch = np.empty_like(acc)
    k = segments(x.nbytes, x.size)
    for piece, buf in zip(np.array_split(acc, k), np.array_split(scratch, k)):
        if pos > 0:
            combine(op, group.recv((rank - 1) % W, out=buf), piece, out=piece)
        if pos < W - 1:
            group.send(piece, (rank + 1) % W)
    if rank != root:
        return None
    return finish(op, acc, W).reshape(x.shape)
