"""All-to-all: every rank sends a different piece of its array to every rank.

Rank s cuts its x along axis 0 into W pieces, piece r going to rank r, with
sizes of its own choosing (split_sizes): a mixture-of-experts layer sends each
token to the rank that holds its expert, and how many tokens go where changes
from batch to batch. Rank r receives one piece from every rank and stacks them
in source-rank order. It is a transpose of the (source, destination) matrix of
pieces, so it cannot be built from reductions; every byte travels exactly once.

Pairwise exchange schedule: in step s = 1..W-1 rank r sends its piece for
rank r+s and receives its piece from rank r-s (mod W). Every rank sends and
receives exactly one message per step, so no rank is flooded while others
idle, and sendrecv makes each step deadlock-free. Step 0 is the local copy.

Uneven sizes: the receiver allocates its output before the data arrives, so it
must know how many rows each source sends. When the caller does not know
(recv_sizes=None) the counts are exchanged first with the same schedule, one
int64 per message. The returned counts are themselves an all_to_all of the
split sizes: recv_sizes == all_to_all(np.array(split_sizes)) -- the way to get
them for the return trip of an MoE layer.

One rank's view (rank r of W):
    1. if recv_sizes is unknown: exchange split sizes pairwise (step s: tell
       rank r+s how many rows it will get, learn from rank r-s).
    2. copy my own piece into my output slot for source r.
    3. for s = 1..W-1: send my piece for r+s, receive the piece of r-s into its slot.

Shapes: x (N_r, *rest) with N_r = sum(split_sizes) on rank r (N_r may differ
per rank; rest and dtype must agree); returns (sum(recv_sizes), *rest).
Reference: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
    communication operations in MPICH", IJHPCA 19(1), 49-66 (pairwise exchange
    all-to-all for long messages).
Read next: cost.py.
"""

from __future__ import annotations

import numpy as np


def exchange_sizes(split_sizes: list[int], group) -> list[int]:
    """Return recv_sizes: recv_sizes[s] = split_sizes[rank] as passed on rank s.

    Pairwise schedule, one int64 per message: (W-1) alpha.
    """
    rank, W = group.rank, group.size
    counts = np.empty(W, np.int64)
    counts[rank] = split_sizes[rank]
    for step in range(1, W):
        dst, src = (rank + step) % W, (rank - step) % W
        group.sendrecv(np.array([split_sizes[dst]], np.int64), dst=dst, src=src,
                       out=counts[src:src + 1])
    return [int(c) for c in counts]


def all_to_all(x: np.ndarray, group, split_sizes: list[int] | None = None,
               recv_sizes: list[int] | None = None) -> np.ndarray:
    """Return concat_s(piece_r of x_s): the rows every rank s addressed to this rank r.

    Algorithm: steps 1-3 of the module docstring. split_sizes=None means an
    even split, x.shape[0] // W rows to each rank (x.shape[0] must divide by W
    and be the same on every rank); recv_sizes is then known without asking.
    Invariant: after step s, output slots r, r-1, ..., r-s are filled.

    Shapes: x (N_r, *rest); returns a new (sum(recv_sizes), *rest) array.
    Cost (n = x.nbytes, evenly split): (W-1) alpha + (W-1)/W n beta, plus
        (W-1) alpha for the size exchange when recv_sizes is not given.
    Numerics: copies only.
    Reference: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (pairwise exchange).
    """
    rank, W = group.rank, group.size
    if split_sizes is None:
        split_sizes = [x.shape[0] // W] * W
        recv_sizes = list(split_sizes) if recv_sizes is None else recv_sizes
    if recv_sizes is None:
        recv_sizes = exchange_sizes(split_sizes, group)
    send_at = np.concatenate([[0], np.cumsum(split_sizes)])
    recv_at = np.concatenate([[0], np.cumsum(recv_sizes)])
    out = np.empty((int(recv_at[-1]), *x.shape[1:]), x.dtype)
    out[recv_at[rank]:recv_at[rank + 1]] = x[send_at[rank]:send_at[rank + 1]]
    for step in range(1, W):
        dst, src = (rank + step) % W, (rank - step) % W
        group.sendrecv(x[send_at[dst]:send_at[dst + 1]], dst=dst, src=src,
                       out=out[recv_at[src]:recv_at[src + 1]])
    return out
