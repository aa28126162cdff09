"""Collective communication, hand-written over the runtime's send/recv and shared memory.

Reading order:
    simulated.py         the oracle: what every collective must return, in one process
    reduce_ops.py        sum, avg, max, min, prod, combined in a fixed operand order
    ring.py              bandwidth-optimal: reduce-scatter + all-gather around a ring
    tree.py              binomial trees: log W rounds, for small messages and rooted calls
    halving_doubling.py  recursive halving/doubling, any W (folding the extra ranks)
    direct.py            canonical rank order over shared memory: bitwise reproducible
    all_to_all.py        pairwise exchange with uneven split sizes (mixture of experts)
    cost.py              the alpha-beta model and algo="auto"
    tiers.py             the same formulas on a two-level topology (nodes of fast links,
                         a slower network across): flat and hierarchical, a chooser
    hierarchical.py      the two-level all-reduce, reduce-scatter and all-gather (inside a
                         node, across it on a share, inside again), for emulated nodes
    api.py               the public, torch.distributed-shaped calls re-exported here
    prepared.py          their lean path: calls whose signature was validated before
"""

from minidist.collectives.api import (all_gather, all_reduce, all_to_all, barrier, broadcast,
                                      gather, irecv, isend, recv, reduce, reduce_scatter,
                                      scatter, send, sendrecv)

__all__ = ["all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "gather", "irecv",
           "isend", "recv", "reduce", "reduce_scatter", "scatter", "send", "sendrecv"]
