"""Collective costs on a two-level topology: fast links inside a node, a slower network across.

A cluster is nodes of G GPUs each: inside a node every GPU reaches every other over NVLink
(NVSwitch), across nodes each GPU has its own network port (a "rail"). A link is three
numbers (`Link`): alpha, the latency of one message (s); beta, the seconds per byte
through ONE GPU's port in one direction; gamma, the seconds per byte of a reduction.
An algorithm's time on a link is collectives/cost.py's formula for it (`cost.terms`: the
messages m, bytes sent s and bytes reduced r on its critical path):

    t(op, algo, p, n, link) = m alpha + s beta + r gamma

Where a group lies decides which links it uses (`Topology.span`): ranks are numbered node
by node (rank r on node r // G), so a group of ranks g apart with g < G shares nodes (the
tensor-parallel groups, the fastest mesh axis) and a group of ranks G or more apart crosses
them (data and pipeline parallelism, the slowest). A group on one node runs on the intra
link. A group over N nodes, L ranks on each (p = N L):
    flat            the algorithm over all p ranks; its critical path crosses the network,
                    so every message and byte costs the inter link's alpha and beta
    hierarchical    (Thakur et al.'s, NCCL's two-level rings) all_reduce: reduce_scatter
                    inside each node (L ranks, n bytes), all_reduce across nodes on each
                    rank's 1/L share (N ranks, n / L bytes: the L rails work in parallel),
                    all_gather inside the node (L ranks, pieces of n / L);
                    reduce_scatter: inside (n), then across (n / L);
                    all_gather: across (pieces of n), then inside (pieces of N n)
    all_to_all      pairwise: each rank sends n / p bytes to each peer, L - 1 of them on its
                    node and p - L across; the two kinds of link work at once, so the time
                    is the slower part: max((L-1) (alpha_i + n/p beta_i), (p-L) (alpha_e +
                    n/p beta_e))
`choose` takes the cheapest algorithm for the op, the bytes and where the group lies: for
large messages across nodes the hierarchical form wins (it sends only n / L over the slow
link), for small ones the log-depth tree's few messages do.

Conventions as cost.py's: n is the bytes ONE rank passes in (all_gather: its piece;
all_to_all: all it sends). Hardware profiles (hardware/profiles.py) give the links of real
clusters; a group of ranks on this machine is one node.
References: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (the per-algorithm formulas);
    Sanders, Speck & Traff 2009, "Two-tree algorithms for full bandwidth broadcast,
    reduction and scan" (pipelined trees); NVIDIA NCCL documentation, "NCCL_ALGO" (rings
    and trees inside and across nodes).
Read next: collectives/cost.py (the formulas and the constants of this machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from minidist.collectives.cost import terms

# the algorithms each op may take on a topology (hierarchical: across nodes only)
ALGOS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "halving", "hierarchical"),
    "reduce_scatter": ("ring", "halving", "hierarchical"),
    "all_gather": ("ring", "halving", "hierarchical"),
    "all_to_all": ("pairwise",),
    "broadcast": ("tree", "ring"),
}


@dataclass(frozen=True)
class Link:
    """alpha: seconds per message; beta: seconds per byte through one GPU's port, one
    direction; gamma: seconds per byte reduced (0: free next to the link)."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta > 0 and self.gamma >= 0):
            raise ValueError(f"Link: alpha={self.alpha} and gamma={self.gamma} must be >= 0 "
                             f"and beta={self.beta} > 0 (seconds per byte).")


@dataclass(frozen=True)
class Topology:
    """Nodes of `per_node` ranks; `intra` links inside a node, `inter` across nodes."""

    per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.per_node < 1:
            raise ValueError(f"Topology: per_node={self.per_node} must be >= 1.")

    def span(self, ranks: Sequence[int]) -> tuple[int, int]:
        """(nodes the group touches, the most of its ranks on one node)."""
        if not ranks:
            raise ValueError("Topology.span: a group has at least one rank.")
        count: dict[int, int] = {}
        for r in ranks:
            count[r // self.per_node] = count.get(r // self.per_node, 0) + 1
        return len(count), max(count.values())


def on_link(op: str, algo: str, p: int, n: float, link: Link) -> float:
    """Seconds of one call on p ranks, all on `link`: m alpha + s beta + r gamma."""
    if p == 1:
        return 0.0
    m, _, s, r, _, _ = terms(op, algo, int(p), float(n))
    return m * link.alpha + s * link.beta + r * link.gamma


def seconds(op: str, algo: str, ranks: Sequence[int], n: float, topo: Topology) -> float:
    """Seconds of one call of `op` by `algo` on the group `ranks` (module docstring)."""
    if algo not in ALGOS.get(op, ()):
        raise ValueError(f"tiers: {op!r} takes one of {ALGOS.get(op, ())}, not {algo!r}.")
    p = len(ranks)
    nodes, local = topo.span(ranks)
    if op == "all_to_all":
        inside = (local - 1) * (topo.intra.alpha + n / p * topo.intra.beta)
        across = (p - local) * (topo.inter.alpha + n / p * topo.inter.beta)
        return max(inside, across)
    if nodes == 1:
        if algo == "hierarchical":
            return seconds(op, "ring", ranks, n, topo)
        return on_link(op, algo, p, n, topo.intra)
    if algo != "hierarchical":
        return on_link(op, algo, p, n, topo.inter)
    if p != nodes * local:
        raise ValueError(f"tiers: the hierarchical {op} needs the same ranks on every node "
                         f"(group of {p} over {nodes} nodes, at most {local} on one).")
    intra, inter = topo.intra, topo.inter
    if op == "all_reduce":
        return (on_link("reduce_scatter", "ring", local, n, intra)
                + on_link("all_reduce", "ring", nodes, n / local, inter)
                + on_link("all_gather", "ring", local, n / local, intra))
    if op == "reduce_scatter":
        return (on_link("reduce_scatter", "ring", local, n, intra)
                + on_link("reduce_scatter", "ring", nodes, n / local, inter))
    return (on_link("all_gather", "ring", nodes, n, inter)             # all_gather
            + on_link("all_gather", "ring", local, nodes * n, intra))


def choose(op: str, ranks: Sequence[int], n: float, topo: Topology) -> tuple[str, float]:
    """(the cheapest algorithm, its seconds) for `op` on the group (ties: the first in
    ALGOS, the fewest messages)."""
    if op not in ALGOS:
        raise ValueError(f"tiers: no algorithms for {op!r}; known: {', '.join(ALGOS)}.")
    best = [(seconds(op, a, ranks, n, topo), i, a) for i, a in enumerate(ALGOS[op])]
    t, _, algo = min(best)
    return algo, t
