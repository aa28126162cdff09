"""Vocabulary parallelism: the embedding table, the LM head and the loss, split by vocabulary.

The two largest matrices of a small GPT are the token embedding wte (V, C) and the LM
head (C, V), tied to it. Megatron splits both along V: tp rank r holds vocabulary rows
[r V_tp, (r+1) V_tp) of the PADDED vocabulary V_pad = W V_tp, V_tp = ceil(V / W). The
last rank's tail rows (V_pad - V of them) are padding: zeros that no token id selects and
whose logits the loss masks, so the padded model computes exactly the unpadded one
(Megatron-LM #1754: TP=2 diverged from one GPU when this was not exact).

Embedding, one rank's view: ids (B, T) -> for ids in my range, my rows; elsewhere 0.
    y[B, T, C] {U_tp} = mask * wte_shard[ids - r V_tp]  -> g (all-reduce) -> y[B, T, C]
    (under sequence parallelism a reduce-scatter instead -> y[B, T_tp, C]).
LM head: logits[B, T, V_tp] = x[B, T, C] @ wte_shard^T, after f (column-parallel).

Cross-entropy without ever gathering the logits (Megatron's vocab_parallel_cross_entropy),
for each token n with target t_n, local logits z_n (V_tp,), padded columns at -inf:
    m_n  = all_reduce(max_v z_nv, op=max)                      (N numbers)
    s_n  = all_reduce(sum_v exp(z_nv - m_n))                   (N numbers)
    zt_n = all_reduce(z_{n, t_n} if t_n is mine else 0)        (N numbers)
    loss = sum_{n counted} log s_n + m_n - zt_n
    backward, local: dz_nv = g (exp(z_nv - m_n) / s_n - [v = t_n]) for counted n
Each rank keeps (N, V_tp) probabilities, never (N, V). The loss REFUSES logits that are
not this rank's vocabulary shard: gathered logits (Megatron-LM #7452) would make every
rank add the whole vocabulary's exp-sum W times and be off by log W.

Communication: the embedding's g, B T C; the loss, 3 all-reduces of N = B T numbers
(forward only; its backward is local). Group: tp.
References: Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3 (the output embedding, "fuse
    the output GEMM with the cross entropy loss"); Megatron-LM's
    tensor_parallel/cross_entropy.py and VocabParallelEmbedding.
Read next: parallel/sharding.py.
"""

from __future__ import annotations

import functools
import math

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.nn.layers import Embedding
from minidist.nn.module import Parameter
from minidist.parallel import placement as pl


def vocab_range(V: int, tp) -> tuple[int, int]:
    """[lo, hi) of the PADDED vocabulary that this tp rank holds (hi - lo = V_tp)."""
    per = pl.piece_length(V, tp.group.size)
    return tp.group.rank * per, (tp.group.rank + 1) * per


def shard_parameter(full: Parameter, placement: pl.Placement, tp) -> Parameter:
    """A new Parameter holding this tp rank's piece of `full` (values sliced, padded with 0).

    It keeps full's initialiser and records full_shape, placements={"tp": placement} and
    `take` (so seed.init_parameters draws the full tensor and keeps this piece).
    """
    W, r = tp.group.size, tp.group.rank
    values = pl.shard(backend.to_numpy(full.data), placement, W, r)
    p = Parameter(values.shape, full.init, str(full.dtype), full_shape=tuple(full.shape),
                  take=functools.partial(pl.shard, placement=placement, W=W, rank=r))
    p.data[...] = backend.xp.asarray(values)
    p.placements = {"tp": placement}
    return p


class VocabParallelEmbedding(Embedding):
    """wte split by vocabulary rows over tp; forward returns the REDUCED lookup."""

    def __init__(self, full: Embedding, tp) -> None:
        self.vocab_size, self.tp = full.weight.shape[0], tp
        self.weight = shard_parameter(full.weight, pl.Shard(0), tp)     # (V_tp, C)

    def forward(self, ids) -> Tensor:
        xp = backend.xp
        lo, hi = vocab_range(self.vocab_size, self.tp)
        ids = xp.asarray(ids)
        mine = (ids >= lo) & (ids < hi)                                  # (B, T)
        local = xp.where(mine, ids - lo, 0)
        rows = self.lookup(local) * mine[..., None].astype(self.weight.dtype)
        return self.tp.exit(pl.tag(rows, "tp", pl.Partial()))           # all-reduce or RS

    def lookup(self, local) -> Tensor:
        """Rows of my shard for local ids (B, T) in [0, V_tp) -> (B, T, C)."""
        return F.embedding(self.weight, local)


class VocabParallelCrossEntropy(Function):
    """sum over counted tokens of CE, from vocabulary-sharded logits z (N, V_tp)."""

    @staticmethod
    def forward(ctx, z, *, t, tp, lo: int, vocab_size: int):
        exp_sums = functools.partial(all_reduced_row_sums, tp=tp)
        return vocab_parallel_losses(ctx, z, t, tp, lo, vocab_size, exp_sums).sum()

    @staticmethod
    def backward(ctx, g):
        p, t_local, mine, counted = ctx.saved_tensors
        dz = p * (counted * g)[:, None]
        rows = backend.xp.flatnonzero(mine)
        dz[rows, t_local[rows]] -= g
        return (dz,)


def all_reduced_row_sums(e, tp):
    """s_n = sum over the whole vocabulary of e (N, V_tp): my rows' sums, all-reduced."""
    return C.all_reduce(e.sum(axis=1), op="sum", group=tp.group, algo=tp.algo)


def vocab_parallel_losses(ctx, z, t, tp, lo: int, vocab_size: int, exp_sums):
    """The losses (N,) of the module docstring (0 where not counted), s_n added by
    exp_sums(e) for e (N, V_tp) -> (N,); saves the softmax and targets on ctx for
    VocabParallelCrossEntropy.backward."""
    xp, g = backend.xp, tp.group
    N, Vl = z.shape
    z = xp.where(lo + xp.arange(Vl) >= vocab_size, -math.inf, z)        # mask the padding
    m = C.all_reduce(z.max(axis=1), op="max", group=g, algo=tp.algo)              # (N,)
    e = xp.exp(z - m[:, None])                                           # (N, V_tp)
    s = exp_sums(e)                                                      # (N,)
    counted = t != -100
    mine = counted & (t >= lo) & (t < lo + Vl)
    t_local = xp.where(mine, t - lo, 0)
    zt = C.all_reduce(xp.where(mine, z[xp.arange(N), t_local], 0.0), op="sum", group=g,
                      algo=tp.algo)                                      # (N,)
    losses = (xp.log(s) + m - zt) * counted
    e /= s[:, None]                                                      # softmax (N, V_tp)
    ctx.save_for_backward(e, t_local, mine, counted)
    return losses


def vocab_parallel_cross_entropy(logits: Tensor, targets, tp, vocab_size: int) -> Tensor:
    """sum over counted (b, t) of CE(logits, targets) for logits[B, T, V_tp] (this rank's
    vocabulary shard); targets (B, T) with -100 = ignored. Refuses any other logits."""
    z, t, lo = vocab_shard(logits, targets, tp, vocab_size)
    return VocabParallelCrossEntropy.apply(F.fp32_input(z), t=t, tp=tp, lo=lo,
                                           vocab_size=vocab_size)


def vocab_shard(logits: Tensor, targets, tp, vocab_size: int) -> tuple:
    """(z (B T, V_tp), t (B T,), lo) from logits[B, T, V_tp] and targets (B, T); a
    ValueError (PlacementError in check mode) unless the logits are this rank's shard."""
    lo, hi = vocab_range(vocab_size, tp)
    if logits.shape[-1] != hi - lo:
        raise ValueError(
            f"{tp.prefix} vocab_parallel_cross_entropy: logits have {logits.shape[-1]} "
            f"vocabulary columns, but this tp rank's shard of V={vocab_size} over tp="
            f"{tp.group.size} has {hi - lo}. Pass the LM head's sharded output; gathered "
            f"logits would count every class {tp.group.size} times (loss off by "
            f"log {tp.group.size}).")
    pl.expect(logits, "tp", pl.Shard(2), name="logits", where="vocab_parallel_cross_entropy")
    t = backend.xp.asarray(targets).reshape(-1)
    return logits.reshape(-1, hi - lo), t, lo
