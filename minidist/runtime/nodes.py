"""Nodes on one machine: ranks grouped into nodes, and a slower link between nodes, emulated.

A cluster has two tiers of links: inside a node every GPU reaches every other over NVLink
(~450 GB/s each way on an H100), across nodes each GPU has one network port (~50 GB/s),
about ten times slower, with a longer latency. On one machine every rank reaches every
other through the same shared memory, so the problem that shapes large runs (which bytes
cross the slow tier) cannot be seen. `Nodes` brings it back:

    node(r)          = r // ranks_per_node       (ranks numbered node by node, as
                                                  launchers number them, so the fastest
                                                  mesh axis, tp, stays inside a node)
    a message of n bytes from a rank to a rank on another node takes at least
        alpha + n beta                           (the inter-node tier's latency and
                                                  seconds per byte)
The shared-memory transport (runtime/p2p.py) emulates that tier: the sender holds the
message's last chunk until alpha + n beta after the send began, so the receiver cannot
finish before then (the chunks before it may arrive early; a store-and-forward link
would hold them all, which gives the same time for the whole message). Messages inside a
node run at the machine's own speed, the intra-node tier. Nothing is emulated for the
data itself: every byte still arrives, bit for bit.

What else changes, so that a run behaves as it would on real nodes:
    shared memory    a group whose ranks span two or more nodes offers no `shared` region
                     (`supports_shared` False, as runtime/mpi.py's groups): nodes share no
                     memory, so its collectives take ring, tree, halving or the two-level
                     algorithms (collectives/hierarchical.py), never the zero-copy ones;
    counters         each group's stats count the bytes and messages sent to another node
                     (`bytes_sent_inter`, `messages_sent_inter`) beside the totals;
    algorithm choice "auto" on a group that spans nodes prices each algorithm on the two
                     tiers (collectives/api.py with collectives/tiers.py: the intra tier is
                     this machine's calibrated link, the inter tier alpha and beta here) and
                     takes the cheapest.

Off by default. Turned on for a job by spawn(..., nodes=Nodes(4)) or by the environment
the ranks inherit: MINIDIST_RANKS_PER_NODE=N, and optionally MINIDIST_INTER_LATENCY_US and
MINIDIST_INTER_GBS (the inter tier; default 100 us and 0.25 GB/s: ten times the default
link of collectives/cost.py, 10 us and 2.5 GB/s, which this machine's shared memory
beats). `python -m minidist train --ranks-per-node N` sets them.
Reference: NVIDIA DGX H100 user guide (NVLink inside a node, one 400 Gb/s InfiniBand port
    per GPU across nodes).
Read next: runtime/p2p.py (the emulated send), collectives/hierarchical.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

INTER_ALPHA = 100e-6             # s per message across nodes (default)
INTER_BETA = 4e-9                # s per byte across nodes: 0.25 GB/s (default)


@dataclass(frozen=True)
class Nodes:
    """Ranks in nodes of `ranks_per_node`; the inter-node tier's alpha (s per message) and
    beta (s per byte)."""

    ranks_per_node: int
    alpha: float = INTER_ALPHA
    beta: float = INTER_BETA

    def __post_init__(self) -> None:
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) \
                or self.ranks_per_node < 1:
            raise ValueError(f"Nodes: ranks_per_node={self.ranks_per_node!r} must be an int "
                             ">= 1.")
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"Nodes: {name}={value!r} must be >= 0 (seconds"
                                 f"{' per byte' if name == 'beta' else ''}).")

    @classmethod
    def from_env(cls) -> "Nodes | None":
        """The nodes the environment asks for (module docstring), or None."""
        per = os.environ.get("MINIDIST_RANKS_PER_NODE")
        if not per:
            return None
        lat, gbs = (os.environ.get(k) for k in ("MINIDIST_INTER_LATENCY_US", "MINIDIST_INTER_GBS"))
        try:
            return cls(int(per), INTER_ALPHA if lat is None else float(lat) * 1e-6,
                       INTER_BETA if gbs is None else 1.0 / (float(gbs) * 1e9))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"MINIDIST_RANKS_PER_NODE={per!r}, MINIDIST_INTER_LATENCY_US="
                             f"{lat!r}, MINIDIST_INTER_GBS={gbs!r}: need an int >= 1, a "
                             "latency >= 0 and a bandwidth > 0.") from None

    def env(self) -> dict[str, str]:
        """The variables that make ranks started with them see these nodes."""
        return {"MINIDIST_RANKS_PER_NODE": str(self.ranks_per_node),
                "MINIDIST_INTER_LATENCY_US": repr(self.alpha * 1e6),
                "MINIDIST_INTER_GBS": repr(1.0 / self.beta / 1e9 if self.beta else 1e18)}

    def check(self, world_size: int) -> None:
        """ValueError unless the nodes tile the world evenly."""
        if world_size % self.ranks_per_node:
            raise ValueError(f"{world_size} ranks do not fill nodes of {self.ranks_per_node}: "
                             "ranks per node must divide the world size.")

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def count(self, ranks: Sequence[int]) -> int:
        """How many nodes the global ranks touch."""
        return len({self.node(r) for r in ranks})

    def delay(self, nbytes: int) -> float:
        """Seconds a message of nbytes takes across nodes: alpha + n beta."""
        return self.alpha + nbytes * self.beta
