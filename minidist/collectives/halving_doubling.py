"""Recursive halving and doubling: log2 W rounds of pairwise exchange, for small messages.

With W a power of two, pair every rank with the rank whose index differs in
one bit, a different bit each round. After log2 W rounds every rank has heard
from every other rank, indirectly, in the fewest possible rounds:

    recursive doubling (all_reduce)   exchange the whole vector with the partner
                                      and combine; log2 W rounds, n bytes each.
    recursive halving (reduce_scatter) exchange half of what is left: keep your
                                      half, send the partner's half, combine;
                                      the piece shrinks n/2, n/4, ... to n/W.
    recursive doubling (all_gather)   exchange everything gathered so far; the
                                      gathered block grows 1, 2, 4, ... rows.

Any W: let W' be the largest power of two <= W and rem = W - W'. Before the
rounds, each even rank r < 2 rem folds its vector into its odd neighbour r+1
and sits out; afterwards the odd neighbour hands it the result. Participant i
("new rank") is old rank 2i+1 for i < rem and old rank i + rem otherwise, and
it stands for the contiguous old ranks [first(i), first(i+1)) with
first(i) = 2i for i < rem, i + rem otherwise. This costs two extra messages.

One rank's view (all_reduce, participant i of W'):
    1. fold:     if I am an even rank < 2 rem: send x to rank+1, skip to 4.
                 if I am an odd rank < 2 rem: receive and combine (lower rank first).
    2. for mask = 1, 2, 4, ... < W': exchange my vector with participant i ^ mask and
       combine, the lower participant's operand first (so both compute the same bits).
    3. apply the op's last step (avg: divide by W).
    4. unfold:   odd ranks < 2 rem send the result to rank-1, which receives it.

Shapes: x identical shape and dtype on every rank. reduce_scatter returns
chunk `rank` of np.array_split(result.ravel(), W), as ring.reduce_scatter does.
Communication: sendrecv with one partner per round (send/recv for fold/unfold).

Reference: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
    communication operations in MPICH", IJHPCA 19(1), 49-66: recursive
    doubling allgather and allreduce, recursive halving reduce-scatter, and the
    folding of the extra ranks when W is not a power of two.
Read next: direct.py (one order for every element: bitwise reproducible).
"""

from __future__ import annotations

import numpy as np

from minidist.collectives.reduce_ops import combine, finish


def _layout(rank: int, W: int) -> tuple[int, int, int]:
    """Return (W', rem, new rank of `rank`, or -1 when it sits out the rounds)."""
    Wp = 1 << (W.bit_length() - 1)
    rem = W - Wp
    if rank < 2 * rem:
        return Wp, rem, rank // 2 if rank % 2 else -1
    return Wp, rem, rank - rem


def _first(i: int, rem: int) -> int:
    """First old rank that participant i stands for (first(W') = W)."""
    return 2 * i if i < rem else i + rem


def _old(i: int, rem: int) -> int:
    """The old rank that plays participant i."""
    return 2 * i + 1 if i < rem else i + rem


def _ordered_combine(op: str, mine: np.ndarray, theirs: np.ndarray, i_am_lower: bool) -> None:
    """mine <- lower (op) higher, in place: both partners compute the same bits."""
    if i_am_lower:
        combine(op, mine, theirs, out=mine)
    else:
        combine(op, theirs, mine, out=mine)


def all_reduce(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return x_0 (op) ... (op) x_{W-1} on every rank, by recursive doubling.

    Algorithm: see the module docstring, steps 1-4.
    Invariant: after the round with mask m, participant i holds the combination
        of the old ranks of participants [i & ~(2m-1), (i & ~(2m-1)) + 2m).

    Shapes: x any shape, identical on every rank; returns a new array, same shape.
    Cost (n = x.nbytes, W' = 2^floor(log2 W)): log2 W' (alpha + n beta + n gamma),
        plus 2 alpha + 2 n beta + n gamma when W is not a power of two.
        Fewest rounds, but n bytes per round: for small n only.
    Numerics: contiguous rank blocks combined lower block first, e.g. W = 4:
        (x0 + x1) + (x2 + x3); bitwise identical on every rank.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (recursive doubling allreduce).
    """
    rank, W = group.rank, group.size
    Wp, rem, new = _layout(rank, W)
    acc = x.reshape(-1).copy()
    scratch = np.empty_like(acc)
    if new < 0:                                      # even rank < 2 rem: fold, wait
        group.send(acc, rank + 1)
        return group.recv(rank + 1, out=acc).reshape(x.shape)
    if rank < 2 * rem:                               # odd rank < 2 rem: absorb rank-1
        combine(op, group.recv(rank - 1, out=scratch), acc, out=acc)
    mask = 1
    while mask < Wp:
        partner = _old(new ^ mask, rem)
        group.sendrecv(acc, dst=partner, src=partner, out=scratch)
        _ordered_combine(op, acc, scratch, i_am_lower=not new & mask)
        mask <<= 1
    acc[...] = finish(op, acc, W)
    if rank < 2 * rem:
        group.send(acc, rank - 1)
    return acc.reshape(x.shape)


def reduce_scatter(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return chunk `rank` of np.array_split((x_0 (op) ... (op) x_{W-1}).ravel(), W).

    Algorithm (participant i of W'): the element range of participants [a, b)
    is the chunks of old ranks [first(a), first(b)). Start with the window of
    all W' participants. For mask = W'/2, ..., 1: split the window in halves,
    send the half that partner i ^ mask will own, receive my half from it and
    combine; the window halves. The window ends as [i, i+1): my chunks. Around
    this, fold/unfold as in the module docstring; on unfold the odd rank sends
    its even neighbour the neighbour's chunk.
    Invariant: after the round with mask m, participant i holds the elements of
        the window of participants [i - i % m, i - i % m + m), combined over the
        participants j with j % m == i % m; at m = 1 that is all of them.

    Shapes: x any shape with N elements; returns a new 1-D array of N//W or
        N//W + 1 elements.
    Cost (n = x.nbytes): log2 W' alpha + (W'-1)/W' n (beta + gamma), plus
        alpha + n (beta + gamma) for the fold and alpha + n/W beta for the
        unfold when W is not a power of two.
    Numerics: chunk c combines participants in butterfly order, e.g. W = 4:
        (x0 + x2) + (x1 + x3); ties are broken lower participant first.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (recursive halving reduce-scatter).
    """
    rank, W = group.rank, group.size
    Wp, rem, new = _layout(rank, W)
    acc = x.reshape(-1).copy()
    bounds = [len(c) for c in np.array_split(np.empty(acc.size, np.int8), W)]
    start = np.concatenate([[0], np.cumsum(bounds)])       # start[k]: first element of chunk k
    if new < 0:                                            # fold into rank+1, get chunk back
        group.send(acc, rank + 1)
        return group.recv(rank + 1, out=np.empty(bounds[rank], acc.dtype))
    scratch = np.empty_like(acc)
    if rank < 2 * rem:
        combine(op, group.recv(rank - 1, out=scratch), acc, out=acc)
    lo, hi, mask = 0, Wp, Wp // 2
    while mask:
        mid = lo + mask
        keep, give = ((lo, mid), (mid, hi)) if new < mid else ((mid, hi), (lo, mid))
        k0, k1 = start[_first(keep[0], rem)], start[_first(keep[1], rem)]
        g0, g1 = start[_first(give[0], rem)], start[_first(give[1], rem)]
        partner = _old(new ^ mask, rem)
        got = group.sendrecv(acc[g0:g1], dst=partner, src=partner, out=scratch[:k1 - k0])
        _ordered_combine(op, acc[k0:k1], got, i_am_lower=new < mid)
        lo, hi, mask = keep[0], keep[1], mask // 2
    if rank < 2 * rem:                                     # hand rank-1 its chunk
        group.send(finish(op, acc[start[rank - 1]:start[rank]], W), rank - 1)
    return np.array(finish(op, acc[start[rank]:start[rank + 1]], W), copy=True)


def all_gather(x: np.ndarray, group) -> np.ndarray:
    """Return np.stack([x_0, ..., x_{W-1}]) on every rank: shape (W, *x.shape).

    Algorithm (participant i of W'): hold the rows of old ranks
    [first(lo), first(hi)) for my participant window [lo, hi) = [i, i+1)
    (after the fold, an odd rank < 2 rem also holds its even neighbour's row).
    For mask = 1, 2, ... < W': exchange all held rows with participant i ^ mask,
    whose window is the adjacent block of the same size; the window doubles.
    Unfold: odd ranks < 2 rem send all W rows to rank-1.

    Shapes: x any shape, identical on every rank; returns (W, *x.shape).
    Cost (m = x.nbytes): log2 W' alpha + about (W-1) m beta, plus alpha + m beta
        (fold) and alpha + W m beta (unfold) if W is not a power of two.
    Numerics: copies only; bitwise identical on every rank.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (recursive doubling allgather).
    """
    rank, W = group.rank, group.size
    Wp, rem, new = _layout(rank, W)
    out = np.empty((W, x.size), x.dtype)
    out[rank] = x.reshape(-1)
    if new < 0:
        group.send(out[rank], rank + 1)
        return group.recv(rank + 1, out=out).reshape(W, *x.shape)
    if rank < 2 * rem:
        group.recv(rank - 1, out=out[rank - 1])
    lo, mask = new, 1
    while mask < Wp:
        p_lo = lo ^ mask                                  # partner's window, same size
        mine = out[_first(lo, rem):_first(lo + mask, rem)]
        theirs = out[_first(p_lo, rem):_first(p_lo + mask, rem)]
        partner = _old(new ^ mask, rem)
        group.sendrecv(mine, dst=partner, src=partner, out=theirs)
        lo, mask = min(lo, p_lo), mask * 2
    if rank < 2 * rem:
        group.send(out, rank - 1)
    return out.reshape(W, *x.shape)
