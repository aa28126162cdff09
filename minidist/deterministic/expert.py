"""Deterministic mode under expert parallelism: every expert computes each grain's tokens in
a call of their own, and its gradient is summed over the grains in the fixed tree.

Under expert parallelism (parallel/expert/) a rank's experts receive, in one micro-batch,
the tokens of one grain from EVERY rank of its ep group (the ranks run their micro-batches
in lock step). Two things then differ from the single process, which runs each grain on
its own (one sample per micro-batch, deterministic/step.py):
    1. the expert's matmuls run on the tokens of W grains stacked, another shape than the
       single process's call on one grain's tokens (and BLAS bits depend on the shape);
    2. the expert's gradient is a sum over those W grains in whatever order the backward
       reaches them, where the single process adds grains in the aligned tree over the
       global batch.
So the deterministic mode replaces each ExpertParallelMoE by its twin GrainExpertMoE, which
runs its expert once per source grain, on an ALIAS of the expert: a copy of the module
whose parameters are new leaf tensors sharing the expert's values (`alias`). The call has the single process's shape, and its
gradient lands in that alias alone: one leaf per (expert, grain). `ExpertGrains` collects
them after each micro-batch, keyed by the grain's global index (the source rank's first
grain, all-gathered over ep once a step, plus the micro-batch index), and at the end of the
step sums each expert's grains in the aligned tree: the nodes of the grains this rank's
ep group ran, all-gathered over the expert's replicas (the expert-data-parallel group, which
together ran every grain once), and combined. The result replaces the expert's slice of
the dense root before the optimizer step.

One rank's view (ep rank s of W, experts E/W, micro-batch j of M, one grain each):
    begin: firsts = all_gather over ep of my first grain index
    forward of micro-batch j: for my expert e and each source s', y = alias(e)(tokens
        of grain firsts[s'] + j routed to e)   (0 rows still run, as in the single process)
    after its backward: take(j): the aliases' gradients, one flat vector per source grain
    end: root = combine(gather over edp of the nodes of my grains' vectors, B / grain)
Communication: one all_gather of W ints per step, and the experts' nodes over edp (at most
~2 log2(grains) flat vectors of this rank's expert parameters per rank).
ZeRO-3 works too: the alias is made inside the forward, after the experts' unit is gathered,
and keeps the gathered values. Full recomputation makes new aliases when it runs the block
again; the recomputed ones are those the backward reaches, and the ones read.
Under pipeline parallelism several micro-batches are in flight: the aliases are kept per
(micro-batch, expert, source), `at(j)` naming the micro-batch before each action, and
taken when the stage's schedule ends. Under DualPipe each layer lives on two stages, each
copy running one direction's micro-batches: a copy takes zeros for the grains it did not
run, and `over_mirror` adds the pair's grains (x + 0 = x) before the tree.
Read next: deterministic/layout.py.
"""

from __future__ import annotations

import copy

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Tensor
from minidist.deterministic.tree_sum import combine, gather_nodes, stacked_nodes
from minidist.nn.module import Module, Parameter
from minidist.parallel.expert.expert_parallel import ExpertParallelMoE, in_received_order, \
    is_expert_parameter, received_blocks


def alias(module: Module, prefix: str = "", leaves: dict | None = None) -> Module:
    """A copy of module whose parameters are fresh leaf tensors sharing the original values
    (its forward computes the same numbers; its gradients land on the copy only), listed by
    name in the copy's `alias_leaves`."""
    top, leaves = leaves is None, {} if leaves is None else leaves
    new = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, Parameter):
            leaves[prefix + key] = Tensor(value.data, requires_grad=True)
            setattr(new, key, leaves[prefix + key])
        elif isinstance(value, Module):
            setattr(new, key, alias(value, f"{prefix}{key}.", leaves))
    if top:
        new.alias_leaves = leaves
    return new


class GrainExpertMoE(ExpertParallelMoE):
    """ExpertParallelMoE (its twin: the same router, experts and group) running each local
    expert once per source rank's grain, on an alias, kept under (micro_batch, expert,
    source) in `grain_aliases`; ExpertGrains sets micro_batch before each forward."""

    grain_aliases: dict
    micro_batch: int

    def _compute(self, received: Tensor, recv_counts: np.ndarray) -> Tensor:
        W, per = recv_counts.shape
        blocks = received_blocks(recv_counts)
        pieces: dict[tuple[int, int], Tensor] = {}
        first = self.group.rank * per
        for j in range(per):
            for s in range(W):
                key = self.micro_batch, first + j, s
                self.grain_aliases[key] = alias(self.experts[first + j])
                pieces[s, j] = self.grain_aliases[key](received[blocks[s, j]])
        return in_received_order(pieces, received, W, per)


class ExpertGrains:
    """This rank's expert gradients per grain over one step (module docstring)."""

    def __init__(self, model, ep_group, expert_group) -> None:
        """model: determinized (its MoE layers GrainExpertMoE)."""
        self.ep, self.edp = ep_group, expert_group
        self.layers = {name: m for name, m in model.named_modules()
                       if isinstance(m, GrainExpertMoE)}
        self.named = [(n, p) for n, p in model.named_parameters() if is_expert_parameter(n)]
        self.leaves: dict[int, np.ndarray] = {}

    def begin(self, first: int) -> None:
        """COLLECTIVE over ep: the first grain index of every source rank of this step (none
        on a pipeline stage without MoE blocks, like every rank of its ep group)."""
        self.leaves = {}
        if not self.named:
            return
        self.firsts = C.all_gather(np.array([first], np.int64), group=self.ep).reshape(-1)

    def at(self, j: int) -> None:
        """Before micro-batch j's forward (or its recomputation): the aliases it makes are
        kept under j (a pipeline has several micro-batches in flight)."""
        for layer in self.layers.values():
            layer.micro_batch = j

    def take(self, j: int, mirrored: bool = False) -> None:
        """After micro-batch j's backward: each source's grain gradient of my experts.
        mirrored (DualPipe): a layer whose copy here did not run micro-batch j (its mirror
        stage's did) contributes zeros; over_mirror adds the two copies' grains."""
        if not self.named:
            return
        for s, first in enumerate(self.firsts):
            parts = []
            for name, p in self.named:               # "<layer>.experts.<e>.<param>"
                layer, rest = name.split(".experts.", 1)
                e, param = rest.split(".", 1)
                ran = self.layers[layer].grain_aliases.get((j, int(e), s))
                if ran is None and mirrored:
                    parts.append(np.zeros(p.data.size, p.data.dtype))
                    continue
                g = self.layers[layer].grain_aliases[j, int(e), s].alias_leaves[param].grad
                parts.append(np.zeros(p.data.size, p.data.dtype) if g is None
                             else backend.to_numpy(g).reshape(-1))
            self.leaves[int(first) + j] = np.concatenate(parts) if parts else np.zeros(0)
        for layer in self.layers.values():            # micro-batch j's aliases are done
            for key in [k for k in layer.grain_aliases if k[0] == j]:
                del layer.grain_aliases[key]

    def over_mirror(self, mirror) -> None:
        """COLLECTIVE over DualPipe's mirror pair: each grain's gradient of my experts is
        on the copy that ran it, zeros on the other; their sum (x + 0 = x) on both."""
        if not self.named:
            return
        grains = sorted(self.leaves)
        both = C.all_gather(np.stack([self.leaves[g] for g in grains]), group=mirror)
        self.leaves = {g: both[0, i] + both[1, i] for i, g in enumerate(grains)}

    def roots(self, count: int) -> dict[str, np.ndarray]:
        """COLLECTIVE over edp: each of my expert parameters' gradient, summed over all
        `count` grains in the aligned tree; {name: array of the parameter's shape}."""
        if not self.named:
            return {}
        grains = sorted(self.leaves)
        dtype = self.named[0][1].data.dtype
        stack = np.stack([self.leaves[g] for g in grains]).astype(dtype, copy=False)
        nodes = stacked_nodes(stack, grains)
        nodes = gather_nodes(nodes, stack.shape[1:], dtype,
                             lambda a: C.all_gather(a, group=self.edp), len(grains))
        flat, out, at = combine(nodes, count), {}, 0
        for name, p in self.named:
            out[name] = flat[at:at + p.data.size].reshape(p.data.shape).copy()
            at += p.data.size
        return out
