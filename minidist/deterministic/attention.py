"""Canonical attention: causal attention computed query run by query run over the whole
sequence's keys, so that a context-parallel rank holding some query tiles computes exactly
the single process's numbers for them.

Attention mixes positions: every query reads every earlier key, and in the backward every
key's gradient is a sum over the queries that read it,
    dK = sum over queries i of dS[i]^T q_i,      dV = sum over queries i of P[i]^T dY_i.
Context parallelism (parallel/context/) gives each rank some positions, so each rank
holds a part of those sums; ring attention also merges the keys block by block with an
online softmax. Both group the additions by the layout. The deterministic mode (this
package) needs one grouping for every layout, so here:
    1. the sequence is cut into runs of T / per_sequence positions (matmul.Tokens); a
       context-parallel rank holds whole runs;
    2. every rank gets the whole sequence's K and V (an all_gather over cp: exact data
       movement), in global position order;
    3. each query run is one batched matmul slice, (run, D) @ (D, T), the same shape in
       every layout; the softmax is per row;
    4. dK and dV come out per query run, (T, D) each, and are summed over the runs in the
       aligned tree of their global index (tree_sum.py), the other ranks' nodes through
       the exchange, after which each rank keeps its own positions' rows.
The single process runs the same code with every run local and no exchange.
`CanonicalAttention` is the attention core (nn/attention.py) that determinize gives every
attention layer when the mode runs with token tiles, in the single process and every layout.

One rank's view (cp rank r; q, k, v (B, h, T_r, D) of my positions P_r, m = T_r / run):
    K = my k at P_r among everyone's (all_gather), (B, h, T, D), repeated for my m runs
    S = q (B, h, m, run, D) @ K^T / sqrt(D), causal mask by global positions, softmax,
    dropout by global (head, query, key) position, Y = P @ V        (B, h, T_r, D)
    backward: dK (B, h, m, T, D) -> tree over my runs' global indices, exchanged over cp
Shapes and cost: K and V whole on every rank (T D per head), S (B, h, T_r, T): the
all-gather variant of context parallelism (as Llama 3 trains), O(T_r T) memory per rank
instead of ring attention's O(T_r (T / cp)) per step of the ring.
Communication: the all_gather of k and v (B h T_r D each) forward; the nodes of dK, dV
(at most ~2 log2(per_sequence) arrays of B h T D per rank) backward.
Reference: Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Sec. 3.3.2
    (context parallelism by all-gathering K and V).
Read next: deterministic/context.py.
"""

from __future__ import annotations

import math

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.autograd.tensor import Context, Function
from minidist.deterministic.matmul import Tokens, tree_over_tiles


class SequenceForRuns(Function):
    """k (B, h, T_r, D), my positions -> the whole sequence's k in global order, (B, h, T, D),
    repeated for my m query runs: (B, h, m, T, D). Backward: the runs' dK summed in the
    aligned tree over their global index (exchanged), then my positions' rows."""

    @staticmethod
    def forward(ctx: Context, k, *, tokens: Tokens):
        xp = backend.xp
        B, h, Tr, D = k.shape
        pos, T = (np.arange(Tr), Tr) if tokens.positions is None else tokens.positions(Tr)
        pos = np.asarray(pos)
        whole = xp.zeros((B, h, T, D), k.dtype)
        if tokens.exchange is None:
            whole[:, :, pos] = k
        else:                                 # everyone's positions and keys
            for p_r, k_r in zip(tokens.exchange(pos.astype(np.int64)),
                                tokens.exchange(xp.ascontiguousarray(k))):
                whole[:, :, p_r] = k_r
        index, count = tokens.leaves((1, Tr))
        ctx.tokens, ctx.pos, ctx.index, ctx.count = tokens, pos, index, count
        return xp.ascontiguousarray(xp.broadcast_to(whole[:, :, None],
                                                    (B, h, len(index), T, D)))

    @staticmethod
    def backward(ctx: Context, g):
        runs = g.transpose(2, 0, 1, 3, 4)                              # (m, B, h, T, D)
        whole = tree_over_tiles(runs, ctx.index, ctx.count, ctx.tokens.exchange)
        return (whole[:, :, ctx.pos],)


def canonical_attention(q: Tensor, k: Tensor, v: Tensor, tokens: Tokens, drop, key,
                        first_head: int, n_head: int) -> Tensor:
    """Causal attention of my queries q (B, h, T_r, D) over the whole sequence (module
    docstring), k, v of my positions; dropout by global position. Returns (B, h, T_r, D)."""
    B, h, Tr, D = q.shape
    pos, T = (np.arange(Tr), Tr) if tokens.positions is None else tokens.positions(Tr)
    pos = np.asarray(pos)
    m = len(tokens.leaves((1, Tr))[0])
    K = SequenceForRuns.apply(k, tokens=tokens)                        # (B, h, m, T, D)
    V = SequenceForRuns.apply(v, tokens=tokens)
    Q = q.reshape(B, h, m, Tr // m, D)
    scores = (Q @ K.transpose(0, 1, 2, 4, 3)) * (1.0 / math.sqrt(D))   # (B, h, m, run, T)
    future = np.arange(T)[None, :] > pos[:, None]                      # (T_r, T)
    scores = F.masked_fill(scores, backend.xp.asarray(future.reshape(m, Tr // m, T)),
                           -math.inf)
    att = F.softmax(scores, axis=-1).reshape(B, h, Tr, T)
    att = drop(att, key, {1: (first_head, n_head), 2: (pos, T), 3: (np.arange(T), T)})
    return (att.reshape(B, h, m, Tr // m, T) @ V).reshape(B, h, Tr, D)


class CanonicalAttention:
    """The attention core (nn/attention.py's protocol) of the deterministic mode with token
    tiles: canonical_attention over the runs of `tokens`, whatever else the layout does."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def attention(self, q: Tensor, k: Tensor, v: Tensor, drop, key, first_head: int,
                  n_head: int) -> Tensor:
        """My queries q (B, h, T_r, D) over the whole sequence -> y (B, h, T_r, D)."""
        return canonical_attention(q, k, v, self.tokens, drop, key, first_head, n_head)
