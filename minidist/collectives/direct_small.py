"""Small messages in canonical order: two buffers per rank, one barrier per call.

direct.py's all_reduce costs two barriers per call. For a few bytes (a loss, a
gradient norm, a token count) the time is all synchronisation, so this variant
needs only one. Every rank owns, in a group.shared() region, two small buffers
(double buffering). Call k of this path on a group uses buffer k % 2:

One rank's view (rank r of W, call k):
    1. (nothing to wait for) buffer k % 2 was last read by the peers in call
       k-2, before they arrived at the barrier of call k-1; I left that
       barrier, so they all had. The buffer is free.
    2. write my x into my buffer k % 2;
    3. barrier: every input of call k is in place, and every rank arrived
       from this same call (the barrier compares the ranks' calls: a
       different collective, dtype, shape or op is a CollectiveMismatch);
    4. fold the W inputs in rank order: ((x_0 (op) x_1) (op) x_2) ... -- the
       same bits as direct.all_reduce, straight out of the peers' buffers.
So a call is one copy in, one barrier and W - 1 ufunc calls; it uses only the
group's narrow interface (shared regions and the barrier, runtime/group.py).

Shapes: x any shape with at most SMALL_BYTES bytes, identical on every rank.
Bytes (group.stats, the rule of direct.py): every peer reads all of my x, so
    (W-1) n sent and received per rank; no reduce-scatter split at this size.
Cost: alpha (one barrier) + (W-1) n beta + (W-1) n gamma, every rank folding
    all W inputs itself (cheaper than splitting the work for a few bytes).
Fast path details: the typed views of the W buffers, shaped like x, are made
    once per (dtype, shape) and kept in the region's `state`, so a repeated
    call allocates nothing but its result.
Read next: all_to_all.py.
"""

from __future__ import annotations

import numpy as np

from minidist.collectives.reduce_ops import finish, ufunc

SMALL_BYTES = 4096                  # inputs up to this size take this path
TAG = "direct/small"


class _Buffers:
    """The region's two buffers per rank, and typed views of them made once."""

    def __init__(self, region, W: int):
        self.region, self.W, self.calls = region, W, 0
        self.views: dict[tuple, list[list[np.ndarray]]] = {}   # (dtype, shape) -> [slot][rank]

    def inputs(self, dtype: np.dtype, shape: tuple) -> list[list[np.ndarray]]:
        """views[slot][p]: rank p's buffer `slot` as an array of `dtype` and `shape`."""
        key = (dtype, shape)
        views = self.views.get(key)
        if views is None:
            count = int(np.prod(shape, dtype=np.int64))
            views = self.views[key] = [
                [self.region.peer(p, dtype, count, s * SMALL_BYTES).reshape(shape)
                 for p in range(self.W)] for s in (0, 1)]
        return views


def all_reduce(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return x_0 (op) ... (op) x_{W-1}, folded in rank order, on every rank (small x).

    Algorithm: steps 1-4 of the module docstring. Bitwise equal to direct.all_reduce.
    """
    W, n = group.size, x.nbytes
    region = group.shared(TAG, 2 * SMALL_BYTES)
    bufs = region.state.get("small")
    if bufs is None:
        bufs = region.state["small"] = _Buffers(region, W)
    bufs.calls += 1                                                            # step 1
    peers = bufs.inputs(x.dtype, x.shape)[bufs.calls & 1]
    peers[group.rank][...] = x                                                 # step 2
    group.barrier()                                                            # step 3
    f = ufunc(op)                                                              # step 4
    if W == 1 or x.ndim == 0:                    # (a ufunc would make a 0-d result a scalar)
        out = peers[0].copy()
        for p in range(1, W):
            f(out, peers[p], out=out)
    else:
        out = f(peers[0], peers[1])
        for p in range(2, W):
            f(out, peers[p], out=out)
    stats = group.stats
    stats["bytes_sent"] += (W - 1) * n
    stats["bytes_recv"] += (W - 1) * n
    return finish(op, out, W)
