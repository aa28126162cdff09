"""Gang placement: where a job's GPUs go, all at once, on a cluster of equal nodes.

A data-parallel training job is a gang: its W workers all-reduce every step, so it can
only start when all of its W GPUs are free at the same moment, and it holds all of them
until it stops. Half a job is no job. On top of that, the GPUs of one node talk over
NVLink/PCIe and different nodes over the network, so a scheduler keeps a small job on
one node rather than scattering it (locality). Jeon et al. 2019 measure how much
queueing these two constraints cause on Philly.

The rule used here (every policy, the simulator and the --real driver share it):
    1. a job of g <= G GPUs (G = GPUs per node) runs on ONE node: the node with the
       fewest free GPUs that still holds g (best fit, so that whole nodes stay free for
       big jobs; ties go to the lower node index);
    2. a job of g > G GPUs takes g / G WHOLE, empty nodes (the lowest indices); g must be
       a multiple of G, so a job always holds exactly g GPUs (nothing idle inside it).
A placement is a tuple of (node, GPUs there) pairs, e.g. ((3, 2),) or ((0, 8), (1, 8)).

Because of rule 1 "g GPUs are free" does not mean "a g-GPU job fits": 4 free GPUs spread
as 1+1+2 on three nodes cannot take a 4-GPU job. That gap is fragmentation, and it is why
the policies ask `place` rather than count free GPUs.

Shapes: `free` is a list of free GPUs per node, length N (nodes), values in [0, G].
Reference: Jeon et al. 2019, "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN
Training Workloads", USENIX ATC'19 (gang scheduling and locality constraints on queueing).
Read next: cluster/traces.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Placement = tuple[tuple[int, int], ...]          # ((node, gpus on that node), ...)


@dataclass(frozen=True)
class Cluster:
    """N nodes of G GPUs each (G = gpus_per_node)."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster: {name} must be an int >= 1, got {value!r}")

    @property
    def capacity(self) -> int:
        return self.nodes * self.gpus_per_node

    def check_fits(self, job_id: str, gpus: int) -> None:
        """ValueError unless a job of `gpus` GPUs can run on this cluster when it is empty."""
        g, n = self.gpus_per_node, self.nodes
        if gpus > self.capacity:
            raise ValueError(f"job {job_id} needs {gpus} GPUs, but the cluster has only "
                             f"{n} x {g} = {self.capacity}; give more --nodes or a smaller job")
        if gpus > g and gpus % g:
            fit = (gpus // g + 1) * g
            raise ValueError(f"job {job_id} needs {gpus} GPUs: more than one node of {g} but "
                             f"not whole nodes, and a multi-node job takes whole nodes; use "
                             f"{gpus // g * g} or {fit} GPUs, or --gpus-per-node dividing {gpus}")


def place(free: Sequence[int], gpus: int, gpus_per_node: int) -> Placement | None:
    """Where a gang of `gpus` GPUs goes now (see the module rule), or None if it does not
    fit. Does not change `free`."""
    if gpus <= gpus_per_node:
        fits = [(have, node) for node, have in enumerate(free) if have >= gpus]
        if not fits:
            return None
        _, node = min(fits)                      # best fit: the fewest free GPUs that fit
        return ((node, gpus),)
    whole = [node for node, have in enumerate(free) if have == gpus_per_node]
    need = gpus // gpus_per_node
    if len(whole) < need:
        return None
    return tuple((node, gpus_per_node) for node in whole[:need])


def take(free: list[int], placement: Placement) -> None:
    """Mark the placement's GPUs as used (in place); RuntimeError if any is not free."""
    for node, count in placement:
        if free[node] < count:
            raise RuntimeError(f"placement {placement}: node {node} has {free[node]} free "
                               f"GPUs, fewer than {count}")
        free[node] -= count


def give_back(free: list[int], placement: Placement, gpus_per_node: int) -> None:
    """Return the placement's GPUs (in place); RuntimeError if a node would exceed G."""
    for node, count in placement:
        if free[node] + count > gpus_per_node:
            raise RuntimeError(f"placement {placement}: node {node} would have "
                               f"{free[node] + count} free GPUs, more than its {gpus_per_node}")
        free[node] += count
