"""Placements: how a tensor is laid out over the ranks of one mesh axis, and the checks on it.

Every parameter, and in check mode every activation that crosses a parallel boundary,
says how it lies across each mesh axis (the notation of DTensor and of the scaling book):

    Replicate()        every rank of the axis holds the same full values      x[B, T, C]
    Shard(dim)         the axis splits dimension `dim` into W equal pieces,   x[B, T, C_tp]
                       rank r holds piece r (the last piece may end in zero padding)
    Shard(dim, blocks=k)  a FUSED weight: `dim` is k blocks side by side (q | k | v) and
                       each block is split, so rank r holds piece r of every block
    Partial()          every rank holds a summand; the value is the sum over ranks
                                                                              y[B, T, C] {U_tp}

Parameters carry `p.placements = {"tp": Shard(1), ...}` (an axis not named is Replicate),
set when the model is sharded (parallel/tensor/). From that alone, code that is written
once serves every layout: `shard` cuts the full tensor drawn from (seed, name) into this
rank's piece, `unshard` puts W pieces back together and crops the padding, and
`owns_uniquely` says whether this rank's copy counts in a global sum (a Replicate
parameter counts on rank 0 of the axis only, so a gradient norm never counts it twice).

Padding. A dimension of n elements sharded over W ranks in k blocks gives every rank
L = ceil(n / (k W)) elements per block; the padded tail holds zeros. For the vocabulary
(n = V rows of the embedding) Megatron pads the same way (Megatron-LM #1754 is what goes
wrong when the padding is not masked; parallel/tensor/vocab.py masks it).

Check mode (`MINIDIST_CHECK_PLACEMENTS=1`, Plan(check_placements=True), on in the tests):
parallel layers tag the activations they return (`tag`), an autograd Observer passes the
tag on through every operation whose tagged inputs agree (so GELU, LayerNorm, dropout and the
residual add keep it), an operation that mixes two different placements raises (adding a
Partial sum to a Replicate tensor is the classic forgotten all-reduce), and every
collective operator, parallel layer and loss asserts what it expects with `expect`:
    PlacementError: g (reduce from the tp region): input 'x' must be Partial() over tp,
    but it is Replicate(). ...
Outside check mode none of this runs (the Observer is not plugged in).

One rank's view: placements are metadata; nothing here communicates.
References: PyTorch DTensor placements (Replicate / Shard / Partial); Austin et al. 2025,
    "How to scale your model" (the scaling book), sharded-matrix notation.
Read next: parallel/tensor/tensor_parallel.py.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import numpy as np

from minidist.autograd import Tensor
from minidist.autograd import tensor as core
from minidist.autograd.tensor import Observer, observe, unobserve


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the same full values."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Dimension `dim` split over the axis; `blocks` > 1 for fused weights (q | k | v)."""

    dim: int
    blocks: int = 1

    def __repr__(self) -> str:
        return f"Shard({self.dim})" if self.blocks == 1 else \
            f"Shard({self.dim}, blocks={self.blocks})"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the tensor is the sum over the axis (activations only)."""

    def __repr__(self) -> str:
        return "Partial()"


Placement = Replicate | Shard | Partial


class PlacementError(RuntimeError):
    """A tensor reached a layer, collective or loss with a placement it cannot take."""


# --- shards of parameters ---------------------------------------------------------------

def piece_length(n: int, W: int, blocks: int = 1) -> int:
    """L = ceil(n / (blocks W)): elements per block that each of W ranks holds."""
    if n % blocks:
        raise ValueError(f"Shard(blocks={blocks}): a dimension of {n} does not hold "
                         f"{blocks} equal blocks.")
    return math.ceil(n // blocks / W)


def shard_indices(n: int, W: int, rank: int, blocks: int = 1) -> np.ndarray:
    """Indices into the PADDED dimension (blocks W L long) that `rank` holds, in order."""
    L = piece_length(n, W, blocks)
    return np.concatenate([b * W * L + rank * L + np.arange(L) for b in range(blocks)])


def _padded(full: np.ndarray, dim: int, n_padded: int, blocks: int) -> np.ndarray:
    """full with each of its `blocks` blocks along dim padded with zeros to n_padded/blocks."""
    parts = np.split(full, blocks, axis=dim)
    width = [(0, 0)] * full.ndim
    width[dim] = (0, n_padded // blocks - parts[0].shape[dim])
    return np.concatenate([np.pad(p, width) for p in parts], axis=dim)


def shard(full: np.ndarray, placement: Placement, W: int, rank: int) -> np.ndarray:
    """This rank's piece of `full` under `placement` over W ranks (a new array)."""
    if not isinstance(placement, Shard):
        return np.array(full, copy=True)
    dim, k = placement.dim % full.ndim, placement.blocks
    L = piece_length(full.shape[dim], W, k)
    padded = _padded(full, dim, k * W * L, k)
    return np.take(padded, shard_indices(full.shape[dim], W, rank, k), axis=dim)


def unshard(pieces: list[np.ndarray], placement: Placement, n: int) -> np.ndarray:
    """The full tensor from every rank's piece (rank order); crops padding to length n."""
    if not isinstance(placement, Shard):
        return np.array(pieces[0], copy=True)
    dim, k = placement.dim % pieces[0].ndim, placement.blocks
    blocks = []
    for b in range(k):
        per_rank = [np.split(p, k, axis=dim)[b] for p in pieces]
        blocks.append(np.take(np.concatenate(per_rank, axis=dim), np.arange(n // k), axis=dim))
    return np.concatenate(blocks, axis=dim)


def placement_of(p, axis: str) -> Placement:
    """The placement of parameter p over `axis` (Replicate when it names none)."""
    return (getattr(p, "placements", None) or {}).get(axis, Replicate())


def owns_uniquely(p, axis: str, rank: int) -> bool:
    """True if this rank's elements of p are counted in a sum over the axis: every piece of
    a Shard counts, a Replicate copy counts on rank 0 only."""
    return isinstance(placement_of(p, axis), Shard) or rank == 0


# --- check mode: placements of activations ----------------------------------------------

_tags: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_checking = os.environ.get("MINIDIST_CHECK_PLACEMENTS", "") not in ("", "0")


def checking() -> bool:
    """True in check mode."""
    return _checking


def set_checking(on: bool) -> None:
    """Turn check mode on or off in this process (each rank sets it from the Plan)."""
    global _checking
    _checking = bool(on)
    if _checking:
        if _CHECK not in core.observers:
            observe(_CHECK)
    else:
        unobserve(_CHECK)


def tag(t, axis: str, placement: Placement):
    """Record that activation t lies as `placement` over `axis` (check mode); return t."""
    if _checking:
        _tags[t] = {**_tags.get(t, {}), axis: placement}
    return t


def carry(src, dst):
    """Give dst the placement tags of src (check mode); return dst. For a Function that
    runs layers inside its forward (ZeRO-3's pieces), whose output the hook cannot see."""
    if _checking and src in _tags:
        _tags[dst] = dict(_tags[src])
    return dst


def placement_tag(t, axis: str) -> Placement | None:
    """The recorded placement of activation t over axis, or None if it carries none."""
    return _tags.get(t, {}).get(axis) if _checking else None


def expect(t, axis: str, placement: Placement, *, name: str, where: str) -> None:
    """Check mode: raise PlacementError unless t is tagged `placement` over `axis`.

    An untagged tensor is taken as Replicate(): every ordinary activation is the same on
    all ranks until a parallel layer says otherwise.
    """
    if not _checking:
        return
    actual = placement_tag(t, axis) or Replicate()
    if actual != placement:
        raise PlacementError(
            f"{where}: input {name!r} must be {placement} over {axis}, but it is {actual}. "
            f"{_HINTS.get((type(placement), type(actual)), '')}".rstrip())


_HINTS = {
    (Partial, Replicate): "Only the sum of partial results (after a row-parallel layer) "
                          "may be all-reduced; a replicated tensor would be added W times.",
    (Replicate, Partial): "This tensor is still a partial sum: reduce it (g, or a "
                          "reduce-scatter under sequence parallelism) first.",
    (Shard, Replicate): "The layer wants this rank's shard; a gathered (replicated) "
                        "tensor would be counted W times or misaligned.",
    (Replicate, Shard): "This tensor is sharded: gather it first.",
}


class _PlacementCheck(Observer):
    """The autograd Observer of check mode: every operation passes the agreed placement of
    its inputs on to its result, and an alias (a recomputed block's fresh leaf) keeps the
    placement of the Tensor it stands for."""

    def forward(self, fn, ctx, args, arrays, kwargs, result, t0) -> None:
        merged: dict | None = None
        for a in args:
            placed = _tags.get(a) if isinstance(a, Tensor) else None
            if not placed:
                continue
            if merged is None:
                merged = dict(placed)
                continue
            for axis, pl in placed.items():
                if merged.setdefault(axis, pl) != pl:
                    raise PlacementError(
                        f"{fn.__name__} combines activations placed {merged[axis]} and {pl} "
                        f"over {axis}. "
                        f"{_HINTS.get((type(merged[axis]), type(pl)), '')}".rstrip())
        if merged:
            _tags[result] = merged

    def alias(self, src, dst) -> None:
        carry(src, dst)


_CHECK = _PlacementCheck()
set_checking(_checking)
