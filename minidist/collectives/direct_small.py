"""Small messages in canonical order: one flag per rank, two buffers, one wait.

direct.py's all_reduce costs two barriers per call. For a few bytes (a loss, a
gradient norm, a token count) the time is all synchronisation, so this variant
needs only one wait. Every rank owns, in a group.shared() region, a flag and
two small buffers (double buffering). Call k uses buffer k % 2:

One rank's view (rank r of W, call k of this path on this group):
    1. (nothing to wait for) buffer k % 2 was last read by the peers in call
       k-2; a peer that published flag k-1 had returned from call k-2, and
       step 3 of my call k-1 saw every flag >= k-1. So the buffer is free.
    2. write my call header and my x into my buffer k % 2; flag[r] = k.
    3. wait until every flag >= k: every input of call k is in place.
    4. check every peer's header against mine (a different call is a
       CollectiveMismatch, as with messages), then fold the W inputs in rank
       order: ((x_0 (op) x_1) (op) x_2) ... -- the same bits as direct.all_reduce.
So a call is one store and one wait.

Shapes: x any shape with at most SMALL_BYTES bytes, identical on every rank.
Bytes (group.stats, the rule of direct.py): every peer reads all of my x, so
    (W-1) n sent and received per rank; no reduce-scatter split at this size.
Cost: alpha (one flag round) + (W-1) n beta + (W-1) n gamma, every rank folding
    all W inputs itself (cheaper than splitting the work for a few bytes).
Read next: all_to_all.py.
"""

from __future__ import annotations

import numpy as np

from minidist.collectives.reduce_ops import combine, finish
from minidist.runtime import call
from minidist.runtime.errors import CollectiveMismatch
from minidist.runtime.wait import wait_until

SMALL_BYTES = 4096                  # inputs up to this size take this path
_FLAG, _HDR, _NID = 64, 128, 12     # bytes for the flag, bytes per header, ints of identity


class _Flags:
    """This group's small-message state: views of every rank's flag, headers and buffers."""

    def __init__(self, group):
        W = group.size
        region = group.shared("direct/small", _FLAG + 2 * _HDR + 2 * SMALL_BYTES)
        self.flags = [region.peer(p, np.int64, 1) for p in range(W)]
        self.hdrs = [[region.peer(p, np.int64, _NID, _FLAG + s * _HDR) for s in (0, 1)]
                     for p in range(W)]
        self.data = [[region.peer(p, np.uint8, SMALL_BYTES, _FLAG + 2 * _HDR + s * SMALL_BYTES)
                      for s in (0, 1)] for p in range(W)]
        self.calls = 0
        self.views: dict[tuple, list[np.ndarray]] = {}   # (dtype, nbytes, slot) -> peers' x

    def peer_inputs(self, dtype: np.dtype, nbytes: int, slot: int) -> list[np.ndarray]:
        """Typed views of every rank's buffer `slot` (made once per dtype and size)."""
        key = (dtype, nbytes, slot)
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = [d[slot][:nbytes].view(dtype) for d in self.data]
        return views


def _wait_all(group, flags: list[np.ndarray], k: int, what: str) -> None:
    load = group.ordering.load
    for p, flag in enumerate(flags):
        if load(flag, 0) < k:
            ready = lambda flag=flag: load(flag, 0) >= k                    # noqa: E731
            wait_until(ready, group.watch(p, ready, what), group.timeout, group.spin)


def all_reduce(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Return x_0 (op) ... (op) x_{W-1}, folded in rank order, on every rank (small x).

    Algorithm: steps 1-4 of the module docstring. Bitwise equal to direct.all_reduce.
    """
    rank, W, n = group.rank, group.size, x.nbytes
    st = group.algo_state.get("direct_small")
    if st is None:
        st = group.algo_state["direct_small"] = _Flags(group)
    st.calls += 1
    k, slot = st.calls, st.calls % 2                                              # step 1
    st.hdrs[rank][slot][:] = group.record[call.IDENTITY]                          # step 2
    st.data[rank][slot][:n] = x.reshape(-1).view(np.uint8)
    group.ordering.store(st.flags[rank], 0, k)
    _wait_all(group, st.flags, k, "exchange small inputs with")                   # step 3
    for p in range(W):                                                            # step 4
        if st.hdrs[p][slot].tobytes() != group.ident:
            names = group.group_names
            theirs = group.record.copy()
            theirs[call.IDENTITY] = st.hdrs[p][slot]
            raise CollectiveMismatch(
                f"{group.prefix} this rank is in [{call.describe(group.record, names)}] but "
                f"rank {group.ranks[p]} is in [{call.describe(theirs, names)}].")
    peers = st.peer_inputs(x.dtype, n, slot)
    out = np.empty(x.size, x.dtype)
    if W == 1:
        out[...] = peers[0]
    else:
        combine(op, peers[0], peers[1], out=out)
        for p in range(2, W):
            combine(op, out, peers[p], out=out)
    group.stats["bytes_sent"] += (W - 1) * n
    group.stats["bytes_recv"] += (W - 1) * n
    return finish(op, out, W).reshape(x.shape)
