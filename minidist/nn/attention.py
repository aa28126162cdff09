"""Causal multi-head self-attention: each position mixes the values of the positions before it.

For every head h, with q, k, v the head's slices of x @ W_qkv:
    A_h = softmax(q_h k_h^T / sqrt(D) + M),   M[i, j] = -inf for j > i (the future), else 0
    y_h = A_h v_h
and the heads are concatenated and projected: y = concat_h(y_h) @ W_proj + b_proj.

The H heads are independent until the output projection. That is what tensor parallelism
uses: split W_qkv by heads (columns) and W_proj by rows, and each tp rank computes H/W_tp
whole heads with no communication until the projection's partial sums (see
parallel/tensor/). Sequence and context parallelism split T instead, which the causal
mask makes uneven: position i attends to i + 1 keys.

`attention_core` is the part every layout shares: softmax(q k^T / sqrt(D) + M) v for any
set of heads and any set of query and key positions, the mask and the dropout masks taken
from GLOBAL positions, so context parallelism (ring attention, Ulysses) can run it on the
blocks it holds and still draw the single process's numbers. With `selective` on (passed
by the Block from GPTConfig(recompute="selective")) memory/recompute.selective_attention
runs the core instead: its T^2 arrays (`attention_weights`) are rebuilt from q and k in the
backward instead of kept, and q, k, v are all it keeps (Korthikanti et al. 2022,
arXiv:2205.05198, Sec. 5). The numbers are the same, bit for bit.

Shapes (B batch, T positions, C = H * D width):
    x (B, T, C) -> qkv (B, T, 3C) -> q, k, v (B, H, T, D) -> A (B, H, T, T)
    -> y (B, H, T, D) -> (B, T, C) -> proj -> (B, T, C)
Cost: 2*B*T*C*3C (qkv) + 2*2*B*H*T*T*D (scores and A @ v) + 2*B*T*C*C (proj) flops.
Reference: Vaswani et al. 2017, "Attention is all you need", arXiv:1706.03762, Sec. 3.2.
Read next: nn/moe.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.memory import recompute as recomputation
from minidist.nn.layers import STD, Dropout, DropoutKey, Linear
from minidist.nn.module import Module


def attention_core(q: Tensor, k: Tensor, v: Tensor, q_pos, k_pos, drop: Dropout,
                   key: DropoutKey | None, first_head: int, n_head: int, T: int,
                   causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(D) + M) v for h heads: q (B, h, Tq, D), k, v (B, h, Tk, D).

    q_pos (Tq,), k_pos (Tk,): the global positions of the queries and keys (M masks the
    keys after each query); first_head, n_head, T: where these heads and positions sit in
    the global (B, H, T, T) attention matrix, so dropout draws the single process's mask.
    Returns y (B, h, Tq, D).
    """
    att = attention_weights(q, k, q_pos, k_pos, drop, key, first_head, n_head, T, causal)
    return att @ v                                            # (B, h, Tq, Tk) @ (B, h, Tk, D)


def attention_weights(q: Tensor, k: Tensor, q_pos, k_pos, drop: Dropout,
                      key: DropoutKey | None, first_head: int, n_head: int, T: int,
                      causal: bool = True) -> Tensor:
    """drop(softmax(q k^T / sqrt(D) + M)) (B, h, Tq, Tk): attention_core before "@ v"
    (what selective recomputation rebuilds; same arguments)."""
    D = q.shape[-1]
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(D))        # (B, h, Tq, Tk)
    if causal:
        scores = scores + causal_mask(q_pos, k_pos, scores.dtype)           # + M (Tq, Tk)
    att = F.softmax(scores, axis=-1)                                       # (B, h, Tq, Tk)
    return drop(att, key, {1: (first_head, n_head), 2: (np.asarray(q_pos), T),
                           3: (np.asarray(k_pos), T)})


def causal_mask(q_pos, k_pos, dtype) -> Any:
    """M (Tq, Tk): -inf where key position > query position (the future), else 0.

    Added, not filled in: x + 0 is x and x + (-inf) is -inf, so the scores are those of
    masked_fill bit for bit, but the add is one pass over the scores (a where is five times
    slower) and its backward passes the gradient on untouched (the softmax's is already 0
    in the future, where its output is 0)."""
    future = np.asarray(k_pos)[None, :] > np.asarray(q_pos)[:, None]
    mask = np.zeros(future.shape, dtype)
    mask[future] = -np.inf
    return backend.xp.asarray(mask)


class LocalAttention:
    """The attention core of a rank that holds the whole sequence: attention_core over all
    T positions, or, with `selective`, memory/recompute.selective_attention (the same
    numbers; the attention weights rebuilt in the backward instead of kept).

    An attention core is any object with this `attention` method; a layout that computes
    attention another way gives the layer its own (context parallelism's ring attention
    or Ulysses: parallel/context/context_parallel.py)."""

    def __init__(self, selective: bool = False) -> None:
        self.selective = selective

    def attention(self, q: Tensor, k: Tensor, v: Tensor, drop: Dropout,
                  key: DropoutKey | None, first_head: int, n_head: int) -> Tensor:
        """q, k, v (B, h, T, D) of heads first_head.. of n_head -> y (B, h, T, D)."""
        T = q.shape[2]
        pos = np.arange(T)
        args = (pos, pos, drop, key, first_head, n_head, T)
        if self.selective:
            return recomputation.selective_attention(attention_weights, q, k, v, *args)
        return attention_core(q, k, v, *args)


class CausalSelfAttention(Module):
    """Multi-head attention with a causal mask; heads = n_head, head dim D = C / n_head.

    `attend` is the part between the two projections: it takes qkv (B, T, 3 h D) for any
    number h of whole heads, so a tensor-parallel rank (parallel/tensor/) runs the same
    code on its h = H / W_tp heads, telling dropout where its heads sit among all H.
    `core` computes the attention of those heads (LocalAttention: the whole sequence is
    here; `selective` rebuilds the attention weights in the backward); context
    parallelism replaces it with one that runs over the cp group.
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, dropout: float = 0.0,
                 dtype: str = "float64", proj_std: float = STD,
                 selective: bool = False) -> None:
        if n_head < 1 or n_embd % n_head != 0:
            raise ValueError(f"CausalSelfAttention: n_embd={n_embd} is not divisible by "
                             f"n_head={n_head}; choose n_head among the divisors of n_embd.")
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = Linear(n_embd, 3 * n_embd, bias, dtype)
        self.proj = Linear(n_embd, n_embd, bias, dtype, std=proj_std)
        self.attn_drop = Dropout(dropout)
        self.resid_drop = Dropout(dropout)
        self.core = LocalAttention(selective)

    def forward(self, x: Tensor, key: DropoutKey | None = None) -> Tensor:
        y = self.attend(self.qkv(x), key)                      # (B, T, 3C) -> (B, T, C)
        return self.resid_drop(self.proj(y), key)               # (B, T, C)

    def attend(self, qkv: Tensor, key: DropoutKey | None, first_head: int = 0) -> Tensor:
        """Attention of the h heads in qkv (B, T, 3 h D) -> (B, T, h D).

        first_head: the global index of qkv's first head (dropout draws by global head).
        """
        B, T, width = qkv.shape
        D = self.head_dim
        h = width // (3 * D)
        q, k, v = F.split(qkv, 3, axis=-1)                      # 3 x (B, T, h D)
        q = q.reshape(B, T, h, D).transpose(0, 2, 1, 3)         # (B, h, T, D)
        k = k.reshape(B, T, h, D).transpose(0, 2, 1, 3)         # (B, h, T, D)
        v = v.reshape(B, T, h, D).transpose(0, 2, 1, 3)         # (B, h, T, D)
        y = self.core.attention(q, k, v, self.attn_drop, key, first_head, self.n_head)
        return y.transpose(0, 2, 1, 3).reshape(B, T, h * D)     # (B, T, h, D) -> (B, T, h D)
