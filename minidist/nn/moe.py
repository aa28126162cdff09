"""Mixture of experts, unsharded: a router sends each token to K of E expert MLPs.

The layer replaces a block's MLP. A linear router scores every token against every expert,
each token goes to K experts (nn/routing.py: softmax or sigmoid scores, token or expert
choice, group-limited routing, a balancing bias), and the token's output is the
gate-weighted sum of what those experts return, plus what the SHARED experts return: N_s
MLPs that every token goes through (DeepSeekMoE; 0 by default), held as one MLP of N_s
times an expert's width (their sum, as DeepSeek and Megatron hold them; the N_s output
biases become one). Each routed expert only
sees the tokens routed to it, so parameters grow with E while the compute per token stays
that of K (+ N_s) MLPs; fine-grained experts are many routed experts of a smaller hidden
size (GPTConfig.expert_hidden).

Routing groups. Capacity and drops are decided inside ROUTING GROUPS of G consecutive
tokens in row-major (b, t) order (GShard's groups): with G fixed by the model
(GPTConfig.moe_group_size, default one sequence, G = block_size), the same tokens are
dropped whatever the micro-batch count or the parallel layout, as long as no layout cuts
a group (parallel/compose.py refuses those that would). A call's last group may be
shorter (generation); training batches are whole groups.

The layer, for each group of G tokens (token choice; nn/routing.py has expert choice):
    1. logits = x @ W_router (G, E); s = softmax(logits) or sigmoid(logits) (G, E).
    2. choice[n, :] = the K experts with the largest s[n] + b (b: the balancing bias, 0
       unless the rule has a bias_rate; a tie goes to the lower expert index).
    3. capacity = min(G, ceil(capacity_factor * K * G / E)) assignments per expert, G
       when capacity_factor is 0 (dropless).
    4. Assignments are admitted in this exact order: all FIRST choices of tokens
       n = 0, 1, ..., G-1, then all SECOND choices in token order, and so on. An expert
       accepts assignments until it holds `capacity`; every later one is DROPPED. So a
       first choice always wins over any second choice, and earlier tokens win ties.
    5. out[n] = shared(x[n]) + sum over token n's admitted choices k of
       gate[n, k] * expert_k(x[n]), with gate[n, k] = s[n, choice[n, k]] (softmax: the
       router probability itself, as in Switch; sigmoid: normalised over the K chosen).
       A token whose every choice was dropped gets only the shared experts' output (0
       without them), and the block's residual connection carries x[n] through.
Auxiliary losses, each a mean over the groups of the call:
    load balancing (Switch Transformer eq. 4, extended to K choices), per group g:
        f_ge = (assignments to e, before dropping) / (G K);  P_ge = mean_{n in g} p[n, e]
        aux_g = E * sum_e f_ge * P_ge   (= 1 for a uniform router; f carries no gradient)
        with p = s normalised over the E experts (softmax: s itself). With groups of one
        sequence this is DeepSeek-V3's sequence-wise balance loss (eq. 17-20), the small
        alpha being aux_loss_coef. Expert choice is balanced by construction: no aux term.
    router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): z_g = mean_{n in g} logsumexp(logits[n])^2
The layer returns aux_loss_coef * mean_g aux_g + z_loss_coef * mean_g z_g (its `last_stats`
keeps each value). The GPT weighs it by the share of the global batch's tokens the call
holds (aux_weight), so that every layout adds up the same mean over all groups.
Aux-loss-free balancing: `score_bias` (E,) is b above; it is not a parameter (no
gradient): after each step the trainer sums `take_routed()` (the load since the last call)
over the global batch and calls `update_bias` (nn/routing.py's rule).

Expert parallelism (parallel/expert/) reproduces this exactly: a rank routes its own
whole groups and sends each kept assignment to the rank of its expert.

Shapes: x (B, T, C) -> tokens (N, C); s (N, E); choice, gate (N, K); expert e gets
(n_e, C), at most `capacity` per group; out (B, T, C). Experts use no dropout. An expert
that gets no token still runs (on 0 rows): its gradient is zeros, so the optimizer steps
it every step (weight decay, moments), as Megatron's grouped experts do, in every layout.
References: Shazeer et al. 2017, arXiv:1701.06538 (top-k gating); Lepikhin et al. 2020,
    GShard, arXiv:2006.16668, Sec. 2.2 (groups, capacity, priority of first choices); Fedus
    et al. 2021, Switch Transformers, arXiv:2101.03961, Sec. 2.2 (capacity factor, aux
    loss); Zoph et al. 2022, ST-MoE, arXiv:2202.08906, Sec. 3.1 (router z-loss); Dai et
    al. 2024, DeepSeekMoE, arXiv:2401.06066 (shared and fine-grained experts); DeepSeek-AI
    2024, DeepSeek-V3, arXiv:2412.19437, Sec. 2.1.2 (sigmoid gates, aux-loss-free bias).
Read next: nn/gpt.py, then parallel/expert/expert_parallel.py.
"""

from __future__ import annotations

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.memory.recompute import is_recomputing
from minidist.nn.grouped_experts import grouped_mlp
from minidist.nn.layers import MLP, STD, Linear
from minidist.nn.module import Module, ModuleList
from minidist.nn import routing
from minidist.nn.routing import Routing, RoutingRule, route_groups


class MoE(Module):
    """E expert MLPs (C -> F -> C) behind a router (nn/routing.py), with capacity, an aux
    loss, optional shared experts and an optional balancing bias."""

    def __init__(self, n_embd: int, hidden: int, n_experts: int, top_k: int,
                 capacity_factor: float, bias: bool = True, dtype: str = "float64",
                 proj_std: float = STD, group_size: int | None = None,
                 aux_loss_coef: float = 1.0, z_loss_coef: float = 0.0,
                 rule: RoutingRule = RoutingRule(), shared_experts: int = 0,
                 grouped: bool = True) -> None:
        """group_size: tokens per routing group (None: all the tokens of a call); hidden:
        each expert's (and shared expert's) width; capacity_factor 0: dropless; grouped:
        run the experts by the fast path (nn/grouped_experts.py), False the plain loop."""
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and n_experts={n_experts}.")
        if not capacity_factor >= 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be > 0, or 0 for "
                             f"dropless routing.")
        if group_size is not None and group_size < 1:
            raise ValueError(f"MoE: group_size={group_size} must be >= 1 (tokens per group).")
        if shared_experts < 0:
            raise ValueError(f"MoE: shared_experts={shared_experts} must be >= 0.")
        try:
            rule.check(n_experts, top_k, capacity_factor)
        except ValueError as e:
            raise ValueError(f"MoE: {e}") from None
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.group_size, self.aux_loss_coef, self.z_loss_coef = group_size, aux_loss_coef, \
            z_loss_coef
        self.rule, self.grouped = rule, grouped
        self.last_stats: dict = {}
        self.router = Linear(n_embd, n_experts, bias=False, dtype=dtype)
        self.experts = ModuleList([MLP(n_embd, hidden, bias, 0.0, dtype, proj_std)
                                   for _ in range(n_experts)])
        if shared_experts:          # N_s experts of width F: one MLP of width N_s F
            self.shared = MLP(n_embd, shared_experts * hidden, bias, 0.0, dtype, proj_std)
        self.score_bias = np.zeros(n_experts)      # b: chooses, never gates (no gradient)
        self.routed = np.zeros(n_experts, np.int64)     # load since the last take_routed()
        self.last_routing: Routing | None = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return (out (B, T, C), the weighted auxiliary losses, a scalar). Stores the
        routing in `last_routing` and {"aux", "z", "dropped", "load"} in `last_stats`."""
        B, T, C = x.shape
        N = B * T
        tokens = x.reshape(N, C)                                   # (B, T, C) -> (N, C)
        logits = self.router(tokens)                               # (N, C) @ (C, E) -> (N, E)
        s = routing.scores(logits, self.rule.kind)                 # (N, E)
        r, aux = self._route(s)
        out = self.combine(self.run_experts(tokens, r),            # (N, C)
                           routing.gates(s, r, self.rule.kind), r)
        if hasattr(self, "shared"):            # every token through the shared experts:
            # x itself (not `tokens`), so that x and tokens each have two consumers
            # and their gradients add up in the same order in every layout's graph (the
            # same bits); the routed part is the last operand
            out = self.shared(x).reshape(N, C) + out
        total = aux * self.aux_loss_coef
        if self.z_loss_coef:
            z = self._z_loss(logits)
            total = total + z * self.z_loss_coef
            self.last_stats["z"] = float(z.item())
            groups = -(-N // (self.group_size or N))
            if not is_recomputing():            # counted once, in the first forward
                self.z_total = getattr(self, "z_total", 0.0) + groups * float(z.item())
        return out.reshape(B, T, C), total

    def _route(self, s: Tensor) -> tuple[Routing, Tensor]:
        """The routing of every group, and mean_g aux_g (module docstring)."""
        N, E = s.shape
        G = self.group_size or N
        r, loads = route_groups(backend.to_numpy(s.data), self.top_k, G,
                                self.capacity_factor, self.rule,
                                self.score_bias if self.rule.bias_rate else None)
        self.last_routing = r
        sizes = np.array([min(G, N - lo) for lo in range(0, N, G)])
        if self.rule.kind == "expert-choice":       # balanced by construction: no aux term
            aux = Tensor(backend.xp.zeros((), dtype=s.dtype))
        else:
            p = routing.affinities(s, self.rule.kind)
            if N % G:                               # a shorter last group: its own mean
                means = F.concatenate([p[lo:lo + G].mean(axis=0, keepdims=True)
                                       for lo in range(0, N, G)], axis=0)
            else:
                means = p.reshape(N // G, G, E).mean(axis=1)            # (n_groups, E)
            f = backend.xp.asarray(loads / (sizes[:, None] * self.top_k), dtype=s.dtype)
            aux = (means * f).sum(axis=-1).mean() * float(E)
        self.last_stats = {"aux": float(aux.item()), "dropped": r.n_dropped,
                           "load": r.load.copy()}
        kept = np.bincount(r.choice[r.kept], minlength=E)
        if not is_recomputing():    # a recomputed forward: counted once already (Megatron-LM
            self.routed += r.load   # #1478 counted the aux loss twice)
            self._add_totals(np.concatenate([r.load, kept, r.unbiased_load, [
                r.n_dropped, N * self.top_k, len(sizes) * float(aux.item())]]), len(sizes))
        return r, aux

    def _add_totals(self, row: np.ndarray, groups: int) -> None:
        t = getattr(self, "totals", None)
        self.totals = row if t is None else t + row
        self.totals_groups = getattr(self, "totals_groups", 0) + groups

    def take_totals(self) -> np.ndarray:
        """Since the last call: [load (E), kept (E), unbiased load (E), dropped,
        assignments, sum_g aux_g, sum_g z_g, groups] as float64 (observability: train.py
        sums them over dp)."""
        E = self.n_experts
        t = getattr(self, "totals", None)
        t = np.zeros(3 * E + 3) if t is None else t
        z = getattr(self, "z_total", 0.0)
        out = np.concatenate([t, [z, getattr(self, "totals_groups", 0)]]).astype(np.float64)
        self.totals, self.totals_groups, self.z_total = None, 0, 0.0
        return out

    def take_routed(self) -> np.ndarray:
        """(E,) int64: the assignments each expert got (before dropping) since the last
        call, each forward counted once (not its recomputation)."""
        out, self.routed = self.routed, np.zeros_like(self.routed)
        return out

    def update_bias(self, load: np.ndarray) -> None:
        """Aux-loss-free balancing's step (nn/routing.py) from the GLOBAL batch's load."""
        routing.update_bias(self.score_bias, load, self.rule.bias_rate)

    @staticmethod
    def _z_loss(logits: Tensor) -> Tensor:
        """mean over tokens of logsumexp(logits)^2 (= the mean over equal groups)."""
        m = backend.xp.asarray(logits.data.max(axis=-1, keepdims=True))    # constant shift
        lse = (logits - m).exp().sum(axis=-1).log() + m.reshape(-1)        # (N,)
        return (lse * lse).mean()

    def run_experts(self, tokens: Tensor, r: Routing) -> tuple[Tensor, np.ndarray]:
        """Each expert on its kept tokens, outputs stacked (+ a zero row for the dropped);
        returns (stacked (A + 1, C), row_of (N, K): the row of each assignment). The plain
        loop below, or its fast path run_experts_grouped (the same bits)."""
        if self.grouped:
            return self.run_experts_grouped(tokens, r)
        N, C = tokens.shape
        K = r.choice.shape[1]            # K, or E under expert choice
        # Run each expert on its tokens and stack the outputs: expert e's rows start at
        # `offset`; row_of[n, k] says where token n's k-th choice landed.
        outputs, row_of, offset = [], np.zeros((N, K), dtype=np.int64), 0
        for e, expert in enumerate(self.experts):
            ids = r.tokens_of(e)                   # (n_e,) in slot order; n_e may be 0:
            outputs.append(expert(tokens[ids]))    # then its gradient is zeros, not None
            if ids.size == 0:
                continue
            at = r.kept & (r.choice == e)
            row_of[at] = offset + r.slot[at]
            offset += ids.size
        zero_row = Tensor(backend.xp.zeros((1, C), dtype=tokens.dtype))
        stacked = F.concatenate(outputs + [zero_row], axis=0)      # (A + 1, C)
        row_of[~r.kept] = stacked.shape[0] - 1                     # dropped -> the zero row
        return stacked, row_of

    def run_experts_grouped(self, tokens: Tensor, r: Routing) -> tuple[Tensor, np.ndarray]:
        """run_experts' fast path, the same bits (tests/nn/test_grouped_experts.py): the
        kept assignments gathered once, expert-major, and every expert run on its segment
        in one node (nn/grouped_experts.py)."""
        N, C = tokens.shape
        ids = [r.tokens_of(e) for e in range(self.n_experts)]          # slot order each
        counts = np.array([len(i) for i in ids], np.int64)
        order = np.concatenate(ids)
        zero_row = Tensor(backend.xp.zeros((1, C), dtype=tokens.dtype))
        stacked = F.concatenate([grouped_mlp(tokens[order], list(self.experts), counts),
                                 zero_row], axis=0)                    # (A + 1, C)
        offset = np.concatenate([[0], np.cumsum(counts)])
        row_of = np.where(r.kept, offset[r.choice] + np.maximum(r.slot, 0), int(offset[-1]))
        return stacked, row_of.astype(np.int64)

    @staticmethod
    def combine(expert_out: tuple[Tensor, np.ndarray], gate: Tensor, r: Routing) -> Tensor:
        """out[n] = sum_k gate[n, k] * (row of assignment (n, k)): (N, C); gate (N, K)."""
        stacked, row_of = expert_out
        N, K = r.choice.shape
        picked = stacked[row_of]                                   # (N, K, C)
        return (picked * gate.reshape(N, K, 1)).sum(axis=1)        # (N, C)
