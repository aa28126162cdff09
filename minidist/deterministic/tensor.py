"""Deterministic mode under tensor parallelism: the GPT's matmuls over fixed tiles, and the
gradient norm over whole parameters.

A tensor-parallel rank holds columns (qkv, fc, the LM head) or rows (the two projections)
of each weight, so its matmuls have other shapes than the single process's and its sums
over a split dimension (Megatron's f and g) are all-reduces of partial sums: both change
the last bits (matmul.py). `determinize_layout` (layout.py) gives every such matmul, in the
single process and in every layout alike, tiles fixed by the model alone, each tp shard being a
set of whole tiles:
    attn.qkv    k = C,      n = D         a rank's heads are whole column tiles of q, k, v
    attn.proj   k = D,      n = C         ... and whole row tiles of the projection
    mlp.fc      k = C,      n = F / H     (F / H divides F / tp, since tp divides H)
    mlp.proj    k = F / H,  n = C
    LM head     k = C,      n = 1         V_tp = ceil(V / tp) shares no larger unit
(D = C / H; F the MLP's hidden width). The softmax of the loss sums over V in the same
tree (TreeVocabParallelCrossEntropy here, layers.TreeCrossEntropy in the single process).
Everything else a tp rank computes is whole (LayerNorms, attention per head, GELU per
feature, the replicated parameters' gradients), or exact (the vocabulary-parallel
embedding adds one row and zeros).

The gradient norm adds each parameter's sum of squares over the WHOLE gradient, as the
single process does: a sharded gradient is all-gathered over tp and unsharded first
(`square_sums`); dot over a shard would sum in another grouping.

Sums over tokens: the gradients of every LayerNorm's gain and shift and of every tiled
Linear's bias are added in the aligned tree over the micro-batch's global token index
b T + t (matmul.Tokens), in the single process and in every layout alike.
Sequence parallelism (parallel/tensor/sequence.py) cuts those sums: a SequenceParallelLayerNorm
and a row-parallel bias see this rank's positions only, so their Tokens exchange the nodes
over tp and every rank combines the whole sum, in place of Megatron's f. The edges of the
tp regions become exact data movement (GatherWholeSequence: an all-gather of x before a
column-parallel tiled matmul, whose dx is whole on every rank; ScatterWholeSequence: my
positions of a row-parallel one's whole y), and the position embedding keeps f (one
nonzero summand per row; with token tiles, its runs' tree, exchanged over tp).

The twins (layers.py's `twin`: the same parameters, the tiled forward):
    ColumnParallelLinear       -> TiledColumnParallelLinear   x whole (SP: all-gathered),
                                                              tiled matmul, no f
    RowParallelLinear          -> TiledRowParallelLinear      tiled matmul exchanges the
                                                              sum itself: no g
    SequenceParallelLayerNorm  -> TreeSequenceParallelLayerNorm   the tree, no f
    VocabParallelEmbedding, SequenceParallelPositions -> their Tree twins (token tiles)
    TensorParallelLayout       -> TiledTensorParallelLayout   the head over vocabulary
                                                              columns, the loss in trees

One rank's view: determinize_layout(model) once after the model is built; the steps as
deterministic/step.py describes, with square_sums in the norm.
Communication: each tiled sum over tp is an all_gather of at most ~2 log2(tiles) partial
outputs per rank in place of one all-reduce; under SP, each LayerNorm and row-parallel
bias all-gathers its token nodes (at most ~2 log2(B T) vectors of C) per backward; the
norm all-gathers every sharded gradient over tp once a step.
Read next: deterministic/context.py.
"""

from __future__ import annotations

import functools

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.deterministic.layers import tree_embedding, tree_layer_norm
from minidist.deterministic.matmul import Tiles, Tokens, add_bias, tiled_matmul, \
    tree_over_tiles
from minidist.optim.clip import wide
from minidist.parallel import placement as pl
from minidist.parallel.tensor.sequence import (SequenceParallelLayerNorm,
                                               SequenceParallelPositions, all_gather_sequence)
from minidist.parallel.tensor.tensor_parallel import ColumnParallelLinear, RowParallelLinear, \
    TensorParallelLayout
from minidist.parallel.tensor.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, \
    vocab_parallel_losses, vocab_shard


# --- the tiles and tokens of this tp rank ------------------------------------------------

def exchange_over(tp):
    """The all_gather the tiles' and tokens' exchanges use over tp: the ring algorithm
    (measured, 1 MB on 2 ranks of this machine: 0.69 ms a call, as fast as the direct
    all-reduce of the plain mode, where the default halving-doubling takes 1.5 ms)."""
    return functools.partial(C.all_gather, group=tp.group, algo="ring")


def tiles_on_rank(p, k: int, n: int, transposed: bool = False, valid: int | None = None,
                  tp=None) -> Tiles:
    """The Tiles of weight p (K, N), or of p^T when transposed, on this tp rank."""
    full = tuple(getattr(p, "full_shape", None) or p.shape)
    full = full[::-1] if transposed else full
    place = pl.placement_of(p, "tp")
    if tp is None or not isinstance(place, pl.Shard):
        return Tiles.whole(*full, k, n)
    dim = place.dim % 2
    dim = 1 - dim if transposed else dim                         # the dimension of W split
    W, r = tp.group.size, tp.group.rank
    held = pl.shard_indices(full[dim], W, r, place.blocks)       # padded indices, in order
    size = (k, n)[dim]
    index = tuple(int(i) for i in held[::size] // size)
    tiled = np.repeat(np.array(index) * size, size) + np.tile(np.arange(size), len(index))
    if full[0] % k or full[1] % n or not np.array_equal(held, tiled):
        raise ValueError(f"deterministic tp: a {full} weight's shard over tp={W} is not "
                         f"whole {k} x {n} tiles; use n_head divisible by tp.")
    nk, nn = full[0] // k, full[1] // n
    exchange = exchange_over(tp)
    if dim == 0:
        return Tiles(k, n, nk, nn, index, tuple(range(nn)), exchange)
    return Tiles(k, n, nk, nn, tuple(range(nk)), index, exchange, valid)


def tokens_on_rank(module, tp=None, whole: Tokens = Tokens(), exchange=None) -> Tokens:
    """The Tokens of a LayerNorm's or tiled Linear's gradient sums on this tp rank: under
    SP, those on this rank's positions (the LayerNorms, the row-parallel biases) exchange
    (over tp, or `exchange`); the others see `whole`: every position, or under cp those of
    this cp rank."""
    on_shard = isinstance(module, (SequenceParallelLayerNorm, RowParallelLinear))
    if tp is None or not tp.sequence_parallel or not on_shard:
        return whole
    return Tokens(tp.positions, exchange or exchange_over(tp))


def then(first, second):
    """An all_gather over two groups, one after the other (tp, then cp): every rank's
    array, one row each, for tree_sum.gather_nodes."""
    def both(x):
        rows = second(first(x))                                    # (W2, W1, ...)
        return rows.reshape((-1,) + x.shape)
    return both


# --- the edges of the tp regions under SP: data movement only ----------------------------

def my_positions(x: np.ndarray, tp) -> np.ndarray:
    """This rank's T_tp positions of a whole x[B, T, ...] (a copy): those all_gather_sequence
    puts at r T_tp."""
    Tl = x.shape[1] // tp.group.size
    return x[:, tp.group.rank * Tl:(tp.group.rank + 1) * Tl].copy()


class GatherWholeSequence(Function):
    """Forward: all-gather x along T. Backward: this rank's positions of dy, which is whole
    on every rank (a tiled matmul's exchanged dx)."""

    @staticmethod
    def forward(ctx, x, *, tp):
        ctx.tp = tp
        return all_gather_sequence(x, tp)

    @staticmethod
    def backward(ctx, dy):
        return (my_positions(dy, ctx.tp),)


class ScatterWholeSequence(Function):
    """Forward: this rank's positions of a whole y (a tiled row-parallel matmul's, the same
    on every rank). Backward: all-gather dy along T."""

    @staticmethod
    def forward(ctx, y, *, tp):
        ctx.tp = tp
        return my_positions(y, tp)

    @staticmethod
    def backward(ctx, dy):
        return (all_gather_sequence(dy, ctx.tp),)


def tiled_column_matmul(x: Tensor, w: Tensor, tp, tiles: Tiles, rows: Tokens | None) -> Tensor:
    """x @ w over this rank's column tiles: x whole (under SP all-gathered first), no f (the
    tiled backward exchanges the partial dx itself) -> (B, T, F_tp) Shard(2)."""
    if tp.sequence_parallel:
        pl.expect(x, "tp", pl.Shard(1), name="x", where="all-gather into a tiled matmul (SP)")
        x = pl.tag(GatherWholeSequence.apply(x, tp=tp), "tp", pl.Replicate())
    pl.expect(x, "tp", pl.Replicate(), name="x", where="a tiled column-parallel matmul")
    return pl.tag(tiled_matmul(x, w, tiles, rows), "tp", pl.Shard(2))


# --- the twins ---------------------------------------------------------------------------

class TiledColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear over the tiles of my columns, its bias gradient in the tree."""

    def forward(self, x: Tensor) -> Tensor:
        y = tiled_column_matmul(x, self.weight, self.tp, self.tiles, self.rows)
        y = y if self.bias is None else add_bias(y, self.bias, self.tokens)
        return pl.tag(y, "tp", pl.Shard(2))


class TiledRowParallelLinear(RowParallelLinear):
    """RowParallelLinear over the tiles of my rows: the tiled matmul exchanges the sum over
    the rows itself (no g); under SP, my positions of the whole y."""

    def forward(self, x: Tensor) -> Tensor:
        pl.expect(x, "tp", pl.Shard(2), name="x", where="RowParallelLinear")
        y = pl.tag(tiled_matmul(x, self.weight, self.tiles, self.rows), "tp", pl.Replicate())
        if self.tp.sequence_parallel:
            pl.expect(y, "tp", pl.Replicate(), name="y",
                      where="my positions of a tiled matmul (SP)")
            y = pl.tag(ScatterWholeSequence.apply(y, tp=self.tp), "tp", pl.Shard(1))
        return y if self.bias is None else add_bias(y, self.bias, self.tokens)


class TreeSequenceParallelLayerNorm(SequenceParallelLayerNorm):
    """SequenceParallelLayerNorm without f: the sums over every token, exchanged over tp,
    added in the tree and whole on every rank."""

    def forward(self, x: Tensor) -> Tensor:
        pl.expect(x, "tp", pl.Shard(1), name="x", where="SequenceParallelLayerNorm")
        return tree_layer_norm(x, self.weight, self.bias, self.eps, self.tokens)


class TreeSequenceParallelPositions(SequenceParallelPositions):
    """The position embedding on my SP positions, its runs' gradients summed in the tree
    (exchanged over tp) instead of f."""

    def forward(self, ids) -> Tensor:
        return tree_embedding(self.weight, ids, self.tokens)


class TreeVocabParallelEmbedding(VocabParallelEmbedding):
    """VocabParallelEmbedding whose lookup's gradient is summed over runs in the tree."""

    def lookup(self, local) -> Tensor:
        return tree_embedding(self.weight, local, self.tokens)


class TreeVocabParallelCrossEntropy(VocabParallelCrossEntropy):
    """VocabParallelCrossEntropy with s_n added over V in the single process's tree (the
    other ranks' nodes through `exchange`) and the sum over tokens by `tokens` (None:
    NumPy's sum over this rank's tokens)."""

    @staticmethod
    def forward(ctx, z, *, t, tp, lo: int, vocab_size: int, exchange, tokens, shape: tuple):
        index = tuple(range(lo, lo + z.shape[1]))
        exp_sums = functools.partial(_tree_over_vocabulary, index=index, count=vocab_size,
                                     exchange=exchange)
        losses = vocab_parallel_losses(ctx, z, t, tp, lo, vocab_size, exp_sums)
        return losses.sum() if tokens is None else tokens.sum(losses.reshape(shape))


def _tree_over_vocabulary(e, index: tuple, count: int, exchange):
    """s_n: the rows of e (N, V_tp) summed over the whole vocabulary in the aligned tree."""
    return tree_over_tiles(e.T, index, count, exchange, count)


class TiledTensorParallelLayout(TensorParallelLayout):
    """TensorParallelLayout with the LM head over `head_tiles` (my vocabulary columns) and
    the loss in trees (TreeVocabParallelCrossEntropy)."""

    def logits(self, x: Tensor, w: Tensor) -> Tensor:
        self.check_head()
        return tiled_column_matmul(x, w, self.tp, self.head_tiles, self.rows)

    def loss_sum(self, logits: Tensor, targets) -> Tensor:
        z, t, lo = vocab_shard(logits, targets, self.tp, self.vocab_size)
        shape = tuple(backend.xp.asarray(targets).shape)
        loss = TreeVocabParallelCrossEntropy.apply(
            F.fp32_input(z), t=t, tp=self.tp, lo=lo, vocab_size=self.vocab_size,
            exchange=self.head_tiles.exchange, tokens=self.loss_tokens, shape=shape)
        return pl.tag(loss, "tp", pl.Replicate())


# --- the gradient norm -------------------------------------------------------------------

def square_sums(named: list, tp_group) -> list[float]:

    """The sum of squares of the whole gradient of each (name, gradient, parameter) from this
    rank's gradient (its tp shard or all of it), added as optim.global_grad_norm adds: one
    dot over the flat, unsharded array. COLLECTIVE over tp_group when any is sharded: the
    shards travel in one all_gather (every tp rank's shards have the same sizes)."""
    sharded = [i for i, (_, g, p) in enumerate(named) if tp_group is not None
               and isinstance(pl.placement_of(p, "tp"), pl.Shard)]
    whole = [backend.to_numpy(g) for _, g, _ in named]
    if sharded:
        flat = np.concatenate([whole[i].reshape(-1) for i in sharded])
        table, at = C.all_gather(flat, group=tp_group), 0              # (W, total)
        for i in sharded:
            p, n = named[i][2], whole[i].size
            place, full = pl.placement_of(p, "tp"), getattr(p, "full_shape", None) or p.shape
            pieces = [row[at:at + n].reshape(whole[i].shape) for row in table]
            whole[i] = pl.unshard(pieces, place, full[place.dim % len(full)])
            at += n
    out = []
    for g in whole:
        flat = wide(backend.xp.asarray(g).reshape(-1))
        out.append(float(backend.xp.dot(flat, flat)))
    return out
