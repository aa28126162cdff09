"""Deterministic mode under tensor parallelism: the GPT's matmuls over fixed tiles, and the
gradient norm over whole parameters.

A tensor-parallel rank holds columns (qkv, fc, the LM head) or rows (the two projections)
of each weight, so its matmuls have other shapes than the single process's and its sums
over a split dimension (Megatron's f and g) are all-reduces of partial sums: both change
the last bits (canonical_matmul.py). `tile_model` gives every such matmul, in the single
process and in every layout alike, tiles fixed by the model alone, each tp shard being a
set of whole tiles:
    attn.qkv    k = C,      n = D         a rank's heads are whole column tiles of q, k, v
    attn.proj   k = D,      n = C         ... and whole row tiles of the projection
    mlp.fc      k = C,      n = F / H     (F / H divides F / tp, since tp divides H)
    mlp.proj    k = F / H,  n = C
    LM head     k = C,      n = 1         V_tp = ceil(V / tp) shares no larger unit
(D = C / H; F the MLP's hidden width). The softmax of the loss sums over V in the same
tree (vocab.py, fused.CrossEntropy(tree=True)). Everything else a tp rank computes is whole
(LayerNorms, attention per head, GELU per feature, the replicated parameters' gradients),
or exact (the vocabulary-parallel embedding adds one row and zeros).

The gradient norm adds each parameter's sum of squares over the WHOLE gradient, as the
single process does: a sharded gradient is all-gathered over tp and unsharded first
(`square_sums`); dot over a shard would sum in another grouping.

Sums over tokens: the gradients of every LayerNorm's gain and shift and of every tiled
Linear's bias are added in the aligned tree over the micro-batch's global token index
b T + t (canonical_matmul.Tokens), in the single process and in every layout alike.
Sequence parallelism (parallel/sequence.py) cuts those sums: a SequenceParallelLayerNorm
and a row-parallel bias see this rank's positions only, so their Tokens exchange the nodes
over tp and every rank combines the whole sum, in place of Megatron's f. The edges of the
tp regions become exact data movement (an all-gather of x before a column-parallel tiled
matmul, my positions of a row-parallel one's whole y), and the position embedding keeps
f (one nonzero summand per row).

One rank's view: tile_model(model) once after the model is built; the steps as
parallel/deterministic.py describes, with square_sums in the norm.
Communication: each tiled sum over tp is an all_gather of at most ~2 log2(tiles) partial
outputs per rank in place of one all-reduce; under SP, each LayerNorm and row-parallel
bias all-gathers its token nodes (at most ~2 log2(B T) vectors of C) per backward; the
norm all-gathers every sharded gradient over tp once a step.
Read next: canonical_matmul.py.
"""

from __future__ import annotations

import functools

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist import canonical_matmul
from minidist.canonical_matmul import Tiles, Tokens
from minidist.optim.clip import wide
from minidist.parallel import placement as pl
from minidist.parallel.deterministic_context import context_tokens
from minidist.parallel.sequence import SequenceParallelLayerNorm
from minidist.parallel.tensor import RowParallelLinear


def exchange_over(tp):
    """The all_gather the tiles' and tokens' exchanges use over tp: the ring algorithm
    (measured, 1 MB on 2 ranks of this machine: 0.69 ms a call, as fast as the direct
    all-reduce of the plain mode, where the default halving-doubling takes 1.5 ms)."""
    return functools.partial(C.all_gather, group=tp.group, algo="ring")


def _tiles(p, k: int, n: int, transposed: bool = False, valid: int | None = None, tp=None):
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


def _tokens(module, tp=None, whole: Tokens = Tokens(), exchange=None) -> Tokens:
    """The Tokens of a LayerNorm's or tiled Linear's gradient sums on this tp rank: under
    SP, those on this rank's positions (the LayerNorms, the row-parallel biases) exchange
    (over tp, or `exchange`); the others see `whole`: every position, or under cp those of
    this cp rank."""
    on_shard = isinstance(module, (SequenceParallelLayerNorm, RowParallelLinear))
    if tp is None or not tp.sequence_parallel or not on_shard:
        return whole
    return Tokens(tp.positions, exchange or exchange_over(tp))


def _then(first, second):
    """An all_gather over two groups, one after the other (tp, then cp): every rank's
    array, one row each, for canonical.gather_nodes."""
    def both(x):
        rows = second(first(x))                                    # (W2, W1, ...)
        return rows.reshape((-1,) + x.shape)
    return both


def tile_model(model, token_tiles: int | None = None) -> None:
    """canonical_matmul.tile_model with this rank's tp shards as whole tiles and its SP
    positions' Tokens (module docstring); the single process's when not tensor-parallel.
    token_tiles: runs of T / token_tiles positions for the matmuls' rows, the attention's
    queries and the sums over positions (context parallelism needs them: a cp rank's
    sums over its positions are exchanged over cp, parallel/deterministic_context.py)."""
    tp = getattr(model.layout, "tp", None)
    context = getattr(model.layout, "context", None) if tp is None else tp.context
    if context is not None and context.group.size > 1:
        mine, rows = context_tokens(context, token_tiles)     # this cp rank's positions
        exchange = None if tp is None else _then(exchange_over(tp), rows.exchange)
        tokens_of = functools.partial(_tokens, tp=tp, whole=mine, exchange=exchange)
    else:
        exchange = None if tp is None else exchange_over(tp)
        tokens_of = functools.partial(_tokens, tp=tp)
        rows = None if token_tiles is None else Tokens(per_sequence=token_tiles)
    canonical_matmul.tile_model(model, functools.partial(_tiles, tp=tp), tokens_of, rows)
    if rows is not None and tp is not None and tp.sequence_parallel \
            and getattr(model, "wpe", None) is not None:   # its SP positions, exchanged
        model.wpe.tokens = Tokens(tp.positions, exchange, token_tiles)


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
