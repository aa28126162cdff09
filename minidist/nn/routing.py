"""Routing for a mixture of experts: which expert gets which token, and with what weight.

A router scores every token n against every expert e, s[n, e] (from logits = x @ W_router),
chooses, and gives each chosen (token, expert) pair a gate. The choices and drops are made
inside ROUTING GROUPS of G consecutive tokens (nn/moe.py explains why), so everything below
is one group's view: scores (G, E).

Scores (`RoutingRule.kind`):
    softmax         s = softmax(logits) over E                  (Switch, GShard)
    sigmoid         s = sigmoid(logits), each expert on its own  (DeepSeek-V3, Sec. 2.1.2)
    expert-choice   s = softmax(logits) over E, but the EXPERTS choose (below)
Token choice (softmax, sigmoid): token n takes the K experts with the largest
    key[n, e] = s[n, e] + b[e]                (b: the balancing bias, 0 unless bias_rate > 0)
best first, a tie going to the lower expert index. The bias only CHOOSES: the gates use s.
    Group-limited routing (groups D > 1, limit M < D): the E experts form D contiguous
    groups of E/D (the experts of one ep rank, or of one node). Each group is scored by
    the sum of its ceil(K/M) largest keys; token n keeps its M best groups and takes its K
    experts among theirs only, so its tokens travel to at most M groups of ranks
    (DeepSeek-V3's node-limited routing, Sec. 2.1.2 and 3.2.2).
Capacity (token choice): an expert takes at most capacity = min(G, ceil(cf K G / E))
    assignments per group, admitted all first choices in token order, then all second
    choices, and so on; later ones are dropped (GShard's priority). capacity_factor 0 is
    DROPLESS: capacity = G, which no expert can exceed (a token takes an expert once).
Gates: softmax: g[n, k] = s[n, choice[n, k]] (Switch: not renormalised over the K);
    sigmoid: g[n, k] = s[n, choice[n, k]] / sum_j s[n, choice[n, j]] (normalised over
    the K chosen; DeepSeek-V3 eq. 13, without its routed scaling factor).
Expert choice (Zhou et al. 2022): each expert e takes the `capacity` tokens of the group
    with the largest s[n, e] (ties: the lower token index), capacity = ceil(cf K G / E) with
    K the average experts per token. Loads are equal by construction; a token may be taken
    by several experts or by none (its output is then 0: the residual carries it). The
    gate is s[n, e]. There is no auxiliary loss to add and no bias to learn. It looks at
    the whole group to choose, so in a causal LM a token's routing depends on later tokens
    of its group (the paper's caveat for autoregressive decoding).

A Routing is the same structure for both: choice (N, K') holds token n's candidate experts
(K' = K for token choice; K' = E and choice[n, j] = j for expert choice), kept says which
assignments an expert took, slot where they sit in its buffer.

Aux-loss-free balancing (DeepSeek-V3, Sec. 2.1.2, Wang et al. 2024, arXiv:2408.15664):
after every step, with load[e] the assignments (before dropping) expert e got over the
WHOLE global batch,
    b[e] <- b[e] + gamma * sign(mean_e load - load[e])
so an overloaded expert becomes less attractive; `update_bias` is that rule. Whoever trains
sums the load over every rank that routed a part of the batch first (baseline.py: one
process; parallel/expert/balancing.py under a layout).

References: Lepikhin et al. 2020, GShard, arXiv:2006.16668 (groups, capacity, priority);
    Fedus et al. 2021, Switch Transformers, arXiv:2101.03961; DeepSeek-AI 2024,
    DeepSeek-V3, arXiv:2412.19437, Sec. 2.1.2 (sigmoid gates, bias, node-limited routing);
    Zhou et al. 2022, Mixture-of-Experts with Expert Choice Routing, arXiv:2202.09368.
Read next: nn/moe.py (the layer that uses them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from minidist.autograd import Tensor
from minidist.autograd import functional as F

KINDS = ("softmax", "sigmoid", "expert-choice")


@dataclass(frozen=True)
class RoutingRule:
    """How a MoE layer routes (module docstring): the score, group-limited routing, and
    the balancing bias's step gamma (0: no bias)."""

    kind: str = "softmax"
    groups: int = 1              # D: experts in D contiguous groups
    limit: int = 0               # M: a token's experts in at most M groups (0: no limit)
    bias_rate: float = 0.0       # gamma of aux-loss-free balancing

    def check(self, n_experts: int, top_k: int, capacity_factor: float) -> None:
        """ValueError, naming the setting, for a rule that cannot route E experts top-K."""
        E, K, D, M = n_experts, top_k, self.groups, self.limit
        if self.kind not in KINDS:
            raise ValueError(f"router={self.kind!r} is unknown; use one of {', '.join(KINDS)}.")
        if D < 1 or E % D:
            raise ValueError(f"route_groups={D} must be >= 1 and divide n_experts={E} (the "
                             f"experts form that many equal groups).")
        if not 0 <= M <= D:
            raise ValueError(f"route_limit={M} must be between 0 (no limit) and "
                             f"route_groups={D}.")
        if M and M * (E // D) < K:
            raise ValueError(f"route_limit={M} groups of {E // D} experts hold fewer than "
                             f"top_k={K}; use route_limit={-(-K // (E // D))}.")
        if not self.bias_rate >= 0:
            raise ValueError(f"bias_rate={self.bias_rate} must be >= 0 (0: no balancing bias).")
        if self.kind == "expert-choice":
            if self.bias_rate or M:
                raise ValueError("router='expert-choice' balances by construction: it takes "
                                 "no balancing bias and no group limit.")
            if capacity_factor == 0:
                raise ValueError("router='expert-choice' needs a capacity (each expert takes "
                                 "that many tokens); use capacity_factor=1.0 or another value "
                                 "above 0.")

    @property
    def limited(self) -> bool:
        return 0 < self.limit < self.groups


@dataclass(frozen=True)
class Routing:
    """Where every (token, candidate) goes. Arrays are NumPy, shapes (N, K') unless noted."""

    choice: np.ndarray        # expert id of token n's k-th candidate
    kept: np.ndarray          # True if the expert took the assignment
    slot: np.ndarray          # position in the expert's buffer, -1 where not taken
    load: np.ndarray          # (E,) assignments per expert before dropping
    capacity: int             # per group (of the first group, when the last is shorter)
    n_dropped: int = -1       # token choice: assignments dropped; expert choice: tokens no
    #                           expert took (-1: count the untaken assignments)
    unbiased_load: np.ndarray | None = None   # (E,) the load the choice without bias gives

    def __post_init__(self) -> None:
        if self.n_dropped < 0:
            object.__setattr__(self, "n_dropped", int((~self.kept).sum()))
        if self.unbiased_load is None:
            object.__setattr__(self, "unbiased_load", self.load)

    def tokens_of(self, e: int) -> np.ndarray:
        """Token ids held by expert e, in slot order (n_e,)."""
        n, k = np.nonzero(self.kept & (self.choice == e))
        return n[np.argsort(self.slot[n, k], kind="stable")]


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """min(N, ceil(capacity_factor * K * N / E)); rounding guards 1.1*10/1 = 11.000...02.
    capacity_factor 0: dropless, N."""
    if capacity_factor == 0:
        return n_tokens
    return min(n_tokens, math.ceil(round(capacity_factor * top_k * n_tokens / n_experts, 9)))


def scores(logits: Tensor, kind: str) -> Tensor:
    """s (N, E): softmax over the experts, or each expert's sigmoid."""
    return F.sigmoid(logits) if kind == "sigmoid" else F.softmax(logits, axis=-1)


def affinities(s: Tensor, kind: str) -> Tensor:
    """The scores normalised over all E experts (the load-balancing loss's P): softmax
    scores already are; sigmoid ones are divided by their sum (DeepSeek-V3 eq. 19)."""
    return F.normalize(s, axis=-1) if kind == "sigmoid" else s


def gates(s: Tensor, r: Routing, kind: str) -> Tensor:
    """(N, K') gate of every candidate: s at the chosen expert; sigmoid: normalised over
    the K chosen."""
    N = r.choice.shape[0]
    g = s[np.arange(N)[:, None], r.choice]                          # (N, K')
    return F.normalize(g, axis=-1) if kind == "sigmoid" else g


def choose(key: np.ndarray, top_k: int, rule: RoutingRule = RoutingRule()) -> np.ndarray:
    """(G, K): each token's K experts with the largest key, best first (ties: lower index),
    among the experts of its `rule.limit` best groups when routing is group-limited."""
    if rule.limited:
        G, E = key.shape
        D, M = rule.groups, rule.limit
        grouped = -np.sort(-key.reshape(G, D, E // D), axis=2)          # each group, desc.
        group_score = grouped[:, :, :-(-top_k // M)].sum(axis=2)        # (G, D)
        best = np.argsort(-group_score, axis=1, kind="stable")[:, :M]   # (G, M)
        allowed = np.zeros((G, D), bool)
        np.put_along_axis(allowed, best, True, axis=1)
        key = np.where(np.repeat(allowed, E // D, axis=1), key, -np.inf)
    return np.argsort(-key, axis=1, kind="stable")[:, :top_k]


def admit(choice: np.ndarray, n_experts: int, capacity: int) -> Routing:
    """Capacity dropping in GShard's order (module docstring) for a group's choices."""
    N, K = choice.shape
    E = n_experts
    flat = choice.T.reshape(-1)                       # (K*N,) order: choice rank, then token
    one_hot = flat[:, None] == np.arange(E)[None, :]                     # (K*N, E)
    position = np.cumsum(one_hot, axis=0)[np.arange(flat.size), flat] - 1    # (K*N,)
    kept = (position < capacity).reshape(K, N).T                         # (N, K)
    slot = np.where(kept, position.reshape(K, N).T, -1)                  # (N, K)
    load = one_hot.sum(axis=0)                                           # (E,)
    return Routing(choice=choice, kept=kept, slot=slot, load=load, capacity=capacity)


def route(probs: np.ndarray, top_k: int, capacity: int, rule: RoutingRule = RoutingRule(),
          bias: np.ndarray | None = None) -> Routing:
    """One group's token-choice routing: choose on scores + bias, then admit."""
    E = probs.shape[1]
    if bias is None or not bias.any():
        return admit(choose(probs, top_k, rule), E, capacity)
    r = admit(choose(probs + bias, top_k, rule), E, capacity)
    plain = np.bincount(choose(probs, top_k, rule).reshape(-1), minlength=E)
    return dataclasses.replace(r, unbiased_load=plain)


def expert_choice(s: np.ndarray, capacity: int) -> Routing:
    """One group's expert-choice routing: expert e takes its `capacity` best tokens; the
    slots number each expert's tokens in token order."""
    G, E = s.shape
    picks = np.argsort(-s, axis=0, kind="stable")[:capacity]           # (capacity, E)
    kept = np.zeros((G, E), bool)
    np.put_along_axis(kept, picks, True, axis=0)
    slot = np.where(kept, np.cumsum(kept, axis=0) - 1, -1)
    choice = np.broadcast_to(np.arange(E), (G, E)).copy()
    return Routing(choice=choice, kept=kept, slot=slot, load=kept.sum(axis=0),
                   capacity=capacity, n_dropped=int((~kept.any(axis=1)).sum()))


def route_groups(s: np.ndarray, top_k: int, group: int, capacity_factor: float,
                 rule: RoutingRule = RoutingRule(), bias: np.ndarray | None = None
                 ) -> tuple[Routing, np.ndarray]:
    """The routing of all N tokens, group by group of `group` consecutive ones (the last may
    be shorter): expert e's slots numbered on from group to group (its buffer holds group
    0's tokens, then group 1's, ...), and the (n_groups, E) load of each group before
    dropping."""
    N, E = s.shape
    parts, base, loads = [], np.zeros(E, np.int64), []
    for lo in range(0, N, group):
        g = s[lo:lo + group]
        capacity = expert_capacity(len(g), E, top_k, capacity_factor)
        r = expert_choice(g, capacity) if rule.kind == "expert-choice" else \
            route(g, top_k, capacity, rule, bias)
        parts.append(dataclasses.replace(r, slot=np.where(r.kept, r.slot + base[r.choice], -1)))
        base += np.bincount(r.choice[r.kept], minlength=E)
        loads.append(r.load)
    return Routing(choice=np.concatenate([r.choice for r in parts]),
                   kept=np.concatenate([r.kept for r in parts]),
                   slot=np.concatenate([r.slot for r in parts]),
                   load=np.sum(loads, axis=0), capacity=parts[0].capacity,
                   n_dropped=sum(r.n_dropped for r in parts),
                   unbiased_load=np.sum([r.unbiased_load for r in parts], axis=0)
                   ), np.array(loads)


def update_bias(bias: np.ndarray, load: np.ndarray, rate: float) -> None:
    """In place: b[e] += rate * sign(mean(load) - load[e]) (module docstring); load is the
    global batch's, so every rank makes the same update."""
    load = np.asarray(load, np.float64)
    bias += rate * np.sign(load.mean() - load)
