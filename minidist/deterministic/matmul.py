"""Tiled matmuls: y = x @ W computed over fixed tiles of W, so that a tensor-parallel shard
of W is whole tiles and computes exactly the single process's numbers.

A BLAS matmul's bits depend on the shape of the call, not only on the numbers in it. On the
OpenBLAS that NumPy ships, (x @ W)[:, j] and x @ W[:, j-range] differ in the last bit for
about 40 % of shapes (measured over M, K, N up to 1000, float32 and float64): the kernel
that computes an element, and how it splits the sum over K, depend on N and K and on where
the column falls. A tensor-parallel rank multiplies by its columns or rows of W, so its
matmuls have other shapes than the single process's, and the deterministic mode (this
package) cannot get the same bits from them.

The fix: cut W (K, N) into tiles of k x n elements, fixed by the model (not by the layout),
with every tensor-parallel shard a set of whole tiles (a column-parallel W keeps some
column tiles, a row-parallel W some row tiles). Every BLAS call then multiplies one tile,
the same shape in every layout, and a batched matmul of contiguous tiles gives each tile
the bits of a separate call (also measured). The sums over tiles use the aligned tree of
tree_sum.py, over the global tile index:

    y[:, J]      = tree over I of  x[:, I] @ W[I, J]          (I: K-tiles, J: N-tiles)
    dx[:, I]     = tree over J of  g[:, J] @ W[I, J]^T
    dW[I, J]     = x[:, I]^T @ g[:, J]                         (one call: the sum over M
                                                               tokens; see `rows` below)
One rank's view (tensor parallelism): a column-parallel W holds N-tiles J_r: y[:, J_r]
needs nothing from the others, dx is a sum over J that every rank holds a part of, so the
ranks exchange the aligned nodes of their parts (tree_sum.gather_nodes) and each combines
the same tree: what Megatron's f all-reduces. A row-parallel W holds K-tiles I_r and
exchanges the nodes of y the same way (Megatron's g). The single process computes the same
nodes itself. Padding tiles (a vocabulary padded to tp V_tp, parallel/tensor/vocab.py) are left
out of the sums over N.

Shapes: x (..., K_r), W (K_r, N_r) this rank's tiles; y (..., N_r). The tiles used by the
GPT (`gpt_tiles`, given by deterministic/layers.py): head_dim columns for qkv (so a rank's
heads are whole tiles), head_dim rows for the attention projection, F/H for the MLP, and one
vocabulary column for the LM head (whose shards V_tp = ceil(V / tp) share no other unit).
Cost: the same multiply-adds as x @ W in smaller calls, plus (K/k - 1) additions of an
output per N-tile and a copy of each operand into tiles; the exchange replaces an
all-reduce of the output by an all_gather of at most ~2 log2(K/k) nodes.
Sums over tokens: a LayerNorm's gain and shift and a Linear's bias get, as gradient, a
sum over the tokens of the micro-batch, which sequence parallelism cuts (a rank holds some
positions of every row). `Tokens` adds them in the aligned tree over the global token
index b T + t (row b, global position t; one token per grain), and exchanges the nodes
when other ranks hold the other positions; `determinize` gives every LayerNorm and every
tiled Linear one, in the single process (no exchange) and in every layout alike.
Rows (--token-tiles N, what context parallelism needs: a cp rank holds some positions of
every sequence, so the sum over M tokens of dW is cut too, and a BLAS result also depends
on the number of rows): with `rows`, a Tokens of N runs per sequence, x is cut into runs
of T / N positions, every call multiplies one run of every row of the micro-batch (a leaf:
B T / N rows, the same in every layout, since a layout cuts positions, never the rows of a
grain), and dW is summed over the N leaves in the aligned tree, exchanged over cp
(deterministic/context.py). A leaf per (row, run) would give the same guarantee, but a
cp rank would then hold B separate nodes of a whole dW per run; with the runs in fold's
order (below) it holds one. Measured on the bench model (cp=2, grain 8, 4 runs, `python -m
minidist bench determinism --layouts cp=2 --grains max --token-tiles 4`): a leaf per (row,
run) cost 3.2x the plain mode's step, a leaf per run 1.56x, in fold's order 1.41-1.45x.
Mixed precision (`Operands`): under autocast the tiles' operands are rounded to the format
before the BLAS calls (fp8: quantised with one power-of-two scale per k x n tile of W and
per K-tile of a row of x or of the output gradient), the products and the trees run in
fp32, and the result is rounded once: elementwise work on whole tiles, the same in every
layout.
Reference: the problem is the one of Demmel & Nguyen 2013 ("Fast reproducible
    floating-point summation"); fixed-split reductions are also how cuBLAS/cuDNN's
    deterministic modes are described (a fixed order per output element).
Read next: deterministic/layers.py (the layers that use them), then deterministic/tensor.py
(tp shards as whole tiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from minidist import backend
from minidist.autograd import tensor as core
from minidist.autograd.tensor import Context, Function
from minidist.memory import fp8
from minidist.memory.precision import round_to
from minidist.deterministic.tree_sum import combine, gather_nodes, stacked_nodes


@dataclass(frozen=True)
class Tiles:
    """The tiles of one weight W: k x n elements each, nk x nn of them in the full W. This
    rank holds K-tiles k_index and N-tiles n_index (global indices, increasing); `exchange`
    all-gathers an array over the other tiles' owners (None: the single process, or
    nothing split), each of whom holds as many tiles of the split dimension as this rank
    (equal shards). N-tiles at or past n_valid are padding, left out of sums over N."""

    k: int
    n: int
    nk: int
    nn: int
    k_index: tuple[int, ...]
    n_index: tuple[int, ...]
    exchange: Callable | None = None
    n_valid: int | None = None

    @classmethod
    def whole(cls, K: int, N: int, k: int, n: int) -> "Tiles":
        """Every tile of a K x N weight, on this rank."""
        if K % k or N % n:
            raise ValueError(f"Tiles: a {K} x {N} weight is not cut into whole {k} x {n} "
                             f"tiles.")
        return cls(k, n, K // k, N // n, tuple(range(K // k)), tuple(range(N // n)))


def tree_over_tiles(parts, index: tuple[int, ...], count: int, exchange=None, valid=None):
    """The aligned-tree sum over axis 0 of parts (one entry per tile of global index
    index[j], in any order), those of index >= valid left out; the other tiles' nodes
    through `exchange` (an all_gather over their owners) when this rank does not hold them
    all."""
    if any(a > b for a, b in zip(index, index[1:])):   # my leaves out of index order
        order = np.argsort(index, kind="stable")
        parts, index = parts[order], tuple(index[j] for j in order)
    keep = [j for j, i in enumerate(index) if valid is None or i < valid]
    nodes = stacked_nodes(parts[keep] if len(keep) < len(index) else parts,
                          [index[j] for j in keep])
    if exchange is not None:
        nodes = gather_nodes(nodes, parts.shape[1:], parts.dtype, exchange, len(index))
    return combine(nodes, count if valid is None else valid)


class Operands:
    """How the tiled GEMMs round their operands under mixed precision (memory/precision.py's
    autocast, when it is on): bf16 / fp16 round each element; fp8 quantises with one
    power-of-two scale per BLOCK, a block being what no layout cuts: one K-tile of one row
    of x (or one N-tile of a row of the output gradient), one k x n tile of W. The tile
    replaces the per-tensor scale, whose amax would depend on the rows and columns a rank
    holds (DeepSeek-V3's 1 x 128 / 128 x 128 blockwise scaling, at the tiles' sizes).
    Without autocast every method hands back its input: the plain mode's numbers."""

    def __init__(self) -> None:
        self.autocast = core.autocast

    def take(self, a, role: str, block_axes: int = 1):
        """a as the GEMM reads it, fp32; role "x", "w" (E4M3) or "g" (E5M2 under fp8);
        block_axes: how many trailing axes make one block (1: a row of a tile, 2: a tile)."""
        ac = self.autocast
        if ac is None:
            return a
        if ac.policy.name != "fp8":
            return round_to(a, ac.dtype).astype(np.float32)
        recipe = ac.recipe                       # its formats (E4M3 / E5M2 by role)
        fmt = recipe.format({"x": "activation", "w": "weight", "g": "gradient"}[role]) \
            if recipe is not None else fp8.E5M2 if role == "g" else fp8.E4M3
        blocks = a.reshape(a.shape[:a.ndim - block_axes] + (-1,)).astype(np.float32)
        amax = np.max(np.abs(blocks), axis=-1, keepdims=True) if blocks.size else blocks
        with np.errstate(divide="ignore"):
            exp = np.floor(np.log2(fmt.max / amax))
        scale = np.where(np.isfinite(exp) & (amax > 0), np.exp2(exp), 1.0).astype(np.float32)
        q = np.clip(blocks * scale, -fmt.max, fmt.max).astype(fmt.dtype)
        return (q.astype(np.float32) / scale).reshape(a.shape)

    def give(self, y):
        """A GEMM's fp32 result as the layer hands it on: rounded to the format (autocast)."""
        return y if self.autocast is None else round_to(y, self.autocast.dtype)

    def grad(self, d):
        """A backward GEMM's fp32 result: rounded to the format, kept as fp32 (autocast)."""
        return d if self.autocast is None else \
            round_to(d, self.autocast.dtype).astype(np.float32)


class TiledMatMul(Function):
    """y = x @ W over the tiles of W (module docstring); x (..., K_r), W (K_r, N_r).
    rows (a Tokens with `per_sequence` leaves, the deterministic mode under context
    parallelism): x (B, T_r, K_r) is cut into runs of T / per_sequence positions too, each
    BLAS call multiplies one run of every row (Tokens.split: a result depends on the
    number of rows as well), and dW is summed over the runs in the aligned tree
    (exchanged when other ranks hold other positions); None: all the rows in one call."""

    @staticmethod
    def forward(ctx: Context, x, w, *, tiles: Tiles, rows: "Tokens | None" = None):
        xp, t = backend.xp, tiles
        kl, nl = len(t.k_index), len(t.n_index)
        if w.shape != (kl * t.k, nl * t.n) or x.shape[-1] != kl * t.k:
            raise ValueError(f"TiledMatMul: x {x.shape} @ W {w.shape} does not match {kl} x "
                             f"{nl} tiles of {t.k} x {t.n}.")
        xs = _leaf_rows(x, rows)                                       # (mt, m, K_r)
        mt, m = xs.shape[:2]
        ops = Operands()                                # mixed precision: rounded operands
        xt = ops.take(xp.ascontiguousarray(xs.reshape(mt, m, kl, t.k).transpose(2, 0, 1, 3)),
                      "x")
        wt = ops.take(xp.ascontiguousarray(w.reshape(kl, t.k, nl, t.n).transpose(0, 2, 1, 3)),
                      "w", 2)
        parts = xt[:, None] @ wt[:, :, None]                           # (kl, nl, mt, m, n)
        split = t.exchange if kl < t.nk else None
        y = tree_over_tiles(parts, t.k_index, t.nk, split)             # (nl, mt, m, n)
        ctx.save_for_backward(xt, wt)
        ctx.tiles, ctx.rows, ctx.x_shape, ctx.ops = t, rows, x.shape, ops
        return ops.give(_unleaf_rows(y.transpose(1, 2, 0, 3).reshape(mt, m, nl * t.n),
                                     x.shape, rows))

    @staticmethod
    def backward(ctx: Context, g):
        xp, t, rows = backend.xp, ctx.tiles, ctx.rows
        xt, wt = ctx.saved_tensors                                     # (kl, mt, m, k)
        kl, mt, m, nl = xt.shape[0], xt.shape[1], xt.shape[2], wt.shape[1]
        gs = _leaf_rows(g, rows)                                       # (mt, m, N_r)
        ops = ctx.ops
        gt = ops.take(xp.ascontiguousarray(gs.reshape(mt, m, nl, t.n).transpose(2, 0, 1, 3)),
                      "g")
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wT = xp.ascontiguousarray(wt.swapaxes(-1, -2))             # (kl, nl, n, k)
            parts = (gt[None] @ wT[:, :, None]).swapaxes(0, 1)         # (nl, kl, mt, m, k)
            split = t.exchange if nl < t.nn else None
            d = tree_over_tiles(parts, t.n_index, t.nn, split, t.n_valid)   # (kl, mt, m, k)
            dx = ops.grad(_unleaf_rows(d.transpose(1, 2, 0, 3).reshape(mt, m, kl * t.k),
                                       ctx.x_shape, rows))
        if ctx.needs_input_grad[1]:
            xT = xp.ascontiguousarray(xt.swapaxes(-1, -2))             # (kl, mt, k, m)
            d = xT[:, None] @ gt[None]                                 # (kl, nl, mt, k, n)
            if rows is None:
                d = d[:, :, 0]
            else:                                 # the sum over runs of rows: the tree
                index, count = rows.leaves(ctx.x_shape)
                d = tree_over_tiles(d.transpose(2, 0, 1, 3, 4), index, count, rows.exchange)
            dw = ops.grad(d.transpose(0, 2, 1, 3).reshape(kl * t.k, nl * t.n))
        return dx, dw


def _leaf_rows(x, rows: "Tokens | None"):
    """x (..., K) as (leaves, rows of a leaf, K): all rows in one leaf, or rows' runs."""
    return x.reshape(1, -1, x.shape[-1]) if rows is None else rows.split(x)


def _unleaf_rows(y, shape: tuple, rows: "Tokens | None"):
    """_leaf_rows' inverse for an output y (leaves, rows of a leaf, N) of x's `shape`."""
    if rows is None:
        return y.reshape(shape[:-1] + y.shape[-1:])
    return rows.join(y, shape[0])


def tiled_matmul(x, w, tiles: Tiles, rows: "Tokens | None" = None):
    """x @ w over `tiles` (and runs of `rows`: TiledMatMul), a Tensor."""
    return TiledMatMul.apply(x, w, tiles=tiles, rows=rows)


def fold(j: int, n: int) -> int:
    """The place of run j of n in the tree over runs: 0, n-1, 1, n-2, ... from both ends
    inwards, the order in which the zig-zag layout of context parallelism deals chunks to
    its ranks (rank r: chunks r and 2 cp - 1 - r), so that a cp rank's runs are adjacent
    leaves, one node of the tree (or few) instead of two per chunk pair."""
    return 2 * j if 2 * j < n else 2 * (n - 1 - j) + 1


@dataclass(frozen=True)
class Tokens:
    """The tokens of an activation (B, rows, ...) on this rank, for sums over them: token
    b T + t is row b at global position t. positions(rows) -> (global positions, T) of
    this rank's positions (None: it holds all T = rows of them); exchange all-gathers an
    array over the ranks that hold the other positions (None: there are none).
    per_sequence: N leaves, leaf j the run of positions [j T / N, (j+1) T / N) of every
    row, global index fold(j, N) (None: one token per leaf, index b T + t); this rank's
    positions must be whole runs."""

    positions: Callable | None = None
    exchange: Callable | None = None
    per_sequence: int | None = None
    _known: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def leaves(self, shape: tuple) -> tuple[tuple[int, ...], int]:
        """(global index of each of my leaves, in the order of my positions; number of leaves
        in the B sequences) for an activation of `shape` (B, rows, ...); worked out once
        per (B, rows), since every layer of every step asks again."""
        key = tuple(shape[:2])
        if key not in self._known:
            self._known[key] = self._leaves(*key)
        return self._known[key]

    def _leaves(self, B: int, rows: int) -> tuple[tuple[int, ...], int]:
        pos, T = (np.arange(rows), rows) if self.positions is None else self.positions(rows)
        pos = np.asarray(pos)
        per = T if self.per_sequence is None else self.per_sequence
        if T % per:
            raise ValueError(f"Tokens: T={T} positions do not cut into {per} equal runs; "
                             f"use a token tile count that divides {T}.")
        run = T // per
        if rows % run or np.any(pos.reshape(-1, run) - pos[::run, None]
                                           != np.arange(run)) or np.any(pos[::run] % run):
            raise ValueError(f"Tokens: {rows} positions of T={T} are not whole runs of "
                             f"{run} (T / {per}); use a token tile count that the layout's "
                             f"position shards hold whole.")
        if self.per_sequence is None:                  # one token per leaf: b T + t
            index = (np.arange(B)[:, None] * T + pos[None]).reshape(-1)
            return tuple(int(i) for i in index), B * T
        return tuple(fold(int(j), per) for j in pos[::run] // run), per   # run j: fold(j)

    def split(self, x):
        """x (B, rows, ...) -> (m, L, ...): my m leaves, each its L elements in a row, in
        the order the leaf adds them (row-major: row b's positions, then row b+1's). One
        token per leaf: a view; runs: a copy, run j of row 0, of row 1, ..."""
        B, rows, rest = x.shape[0], x.shape[1], x.shape[2:]
        m = len(self.leaves(x.shape)[0])
        if self.per_sequence is None:
            return x.reshape((m, 1) + rest)
        runs = x.reshape((B, m, rows // m) + rest).swapaxes(0, 1)
        return backend.xp.ascontiguousarray(runs).reshape((m, B * (rows // m)) + rest)

    def join(self, parts, B: int):
        """split's inverse: parts (m, L, ...) -> (B, rows, ...)."""
        m, L, rest = parts.shape[0], parts.shape[1], parts.shape[2:]
        if self.per_sequence is None:
            return parts.reshape((B, m // B) + rest)
        runs = parts.reshape((m, B, L // B) + rest).swapaxes(0, 1)
        return backend.xp.ascontiguousarray(runs).reshape((B, m * (L // B)) + rest)

    def sum(self, values):
        """values (B, rows, ...) -> (...): the aligned-tree sum over all B T tokens (the
        other ranks' positions through exchange), the same bits on every rank; a leaf of
        several positions adds them first (NumPy's sum over the run)."""
        index, count = self.leaves(values.shape)
        parts = self.split(values)
        parts = parts[:, 0] if parts.shape[1] == 1 else parts.sum(axis=1)
        return tree_over_tiles(parts, index, count, self.exchange).copy()


class BiasAdd(Function):
    """y = x + b, x (B, rows, N), b (N,): db = tokens.sum(dy), the sum over tokens in the
    aligned tree (Tokens), dx = dy."""

    @staticmethod
    def forward(ctx: Context, x, b, *, tokens: Tokens):
        ctx.tokens = tokens
        return x + b

    @staticmethod
    def backward(ctx: Context, g):
        return g, (ctx.tokens.sum(g) if ctx.needs_input_grad[1] else None)


def add_bias(x, b, tokens: Tokens):
    """x + b, its bias gradient summed over `tokens` in the aligned tree (BiasAdd)."""
    return BiasAdd.apply(x, b, tokens=tokens)


def gpt_tiles(cfg) -> dict[str, tuple[int, int]]:
    """(k, n) of each tensor-parallel matmul of a GPT, by module name suffix: head_dim
    columns of qkv and rows of the attention projection, F / H of the MLP's."""
    C, H = cfg.n_embd, cfg.n_head
    D, Fh = C // H, cfg.mlp_ratio * C // H
    return {"attn.qkv": (C, D), "attn.proj": (D, C), "mlp.fc": (C, Fh), "mlp.proj": (Fh, C)}
