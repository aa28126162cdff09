"""DeepSpeed-Ulysses: an all-to-all swaps sequence shards for head shards around attention.

Context parallelism splits the sequence T over the W ranks of the cp group. Everything in
a transformer block except attention works position by position, so it runs on the shard
as is; attention needs every key for every query. The heads, though, are independent
until the output projection. Ulysses (Jacobs et al. 2023) exploits that: just before
attention an all-to-all hands every rank h/W whole heads for ALL T positions; each rank
runs ordinary attention on its heads; a second all-to-all hands the heads back and every
rank again holds all h heads for its own positions. Attention itself is untouched, so
the result is the single process's up to the order of floating-point additions, which
here is the same too: each (head, query) row is computed by one rank over all keys.

Positions need not be contiguous. Rank s holds the tokens at global positions
positions[s] (contiguous slices, or zig-zag: chunks s and 2W-1-s of 2W chunks, which
ring attention uses to balance its causal work). After the first all-to-all a rank holds
the tokens of rank 0, then rank 1, ... (source-rank order), i.e. the positions
concat_s(positions[s]), a permutation of 0..T-1. attention_core masks and draws dropout
by those GLOBAL positions and by the global head index, so the permutation changes
nothing: the causal mask compares true positions, and every dropout element is the one
the single process draws. With Ulysses, zig-zag buys nothing (every rank attends all T
queries of its heads, so the work is balanced anyway); it is accepted so that a model can
switch between ring attention and Ulysses without re-sharding its sequence.

One rank's view (rank r of the cp group of W; h heads here, T_r = len(positions[r])):
    1. stack q, k, v (B, h, T_r, D) -> (3, B, h, T_r, D); cut the head axis into W groups
       of h/W; all-to-all: group s goes to rank s, and from every rank s arrives my head
       group for its T_s positions -> (3, B, h/W, T, D), the sequence in source-rank order;
    2. y_r = attention_core(q, k, v) on heads first_head + r h/W .. + (r+1) h/W - 1 with
       q_pos = k_pos = concat_s(positions[s]) -> (B, h/W, T, D);
    3. cut y_r along T into the W ranks' position blocks; all-to-all: block s goes back to
       rank s, and from every rank s arrives head group s for my positions -> concatenated
       over the head axis, y (B, h, T_r, D).
   Backward: each all-to-all's adjoint is the reverse all-to-all (dy: step 3 backwards,
   then attention's backward, then dq, dk, dv: step 1 backwards).

Shapes and sharding (cp group of W, T = sum_s T_s, h = H / tp heads on this rank):
    q, k, v[B, h, T_cp, D]  --a2a-->  qkv[3, B, h_cp, T, D]  --attention-->  y[B, h_cp, T, D]
    --a2a-->  y[B, h, T_cp, D]
  h must be divisible by W: each rank needs whole heads. Composed with tensor parallelism
  the heads are split over tp x cp, so n_head must be divisible by tp * cp.

Communication (per rank, per call, itemsize b; this implementation's pairwise all-to-all
sends every byte once and keeps its own piece):
    forward   q, k, v in ONE all-to-all:  3 B h T_r D b (W-1)/W
              y:                          B (h/W) (T - T_r) D b   (= B h T_r D b (W-1)/W
                                          when every rank holds T/W positions)
    backward  dy:                         B h T_r D b (W-1)/W
              dq, dk, dv in one:          3 B (h/W) (T - T_r) D b
              (the same total as the forward when every rank holds T/W positions).
  DeepSpeed counts 4 all-to-alls per layer forward (q, k, v, out), each of (W-1)/W of the
  activation B h T_r D; stacking q, k, v sends the same bytes in one call (3 messages fewer
  per step of the pairwise schedule). The volume per rank does not grow with W at fixed
  T/W, unlike the all-gathers of Megatron SP (their Sec. 3.2 analysis: 4 N h / P per link).
  Every piece's size is known from `positions`, so no counts are exchanged.

References: Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
    Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509, Sec. 3
    (3.1 design and Fig. 2; 3.2 communication analysis).
Read next: parallel/context/ring_attention.py (the other way to split attention over T).
"""

from __future__ import annotations

import numpy as np

from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.nn.attention import attention_core
from minidist.nn.layers import Dropout, DropoutKey
from minidist.parallel import placement as pl


def seq_to_heads(x: np.ndarray, group, lengths: list[int]) -> np.ndarray:
    """x[..., h, T_r, D] (my positions, all my heads) -> x[..., h/W, T, D] (my heads, all T).

    One all-to-all of x's W head groups; the received blocks are the ranks' position
    blocks in source-rank order, lengths[s] positions from rank s. Sends x.nbytes (W-1)/W.
    """
    W = group.size
    pieces = np.split(x, W, axis=-3)                        # W x (..., h/W, T_r, D)
    flat = np.concatenate([p.ravel() for p in pieces])      # piece s is addressed to rank s
    per_pos = int(np.prod(x.shape[:-3])) * (x.shape[-3] // W) * x.shape[-1]   # per position
    got = C.all_to_all(flat, [pieces[0].size] * W, group=group,
                       recv_sizes=[per_pos * n for n in lengths])
    lead = x.shape[:-3] + (x.shape[-3] // W,)
    blocks = np.split(got, np.cumsum([per_pos * n for n in lengths])[:-1])
    return np.concatenate([b.reshape(lead + (n, x.shape[-1])) for b, n in zip(blocks, lengths)],
                          axis=-2)                          # (..., h/W, T, D)


def heads_to_seq(y: np.ndarray, group, lengths: list[int]) -> np.ndarray:
    """y[..., h/W, T, D] (my heads, all T) -> y[..., h, T_r, D] (my positions, all heads).

    The adjoint of seq_to_heads: position block s (lengths[s] positions) goes back to rank
    s; head group s of my positions arrives from rank s. Sends y.nbytes (T - T_r) / T.
    """
    rank, W = group.rank, group.size
    blocks = np.split(y, np.cumsum(lengths)[:-1], axis=-2)  # block s: (..., h/W, T_s, D)
    flat = np.concatenate([b.ravel() for b in blocks])
    mine = blocks[rank].size
    got = C.all_to_all(flat, [b.size for b in blocks], group=group, recv_sizes=[mine] * W)
    pieces = got.reshape((W,) + blocks[rank].shape)         # (W, ..., h/W, T_r, D)
    return np.concatenate(list(pieces), axis=-3)            # (..., h, T_r, D)


class SeqToHeads(Function):
    """q, k, v[B, h, T_r, D] -> qkv[3, B, h/W, T, D]; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, q, k, v, *, group, lengths):
        ctx.group, ctx.lengths = group, lengths
        return seq_to_heads(np.stack([q, k, v]), group, lengths)   # (3, B, h/W, T, D)

    @staticmethod
    def backward(ctx, dqkv):
        d = heads_to_seq(dqkv, ctx.group, ctx.lengths)              # (3, B, h, T_r, D)
        return tuple(d[i] if need else None for i, need in enumerate(ctx.needs_input_grad))


class HeadsToSeq(Function):
    """y[B, h/W, T, D] -> y[B, h, T_r, D]; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, y, *, group, lengths):
        ctx.group, ctx.lengths = group, lengths
        return heads_to_seq(y, group, lengths)

    @staticmethod
    def backward(ctx, dy):
        return (seq_to_heads(dy, ctx.group, ctx.lengths),)


def _check(q: Tensor, k: Tensor, v: Tensor, group, positions, T: int, n_head: int) -> None:
    """ValueError, saying how to fix it, unless the shapes and positions fit together."""
    rank, W = group.rank, group.size
    where = f"[rank {rank}/{W}] ulysses_attention:"
    B, h, T_r, D = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{where} q {q.shape}, k {k.shape} and v {v.shape} must have the "
                         "same shape (B, h, T_r, D).")
    if h % W:
        tp = f"tp={n_head // h}" if h and n_head % h == 0 else "tp"
        raise ValueError(
            f"{where} n_head={n_head} heads split over {tp} leave h={h} heads on this rank, "
            f"which do not split over cp={W} ranks: the all-to-all hands every cp rank "
            f"h/cp whole heads. Choose n_head divisible by tp x cp, a cp that divides {h}, "
            "or ring attention (parallel/context/ring_attention.py), which splits no heads.")
    if len(positions) != W:
        raise ValueError(f"{where} positions has {len(positions)} entries; it needs one "
                         f"array of global positions per rank of the cp group ({W}).")
    if len(positions[rank]) != T_r:
        raise ValueError(f"{where} q holds {T_r} positions but positions[{rank}] lists "
                         f"{len(positions[rank])}; pass the same layout the tokens were cut by.")
    every = np.concatenate([np.asarray(p, np.int64).ravel() for p in positions])
    if not np.array_equal(np.sort(every), np.arange(T)):
        raise ValueError(f"{where} the ranks' positions must cover 0..T-1 = {T - 1} exactly "
                         f"once, but together they list {every.size} positions "
                         f"(min {every.min(initial=0)}, max {every.max(initial=0)}). Build "
                         "them with contiguous or zig-zag slices of range(T).")


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group, *, positions: list[np.ndarray],
                      T: int, drop: Dropout, key: DropoutKey | None, first_head: int,
                      n_head: int, causal: bool = True) -> Tensor:
    """softmax(q k^T / sqrt(D) + M) v for this rank's positions, over the whole sequence.

    q, k, v (B, h, T_r, D): all h heads of this rank (global heads first_head ..
    first_head + h - 1 of n_head) at the global positions positions[group.rank];
    positions: one int array per rank of `group` (the cp group), covering 0..T-1 once.
    Returns y (B, h, T_r, D), equal to the single process's attention rows at those
    positions (mask and dropout by global position and head).
    Algorithm: steps 1-3 of the module docstring (all-to-all, attention_core on h/W heads
    over all T, all-to-all back). Cost per rank, in numbers: forward 3 B h T_r D (W-1)/W
    + B (h/W) (T - T_r) D; backward B h T_r D (W-1)/W + 3 B (h/W) (T - T_r) D.
    Reference: Jacobs et al. 2023, arXiv:2309.14509, Sec. 3.1 and Fig. 2.
    """
    _check(q, k, v, group, positions, T, n_head)
    rank, W = group.rank, group.size
    lengths = [len(p) for p in positions]
    pos = np.concatenate([np.asarray(p, np.int64).ravel() for p in positions])   # (T,)
    qkv = SeqToHeads.apply(q, k, v, group=group, lengths=lengths)     # (3, B, h/W, T, D)
    q_h, k_h, v_h = (pl.tag(qkv[i], "cp", pl.Shard(1)) for i in range(3))  # heads over cp
    h_cp = q.shape[1] // W
    y = attention_core(q_h, k_h, v_h, pos, pos, drop, key,
                       first_head + rank * h_cp, n_head, T, causal)   # (B, h/W, T, D)
    y = HeadsToSeq.apply(y, group=group, lengths=lengths)            # (B, h, T_r, D)
    # y lies over cp exactly as q did (the same positions on the same rank)
    return pl.tag(y, "cp", pl.placement_tag(q, "cp") or pl.Shard(2))
