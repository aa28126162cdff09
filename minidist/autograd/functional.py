"""The functional interface (import as F): every differentiable operation by name.

    from minidist.autograd import functional as F
    h = F.gelu(x @ w1 + b1)                  # (B, T, F)
    loss = F.cross_entropy(logits, targets)  # logits (B, T, V), targets (B, T) int

This module defines concatenate/split, relu, embedding (its backward's add_rows_at),
dropout, where/masked_fill, normalize, sigmoid, linear, and re-exports matmul and the elementwise ops (tensor.py) and
the fused ops with hand-written backward (fused.py). Every function accepts Tensors and
constants (Python numbers, xp arrays) and returns a Tensor.

Read next: autograd/fused.py, then nn/
"""

from __future__ import annotations

from typing import Any, Sequence

from minidist import backend
from minidist.autograd import fused
from minidist.autograd import tensor as core
from minidist.autograd.tensor import (Context, Exp, Function, Log, Mul, Tanh, Tensor, getitem,
                                      reshape, shape_of, unbroadcast)
from minidist.autograd.tensor import MatMul, matmul  # noqa: F401  (F.matmul, F.MatMul)



class Concatenate(Function):
    """y = the inputs joined along `axis`.  d(input_i) = the matching slice of g."""

    @staticmethod
    def forward(ctx: Context, *xs: Any, axis: int = 0) -> Any:
        ctx.axis = axis
        ctx.bounds = [0]
        for x in xs:
            ctx.bounds.append(ctx.bounds[-1] + x.shape[axis])
        return backend.xp.concatenate(xs, axis=axis)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        lead = (slice(None),) * (ctx.axis % g.ndim)
        b = ctx.bounds
        return tuple(g[lead + (slice(b[i], b[i + 1]),)] if need else None
                     for i, need in enumerate(ctx.needs_input_grad))


def concatenate(tensors: Sequence[Any], axis: int = 0) -> Tensor:
    """Join tensors along an existing axis (like xp.concatenate)."""
    return Concatenate.apply(*tensors, axis=axis)


def split(x: Tensor, sections_or_indices: Any, axis: int = 0) -> list:
    """Cut x along `axis` like xp.split: into N equal parts, or at the given indices.

    Each piece is a slice of x (tensor.py's GetItem), so its gradient lands in the
    right place of dx and the pieces' gradients add up there.
    """
    n = x.shape[axis]
    if isinstance(sections_or_indices, int):
        parts = sections_or_indices
        if parts <= 0 or n % parts:
            raise ValueError(
                f"split: axis {axis} has length {n}, which does not divide into {parts} equal "
                f"parts. Pass a divisor of {n}, or a list of cut indices instead."
            )
        cuts = [n // parts * i for i in range(1, parts)]
    else:
        cuts = list(sections_or_indices)
    lead = (slice(None),) * (axis % x.ndim)
    edges = [0] + cuts + [n]
    return [getitem(x, lead + (slice(lo, hi),)) for lo, hi in zip(edges[:-1], edges[1:])]


class ReLU(Function):
    """y = max(x, 0).  dx = g where x > 0, else 0."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        y = backend.xp.maximum(x, 0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g * (ctx.saved_tensors[0] > 0),)


def relu(x: Any) -> Tensor:
    """max(x, 0), elementwise."""
    return ReLU.apply(x)


class Embedding(Function):
    """y[..., :] = w[ids[...], :]: rows of the table w (V, C) picked by integer ids (...).

    Backward: the same row may be picked many times, so the rows of g are
    summed into dw as add.at sums them:  dw[v] = sum of g[n] over all n with ids[n] = v,
    in the order of n (add_rows_at: the same bits, faster).
    """

    @staticmethod
    def forward(ctx: Context, w: Any, ids: Any) -> Any:
        ctx.save_for_backward(ids)
        ctx.shape = w.shape
        return w[ids]

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        xp = backend.xp
        (ids,) = ctx.saved_tensors
        dw = xp.zeros(ctx.shape, dtype=g.dtype)
        add_rows_at(dw, ids.reshape(-1), g.reshape(-1, ctx.shape[1]))
        return dw, None


ROUND_COST = 1024       # numbers add.at adds in the time of one round of add_rows_at (about)


def add_rows_at(dw: Any, ids: Any, rows: Any) -> None:
    """dw[ids[n]] += rows[n] for n = 0, 1, ..., N-1: xp.add.at(dw, ids, rows), bit for bit.

    add.at adds one row at a time (1.1 ms for 512 rows of 256 numbers here). This adds in
    ROUNDS: round r adds, for every id at once, the r-th row that has that id. No id occurs
    twice in a round, so the fancy-indexed `+=` is exact, and each dw[v] receives its rows
    in the order of n, as with add.at: ((0 + g_a) + g_b) + ... So the sums are the same
    bits in (most repeats of one id) rounds, 0.2 ms for the 512 rows above (a vocabulary
    of 64). When the rounds would cost more than add.at (few rows, one id repeated a lot;
    ROUND_COST) or the arrays are not NumPy's, it calls add.at.
    ids (N,) int, rows (N, C), dw (V, C), changed in place.
    """
    xp = backend.xp
    n = ids.shape[0]
    if n == 0:
        return
    if xp.__name__ != "numpy":
        xp.add.at(dw, ids, rows)
        return
    order = xp.argsort(ids, kind="stable")                 # the rows of each id, in order
    sorted_ids = ids[order]
    first = xp.empty(n, dtype=bool)
    first[0] = True
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    starts = xp.flatnonzero(first)
    occurrence = xp.arange(n) - starts[xp.cumsum(first) - 1]  # 0, 1, ... within each id
    rounds = int(occurrence.max()) + 1
    if rounds * ROUND_COST > n * rows.shape[1]:
        xp.add.at(dw, ids, rows)
        return
    by_round = order[xp.argsort(occurrence, kind="stable")]  # round 0's rows, round 1's...
    end = 0
    for size in xp.bincount(occurrence):
        picked = by_round[end:end + size]
        dw[ids[picked]] += rows[picked]
        end += size


def embedding_ids(weight: Tensor, ids: Any) -> Any:
    """ids (...) as an integer array, checked against the rows of `weight` (V, C)."""
    ids = ids.data if isinstance(ids, Tensor) else backend.xp.asarray(ids)
    V = weight.shape[0]
    if ids.dtype.kind not in "iu":
        raise ValueError(f"embedding: ids must be integers, got dtype {ids.dtype}.")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(
            f"embedding: ids range over [{int(ids.min())}, {int(ids.max())}] but the table "
            f"has {V} rows; every id must lie in [0, {V - 1}]. Check the vocabulary size."
        )
    return ids


def embedding(weight: Tensor, ids: Any) -> Tensor:
    """Look up rows of `weight` (V, C) for integer `ids` (...) -> (..., C) (Embedding)."""
    return Embedding.apply(weight, embedding_ids(weight, ids))


def dropout(x: Any, p: float, rng: Any, training: bool = True) -> Tensor:
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    y = x * m / (1 - p), m_i ~ Bernoulli(1 - p), so E[y] = x and evaluation
    needs no rescaling. dx = g * m / (1 - p). The mask comes from the NumPy
    Generator `rng` (always float64 draws), so the same rng state gives the
    same mask in float32 and float64 and on every backend. Identity (the same
    Tensor back) when p == 0 or not training.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p={p} is not in [0, 1); p is the probability of zeroing.")
    if not training or p == 0.0:
        return x
    xp = backend.xp
    data = x.data if isinstance(x, Tensor) else xp.asarray(x)
    scale = xp.asarray(rng.random(data.shape) >= p).astype(data.dtype)   # m, 1 = kept
    scale *= 1.0 / (1.0 - p)
    return Mul.apply(x, scale)


class Where(Function):
    """y = a where cond else b (broadcast).  da = g where cond else 0; db = g where not cond."""

    @staticmethod
    def forward(ctx: Context, a: Any, b: Any, *, cond: Any) -> Any:
        ctx.cond, ctx.shapes = cond, (shape_of(a), shape_of(b))
        return backend.xp.where(cond, a, b)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        xp = backend.xp
        need_a, need_b = ctx.needs_input_grad
        zero = xp.zeros((), dtype=g.dtype)
        da = unbroadcast(xp.where(ctx.cond, g, zero), ctx.shapes[0]) if need_a else None
        db = unbroadcast(xp.where(ctx.cond, zero, g), ctx.shapes[1]) if need_b else None
        return da, db


def where(cond: Any, a: Any, b: Any) -> Tensor:
    """Elementwise choice: a where cond is true, b elsewhere (cond: bool array or Tensor)."""
    cond = cond.data if isinstance(cond, Tensor) else cond
    return Where.apply(a, b, cond=cond)


def masked_fill(x: Any, mask: Any, value: float) -> Tensor:
    """x with `value` wherever mask is true (e.g. -inf above the diagonal in attention)."""
    mask = mask.data if isinstance(mask, Tensor) else mask
    return Where.apply(value, x, cond=mask)


def fp32_input(x: Any) -> Any:
    """x as an op kept in fp32 under mixed precision reads it (memory/precision.FP32_OPS):
    upcast when autocast is on and x is stored in a low-precision dtype, else x itself.
    For ops built outside this module (the vocabulary-parallel cross-entropy)."""
    return x if core.autocast is None else core.autocast.upcast(x)


def softmax(x: Any, axis: int = -1) -> Tensor:
    """exp(x) / sum exp(x) over `axis` (fused.Softmax)."""
    if core.autocast is not None:
        x = core.autocast.upcast(x)
    return fused.Softmax.apply(x, axis=axis)


class Normalize(Function):
    """y = x / sum(x) over `axis`.  dx = (g - sum(g y)) / sum(x), both sums over `axis`.

    One node where x / x.sum() would be two: a tensor with three or more consumers sums
    their gradients in the order the backward walk meets them, which depends on the graph
    around it, so fewer consumers keep a gradient's bits the same in every layout (a
    pipeline stage's graph is not the single process's)."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, axis: int) -> Any:
        total = x.sum(axis=axis, keepdims=True)
        y = x / total
        ctx.save_for_backward(y, total)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        y, total = ctx.saved_tensors
        return ((g - (g * y).sum(axis=ctx.axis, keepdims=True)) / total,)


def normalize(x: Any, axis: int = -1) -> Tensor:
    """x / sum(x) over `axis` (Normalize): positive scores made into weights summing to 1."""
    return Normalize.apply(x, axis=axis)


def sigmoid(x: Any) -> Tensor:
    """1 / (1 + exp(-x)), written as (1 + tanh(x / 2)) / 2: the same function, and no
    exp(-x) to overflow for very negative x. Its gradient is sigmoid(x) (1 - sigmoid(x))."""
    return Tanh.apply(x * 0.5) * 0.5 + 0.5


def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """x - log sum exp(x) over `axis` (fused.LogSoftmax)."""
    if core.autocast is not None:
        x = core.autocast.upcast(x)
    return fused.LogSoftmax.apply(x, axis=axis)


def layer_norm(x: Any, weight: Any, bias: Any, eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis, then scale by weight and shift by bias (fused.LayerNorm)."""
    if core.autocast is not None:
        x, weight, bias = (core.autocast.upcast(v) for v in (x, weight, bias))
    return fused.LayerNorm.apply(x, weight, bias, eps=eps)


def linear(x: Any, weight: Any, bias: Any = None) -> Tensor:
    """x @ weight + bias (fused.Linear: the bias added in place); x @ weight without a bias,
    and MatMul then Add under mixed precision, whose GEMM rounds its output (memory/precision.py)."""
    if bias is None:
        return core.matmul(x, weight)
    if core.autocast is not None:
        return core.matmul(x, weight) + bias
    return fused.Linear.apply(x, weight, bias)


def gelu(x: Any, approximate: str = "tanh") -> Tensor:
    """x * Phi(x); approximate="tanh" (GPT-2's form) or "none" (exact, via erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu: approximate={approximate!r}; use 'tanh' or 'none'.")
    return fused.Gelu.apply(x, approximate=approximate)


def cross_entropy(logits: Tensor, targets: Any, ignore_index: int = -100,
                  reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of logits (..., V) against integer targets (...).

    reduction: "mean" over targets != ignore_index (0 if there are none), "sum",
    or "none" (a loss per position, shape of targets, 0 where ignored).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'.")
    t = cross_entropy_targets(logits, targets, ignore_index)
    if core.autocast is not None:
        logits = core.autocast.upcast(logits)
    z = logits if logits.ndim == 2 else reshape(logits, -1, logits.shape[-1])
    loss = fused.CrossEntropy.apply(z, t=t.reshape(-1), ignore_index=ignore_index,
                                    reduction=reduction)
    return reshape(loss, t.shape) if reduction == "none" else loss


def cross_entropy_targets(logits: Tensor, targets: Any, ignore_index: int = -100) -> Any:
    """targets (...) as an array, checked against logits (..., V): the same leading shape,
    every counted target a class in 0..V-1."""
    xp = backend.xp
    t = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
    V = logits.shape[-1]
    if t.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: targets have shape {t.shape}, expected "
                         f"{logits.shape[:-1]} (the logits' shape without the last axis).")
    counted = t[t != ignore_index]
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= V):
        raise ValueError(
            f"cross_entropy: targets range over [{int(counted.min())}, {int(counted.max())}] "
            f"but there are {V} classes; use 0..{V - 1}, or ignore_index={ignore_index} to skip."
        )
    return t


exp = Exp.apply
log = Log.apply
tanh = Tanh.apply
