"""Aux-loss-free balancing under any layout: every rank makes the single process's update.

DeepSeek-V3 balances its experts without an auxiliary loss: a bias b (E,) per MoE layer is
added to the routing scores for CHOOSING only, and after every step
    b[e] <- b[e] + gamma * sign(mean_e load - load[e])          (nn/routing.py)
where load[e] counts the assignments expert e got over the WHOLE global batch. The trap is
in "whole": a rank sees only its own tokens, a pipeline stage only its own layers, a
micro-batch only a part of the step. A bias updated from a rank's own counts drifts apart
from its replicas' and from the single process's; updated per micro-batch, it depends on
the micro-batch count (the bugs torchtitan fixed in PRs 1689, 2061 and 3000). Here the
counts are integers summed exactly, so the update is the single process's in every bit.

One rank's view of the end of a step (after the optimizer update):
    1. every MoE layer of my stage counted the assignments of every forward of the step
       (not their recomputation): routed = layer.take_routed()              (E,) int64
    2. load = all_reduce(routed) over the ranks that routed disjoint tokens of the batch:
       dp x cp (the gradient-sync group; an ep rank is a dp rank). The tp ranks of a group
       route the same tokens, and pipeline stages hold other layers: neither is summed.
    3. layer.update_bias(load): the same integers everywhere, so the same bits.
    4. the table: every MoE layer of the model, (L_moe, E), my stage's rows filled and the
       rest 0, summed over pp, and divided by the number of stages holding each layer
       (x + 0 = x, and x + x = 2x halves back to x, exactly): every rank holds every bias,
       which is what a checkpoint keeps and what a resumed run (any layout) loads back.
DualPipe holds every layer on two stages (s and P-1-s), each copy routing the micro-batches
of its direction: step 2 sums the load over that mirror pair too, so both copies make the
global batch's update.
Communication per step: L_stage E int64 over dp x cp (and over the mirror pair), and
L_moe (E + 1) float64 over pp.
References: DeepSeek-AI 2024, DeepSeek-V3, arXiv:2412.19437, Sec. 2.1.2; Wang et al.
    2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
    arXiv:2408.15664.
Read next: nn/routing.py (the rule), train.py (where the step calls it).
"""

from __future__ import annotations

import numpy as np

from minidist import collectives as C


class RoutingBalance:
    """The bias update of every bias-balanced MoE layer of this rank's model (docstring)."""

    def __init__(self, model, names: list[str], n_experts: int, load_group, pp_group=None,
                 algo: str = "auto", mirror_group=None) -> None:
        """names: every MoE layer of the whole model, in order ("blocks.1.moe", ...), each
        of n_experts; load_group: dp x cp; pp_group: the pipeline's stages, or None;
        mirror_group: DualPipe's pair of stages holding the same layers, or None."""
        self.names, self.load_group, self.pp_group, self.algo = list(names), load_group, \
            pp_group, algo
        self.mirror_group = mirror_group
        self.n_experts = n_experts
        self.layers = {n: m for n, m in model.named_modules()
                       if hasattr(m, "update_bias") and m.rule.bias_rate}
        unknown = set(self.layers) - set(self.names)
        if unknown:
            raise ValueError(f"RoutingBalance: layers {sorted(unknown)} are not among the "
                             f"model's MoE layers {self.names}")

    def begin(self) -> None:
        """Before a step's forwards: forget counts of a step computed again (the spike
        guard's retry), so each step's tokens are counted once."""
        for layer in self.layers.values():
            layer.take_routed()

    def step(self) -> dict[str, np.ndarray]:
        """COLLECTIVE over dp x cp, then pp: update my layers from the global load; the
        table {layer: bias} of the whole model, the same on every rank."""
        for layer in self.layers.values():
            load = C.all_reduce(layer.take_routed(), group=self.load_group, algo=self.algo)
            if self.mirror_group is not None:       # the other direction's micro-batches
                load = C.all_reduce(load, group=self.mirror_group, algo=self.algo)
            layer.update_bias(load)
        return self.table()

    def table(self) -> dict[str, np.ndarray]:
        """COLLECTIVE over pp: {layer: bias (E,)} for every MoE layer of the model."""
        rows = np.zeros((len(self.names), self.n_experts + 1))     # the bias, then 1 if held
        for i, name in enumerate(self.names):
            if name in self.layers:
                rows[i, :-1], rows[i, -1] = self.layers[name].score_bias, 1.0
        if self.pp_group is not None:
            rows = C.all_reduce(rows, group=self.pp_group, algo=self.algo)
        return {name: rows[i, :-1] / max(rows[i, -1], 1.0) for i, name in enumerate(self.names)}

    def load(self, table: dict) -> None:
        """Set my layers' biases from a table (a checkpoint's, any layout's)."""
        missing = [n for n in self.layers if n not in table]
        if missing:
            raise ValueError(f"routing biases: the state has none for {missing}")
        for name, layer in self.layers.items():
            value = np.asarray(table[name], np.float64)
            if value.shape != layer.score_bias.shape:
                raise ValueError(f"routing biases: {name} has shape {value.shape}, the layer "
                                 f"{layer.score_bias.shape}")
            layer.score_bias[...] = value
