"""Mixture of experts, unsharded: a router sends each token to K of E expert MLPs.

The layer replaces a block's MLP. A linear router scores every token against every expert,
each token goes to its K best experts, and the token's output is the gate-weighted sum of
what those experts return. Each expert only sees the tokens routed to it, so parameters
grow with E while the compute per token stays that of K MLPs.

Routing, for the N = B*T tokens of the batch in row-major (b, t) order:
    1. logits = x @ W_router (N, E); probs = softmax(logits) over E.
    2. choice[n, :] = the K experts with the largest probs[n], best first (a tie goes to
       the lower expert index).
    3. capacity = min(N, ceil(capacity_factor * K * N / E)) assignments per expert.
    4. Assignments are admitted in this exact order: all FIRST choices of tokens
       n = 0, 1, ..., N-1, then all SECOND choices in token order, and so on. An expert
       accepts assignments until it holds `capacity`; every later one is DROPPED. So a
       first choice always wins over any second choice, and earlier tokens win ties.
    5. out[n] = sum over token n's admitted choices k of gate[n, k] * expert_k(x[n]),
       with gate[n, k] = probs[n, choice[n, k]] (the router probability itself, as in
       Switch; not renormalised over the K). A token whose every choice was dropped gets
       out[n] = 0, and the block's residual connection carries x[n] through unchanged.
Load-balancing loss (Switch Transformer eq. 4, extended to K choices):
    f_e = (number of assignments to e, before dropping) / (N * K);  P_e = mean_n probs[n, e]
    aux = E * sum_e f_e * P_e   (= 1 for a perfectly uniform router; f_e carries no gradient)

Expert parallelism (parallel/expert.py) must reproduce this exactly: the drop decisions
above are taken over ALL N tokens that enter the layer, so the sharded layer has to see
the same global token order (all-gather the counts, then apply the same order).

Shapes: x (B, T, C) -> tokens (N, C); probs (N, E); choice, gate (N, K); expert e gets
(n_e, C) with n_e <= capacity; out (B, T, C). Experts use no dropout.
References: Shazeer et al. 2017, arXiv:1701.06538 (top-k gating); Lepikhin et al. 2020,
    GShard, arXiv:2006.16668, Sec. 2.2 (capacity, priority of first choices); Fedus et al.
    2021, Switch Transformers, arXiv:2101.03961, Sec. 2.2 (capacity factor, aux loss).
Read next: nn/gpt.py, then parallel/expert.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.nn.layers import MLP, STD, Linear
from minidist.nn.module import Module, ModuleList


@dataclass(frozen=True)
class Routing:
    """Where every (token, choice) goes. Arrays are NumPy, shapes (N, K) unless noted."""

    choice: np.ndarray        # expert id of token n's k-th choice
    kept: np.ndarray          # True if the assignment fits in the expert's capacity
    slot: np.ndarray          # position in the expert's buffer, -1 where dropped
    load: np.ndarray          # (E,) assignments per expert before dropping
    capacity: int

    @property
    def n_dropped(self) -> int:
        return int((~self.kept).sum())

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


class MoE(Module):
    """E expert MLPs (C -> F -> C) behind a top-k router with capacity and an aux loss."""

    def __init__(self, n_embd: int, hidden: int, n_experts: int, top_k: int,
                 capacity_factor: float, bias: bool = True, dtype: str = "float64",
                 proj_std: float = STD) -> None:
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"MoE: top_k={top_k} must be between 1 and n_experts={n_experts}.")
        if not capacity_factor > 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be > 0.")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = Linear(n_embd, n_experts, bias=False, dtype=dtype)
        self.experts = ModuleList([MLP(n_embd, hidden, bias, 0.0, dtype, proj_std)
                                   for _ in range(n_experts)])
        self.last_routing: Routing | None = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Return (out (B, T, C), aux loss scalar). Stores the routing in `last_routing`."""
        B, T, C = x.shape
        N, E, K = B * T, self.n_experts, self.top_k
        tokens = x.reshape(N, C)                                   # (B, T, C) -> (N, C)
        probs = F.softmax(self.router(tokens), axis=-1)            # (N, C) @ (C, E) -> (N, E)
        r = route(backend.to_numpy(probs.data),
                  K, expert_capacity(N, E, K, self.capacity_factor))
        self.last_routing = r

        f = backend.xp.asarray(r.load / (N * K), dtype=probs.dtype)          # (E,) constant
        aux = (probs.mean(axis=0) * f).sum() * float(E)

        # Run each expert on its tokens and stack the outputs: expert e's rows start at
        # `offset`; row_of[n, k] says where token n's k-th choice landed.
        outputs, row_of, offset = [], np.zeros((N, K), dtype=np.int64), 0
        for e, expert in enumerate(self.experts):
            ids = r.tokens_of(e)                                   # (n_e,) in slot order
            if ids.size == 0:
                continue
            outputs.append(expert(tokens[ids]))                    # (n_e, C) -> (n_e, C)
            at = r.kept & (r.choice == e)
            row_of[at] = offset + r.slot[at]
            offset += ids.size
        zero_row = Tensor(backend.xp.zeros((1, C), dtype=x.dtype))
        stacked = F.concatenate(outputs + [zero_row], axis=0)      # (A + 1, C)
        row_of[~r.kept] = stacked.shape[0] - 1                     # dropped -> the zero row
        gate = probs[np.arange(N)[:, None], r.choice]              # (N, K)
        picked = stacked[row_of]                                   # (N, K, C)
        out = (picked * gate.reshape(N, K, 1)).sum(axis=1)         # (N, C)
        return out.reshape(B, T, C), aux
