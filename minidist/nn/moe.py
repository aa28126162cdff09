"""Mixture of experts, unsharded: a router sends each token to K of E expert MLPs.

The layer replaces a block's MLP. A linear router scores every token against every expert,
each token goes to its K best experts, and the token's output is the gate-weighted sum of
what those experts return. Each expert only sees the tokens routed to it, so parameters
grow with E while the compute per token stays that of K MLPs.

Routing groups. Capacity and drops are decided inside ROUTING GROUPS of G consecutive
tokens in row-major (b, t) order (GShard's groups): with G fixed by the model
(GPTConfig.moe_group_size, default one sequence, G = block_size), the same tokens are
dropped whatever the micro-batch count or the parallel layout, as long as no layout cuts
a group (parallel/compose.py refuses those that would). A call's last group may be
shorter (generation); training batches are whole groups.

Routing, for each group of G tokens, in order:
    1. logits = x @ W_router (G, E); probs = softmax(logits) over E.
    2. choice[n, :] = the K experts with the largest probs[n], best first (a tie goes to
       the lower expert index).
    3. capacity = min(G, ceil(capacity_factor * K * G / E)) assignments per expert.
    4. Assignments are admitted in this exact order: all FIRST choices of tokens
       n = 0, 1, ..., G-1, then all SECOND choices in token order, and so on. An expert
       accepts assignments until it holds `capacity`; every later one is DROPPED. So a
       first choice always wins over any second choice, and earlier tokens win ties.
    5. out[n] = sum over token n's admitted choices k of gate[n, k] * expert_k(x[n]),
       with gate[n, k] = probs[n, choice[n, k]] (the router probability itself, as in
       Switch; not renormalised over the K). A token whose every choice was dropped gets
       out[n] = 0, and the block's residual connection carries x[n] through unchanged.
Auxiliary losses, each a mean over the groups of the call:
    load balancing (Switch Transformer eq. 4, extended to K choices), per group g:
        f_ge = (assignments to e, before dropping) / (G K);  P_ge = mean_{n in g} probs[n, e]
        aux_g = E * sum_e f_ge * P_ge   (= 1 for a uniform router; f carries no gradient)
    router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): z_g = mean_{n in g} logsumexp(logits[n])^2
The layer returns aux_loss_coef * mean_g aux_g + z_loss_coef * mean_g z_g (its `last_stats`
keeps each value). The GPT weighs it by the share of the global batch's tokens the call
holds (aux_weight), so that every layout adds up the same mean over all groups.

Expert parallelism (parallel/expert/) reproduces this exactly: a rank routes its own
whole groups and sends each kept assignment to the rank of its expert.

Shapes: x (B, T, C) -> tokens (N, C); probs (N, E); choice, gate (N, K); expert e gets
(n_e, C), at most `capacity` per group; out (B, T, C). Experts use no dropout. An expert
that gets no token still runs (on 0 rows): its gradient is zeros, so the optimizer steps
it every step (weight decay, moments), as Megatron's grouped experts do, in every layout.
References: Shazeer et al. 2017, arXiv:1701.06538 (top-k gating); Lepikhin et al. 2020,
    GShard, arXiv:2006.16668, Sec. 2.2 (groups, capacity, priority of first choices); Fedus
    et al. 2021, Switch Transformers, arXiv:2101.03961, Sec. 2.2 (capacity factor, aux
    loss); Zoph et al. 2022, ST-MoE, arXiv:2202.08906, Sec. 3.1 (router z-loss).
Read next: nn/gpt.py, then parallel/expert/expert_parallel.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.memory.recompute import is_recomputing
from minidist.nn.layers import MLP, STD, Linear
from minidist.nn.module import Module, ModuleList


@dataclass(frozen=True)
class Routing:
    """Where every (token, choice) goes. Arrays are NumPy, shapes (N, K) unless noted."""

    choice: np.ndarray        # expert id of token n's k-th choice
    kept: np.ndarray          # True if the assignment fits in the expert's capacity
    slot: np.ndarray          # position in the expert's buffer, -1 where dropped
    load: np.ndarray          # (E,) assignments per expert before dropping
    capacity: int             # per group (of the first group, when the last is shorter)

    @property
    def n_dropped(self) -> int:
        return int((~self.kept).sum())

    def _replace_slot(self, slot: np.ndarray) -> "Routing":
        return Routing(self.choice, self.kept, slot, self.load, self.capacity)

    def tokens_of(self, e: int) -> np.ndarray:
        """Token ids held by expert e, in slot order (n_e,)."""
        n, k = np.nonzero(self.kept & (self.choice == e))
        return n[np.argsort(self.slot[n, k], kind="stable")]


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """min(N, ceil(capacity_factor * K * N / E)); rounding guards 1.1*10/1 = 11.000...02."""
    return min(n_tokens, math.ceil(round(capacity_factor * top_k * n_tokens / n_experts, 9)))


def route(probs: np.ndarray, top_k: int, capacity: int) -> Routing:
    """Top-k choice and capacity dropping in the order of the module docstring, step 4."""
    N, E = probs.shape
    choice = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]        # (N, K)
    flat = choice.T.reshape(-1)                       # (K*N,) order: choice rank, then token
    one_hot = flat[:, None] == np.arange(E)[None, :]                     # (K*N, E)
    position = np.cumsum(one_hot, axis=0)[np.arange(flat.size), flat] - 1    # (K*N,)
    kept = (position < capacity).reshape(top_k, N).T                     # (N, K)
    slot = np.where(kept, position.reshape(top_k, N).T, -1)              # (N, K)
    load = one_hot.sum(axis=0)                                           # (E,)
    return Routing(choice=choice, kept=kept, slot=slot, load=load, capacity=capacity)


def route_groups(probs: np.ndarray, top_k: int, group: int, capacity_factor: float
                 ) -> tuple[Routing, np.ndarray]:
    """route() on each group of `group` consecutive tokens (the last may be shorter).

    Returns the routing of all N tokens, expert e's slots numbered on from group to group
    (its buffer holds group 0's tokens, then group 1's, ...), and the (n_groups, E) load
    of each group before dropping.
    """
    N, E = probs.shape
    parts, base, loads = [], np.zeros(E, np.int64), []
    for lo in range(0, N, group):
        g = probs[lo:lo + group]
        r = route(g, top_k, expert_capacity(len(g), E, top_k, capacity_factor))
        parts.append(r._replace_slot(np.where(r.kept, r.slot + base[r.choice], -1)))
        base += np.bincount(r.choice[r.kept], minlength=E)
        loads.append(r.load)
    first = parts[0]
    return Routing(choice=np.concatenate([r.choice for r in parts]),
                   kept=np.concatenate([r.kept for r in parts]),
                   slot=np.concatenate([r.slot for r in parts]),
                   load=np.sum(loads, axis=0), capacity=first.capacity), np.array(loads)


class MoE(Module):
    """E expert MLPs (C -> F -> C) behind a top-k router with capacity and an aux loss."""

    def __init__(self, n_embd: int, hidden: int, n_experts: int, top_k: int,
                 capacity_factor: float, bias: bool = True, dtype: str = "float64",
                 proj_std: float = STD, group_size: int | None = None,
                 aux_loss_coef: float = 1.0, z_loss_coef: float = 0.0) -> None:
        """group_size: tokens per routing group (None: all the tokens of a call)."""
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and n_experts={n_experts}.")
        if not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be > 0.")
        if group_size is not None and group_size < 1:
            raise ValueError(f"MoE: group_size={group_size} must be >= 1 (tokens per group).")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.group_size, self.aux_loss_coef, self.z_loss_coef = group_size, aux_loss_coef, \
            z_loss_coef
        self.last_stats: dict = {}
        self.router = Linear(n_embd, n_experts, bias=False, dtype=dtype)
        self.experts = ModuleList([MLP(n_embd, hidden, bias, 0.0, dtype, proj_std)
                                   for _ in range(n_experts)])
        self.last_routing: Routing | None = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return (out (B, T, C), the weighted auxiliary losses, a scalar). Stores the
        routing in `last_routing` and {"aux", "z", "dropped", "load"} in `last_stats`."""
        B, T, C = x.shape
        N = B * T
        tokens = x.reshape(N, C)                                   # (B, T, C) -> (N, C)
        logits = self.router(tokens)                               # (N, C) @ (C, E) -> (N, E)
        probs = F.softmax(logits, axis=-1)                         # (N, E)
        r, aux = self._route(probs)
        out = self.combine(self.run_experts(tokens, r), probs, r)  # (N, C)
        total = aux * self.aux_loss_coef
        if self.z_loss_coef:
            z = self._z_loss(logits)
            total = total + z * self.z_loss_coef
            self.last_stats["z"] = float(z.item())
            groups = -(-N // (self.group_size or N))
            if not is_recomputing():            # counted once, in the first forward
                self.z_total = getattr(self, "z_total", 0.0) + groups * float(z.item())
        return out.reshape(B, T, C), total

    def _route(self, probs: Tensor) -> tuple[Routing, Tensor]:
        """The routing of every group, and mean_g aux_g (module docstring)."""
        N, E = probs.shape
        G = self.group_size or N
        r, loads = route_groups(backend.to_numpy(probs.data), self.top_k, G,
                                self.capacity_factor)
        self.last_routing = r
        if N % G:                                   # a shorter last group: its own mean
            sizes = np.array([min(G, N - lo) for lo in range(0, N, G)])
            means = F.concatenate([probs[lo:lo + G].mean(axis=0, keepdims=True)
                                   for lo in range(0, N, G)], axis=0)
        else:
            sizes = np.full(N // G, G)
            means = probs.reshape(N // G, G, E).mean(axis=1)            # (n_groups, E)
        f = backend.xp.asarray(loads / (sizes[:, None] * self.top_k), dtype=probs.dtype)
        aux = (means * f).sum(axis=-1).mean() * float(E)
        self.last_stats = {"aux": float(aux.item()), "dropped": r.n_dropped,
                           "load": r.load.copy()}
        kept = np.bincount(r.choice[r.kept], minlength=E)
        self._add_totals(np.concatenate([r.load, kept, [r.n_dropped, N * self.top_k,
                                                         len(sizes) * float(aux.item())]]),
                         len(sizes))
        return r, aux

    def _add_totals(self, row: np.ndarray, groups: int) -> None:
        if is_recomputing():    # a recomputed forward: counted once already (Megatron-LM
            return              # #1478 counted the aux loss twice)
        t = getattr(self, "totals", None)
        self.totals = row if t is None else t + row
        self.totals_groups = getattr(self, "totals_groups", 0) + groups

    def take_totals(self) -> np.ndarray:
        """Since the last call: [load (E), kept (E), dropped, assignments, sum_g aux_g,
        sum_g z_g, groups] as float64 (observability: train.py sums them over dp)."""
        E = self.n_experts
        t = getattr(self, "totals", None)
        t = np.zeros(2 * E + 3) if t is None else t
        z = getattr(self, "z_total", 0.0)
        out = np.concatenate([t, [z, getattr(self, "totals_groups", 0)]]).astype(np.float64)
        self.totals, self.totals_groups, self.z_total = None, 0, 0.0
        return out

    @staticmethod
    def _z_loss(logits: Tensor) -> Tensor:
        """mean over tokens of logsumexp(logits)^2 (= the mean over equal groups)."""
        m = backend.xp.asarray(logits.data.max(axis=-1, keepdims=True))    # constant shift
        lse = (logits - m).exp().sum(axis=-1).log() + m.reshape(-1)        # (N,)
        return (lse * lse).mean()

    def run_experts(self, tokens: Tensor, r: Routing) -> tuple[Tensor, np.ndarray]:
        """Each expert on its kept tokens, outputs stacked (+ a zero row for the dropped);
        returns (stacked (A + 1, C), row_of (N, K): the row of each assignment)."""
        N, C = tokens.shape
        # Run each expert on its tokens and stack the outputs: expert e's rows start at
        # `offset`; row_of[n, k] says where token n's k-th choice landed.
        outputs, row_of, offset = [], np.zeros((N, self.top_k), dtype=np.int64), 0
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

    @staticmethod
    def combine(expert_out: tuple[Tensor, np.ndarray], probs: Tensor, r: Routing) -> Tensor:
        """out[n] = sum_k gate[n, k] * (row of assignment (n, k)): (N, C)."""
        stacked, row_of = expert_out
        N, K = r.choice.shape
        gate = probs[np.arange(N)[:, None], r.choice]              # (N, K)
        picked = stacked[row_of]                                   # (N, K, C)
        return (picked * gate.reshape(N, K, 1)).sum(axis=1)        # (N, C)
