"""FLOPs per operation: what each autograd Function executes, forward and backward.

The FLOP ledger (observe/flops.py) asks this module, for every operation that runs, how
many floating-point operations it did. The answer comes from the shapes alone, written
from the code of the operation (autograd/tensor.py, functional.py, fused.py), one line of
NumPy at a time, so it is the work that EXECUTES, not the work the math needs: the
attention scores are counted for the full T x T square although the causal mask throws
half of them away, because the code computes all of them.

Convention (two kinds, kept apart):
    matmul   a (M, K) @ (K, N) product is 2*M*K*N FLOPs (one multiply and one add per
             term), batched products times the batch. These are the "model FLOPs" of
             PaLM's MFU and what 6N + 12LHQT predicts (observe/throughput.py).
    other    every other floating-point operation, one FLOP per element per NumPy pass:
             + - * /, negate, compare, max, exp, log, sqrt, tanh, erf each count 1; a
             reduction of n numbers to one counts n - 1 (the adds or compares it does);
             add.at counts one add per value added. Copies, reshapes, transposes, slices,
             gathers, selections (where) and integer work count 0. Example: softmax over
             rows of length n is 5n - 2 per row (max, subtract, exp, sum, divide).
A test checks every rule against NumPy itself: it runs the operation on an ndarray
subclass that counts each ufunc call this way (tests/observe/test_throughput_ledger.py).

A rule maps (ctx, input shapes, output shape) to (matmul, other) FLOPs; a backward rule
also gets `done`, which inputs' gradients the backward returned (it skips the others,
ctx.needs_input_grad). Inputs that are not arrays have shape (), a missing one (a
LayerNorm without bias) None.

Optimizer updates run outside the autograd; `optimizer_flops` counts them from the
update's formula, per element, as optim/adamw.py and optim/sgd.py write it.

One rank's view: a rule reads only shapes and what the forward left on ctx (axis,
reduction, approximate), so each rank counts the work of its own arrays: a tensor-parallel
rank's matmuls on its shards, a context-parallel rank's on its positions. Nothing here
communicates, and the adds inside a collective are the collective's, not counted.

References: Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
    arXiv:2001.08361, Sec. 2.1 and Table 1 (2 FLOPs per multiply-add, per-op counts of a
    Transformer); Chowdhery et al. 2022, arXiv:2204.02311, App. B.
Read next: observe/flops.py (the ledger that applies these rules).
"""

from __future__ import annotations

import math
from typing import Any, Callable

Shape = tuple | None
Counts = tuple[int, int]                       # (matmul FLOPs, other FLOPs)


def _n(shape: Shape) -> int:
    return 0 if shape is None else math.prod(shape)


def _unbroadcast(out: Shape, inp: Shape) -> int:
    """Adds that sum a gradient of shape `out` back to an input of shape `inp` (none when
    `out` is empty: a sum over 0 rows adds nothing)."""
    return max(_n(out) - _n(inp), 0)


# --- elementwise and reductions (autograd/tensor.py) ----------------------------------

def _add_bwd(ctx, shapes, out, done) -> Counts:
    return 0, sum(_unbroadcast(out, s) for s, d in zip(shapes, done) if d)


def _sub_bwd(ctx, shapes, out, done) -> Counts:
    negate = _n(shapes[1]) if done[1] else 0                   # -unbroadcast(g)
    return 0, _add_bwd(ctx, shapes, out, done)[1] + negate


def _mul_bwd(ctx, shapes, out, done) -> Counts:                # g * b, then unbroadcast
    return 0, sum(_n(out) + _unbroadcast(out, s) for s, d in zip(shapes, done) if d)


def _div_bwd(ctx, shapes, out, done) -> Counts:
    other = _n(out)                                            # g / b, always
    if done[0]:
        other += _unbroadcast(out, shapes[0])
    if done[1]:
        other += 2 * _n(out) + _unbroadcast(out, shapes[1])    # -(g / b) * y
    return 0, other


def _pow_bwd(ctx, shapes, out, done) -> Counts:                # g * (2x) or g * (p x^(p-1))
    return 0, (2 if ctx.p == 2 else 3) * _n(shapes[0])


def _max_bwd(ctx, shapes, out, done) -> Counts:
    return 0, 3 * _n(shapes[0])            # x == y, count ties, g / ties, hit * (...)


def _elementwise(fwd: int, bwd: int):
    """(forward, backward) rules of an op doing fwd and bwd passes over its input."""
    return (lambda ctx, shapes, out: (0, fwd * _n(shapes[0])),
            lambda ctx, shapes, out, done: (0, bwd * _n(shapes[0])))


def _zero(*_: Any) -> Counts:
    return 0, 0


def _out(ctx, shapes, out) -> Counts:
    return 0, _n(out)


def _reduce(ctx, shapes, out) -> Counts:
    return 0, _n(shapes[0]) - _n(out)


def _mean(ctx, shapes, out) -> Counts:
    return 0, _n(shapes[0])                # n - out adds, then out divisions


def _mean_bwd(ctx, shapes, out, done) -> Counts:
    return 0, _n(out)                      # g / n


def _getitem_bwd(ctx, shapes, out, done) -> Counts:
    return 0, 0 if ctx.basic else _n(out)  # dx[index] = g, or add.at(dx, index, g)


# --- matmul (autograd/functional.py) ---------------------------------------------------

def _gemm(a: tuple, b: tuple) -> tuple[int, tuple]:
    """FLOPs and output shape of a (..., M, K) @ b (..., K, N), batch axes broadcast."""
    batch = _broadcast(a[:-2], b[:-2])
    return 2 * _n(batch) * a[-2] * a[-1] * b[-1], batch + (a[-2], b[-1])


def _broadcast(x: tuple, y: tuple) -> tuple:
    n = max(len(x), len(y))
    x, y = (1,) * (n - len(x)) + tuple(x), (1,) * (n - len(y)) + tuple(y)
    return tuple(max(i, j) for i, j in zip(x, y))


def _as_matrices(a: tuple, b: tuple) -> tuple[tuple, tuple]:
    """NumPy's rule: a 1-D a is a row (1, K), a 1-D b a column (K, 1)."""
    return (a if len(a) > 1 else (1,) + a), (b if len(b) > 1 else b + (1,))


def _matmul_fwd(ctx, shapes, out) -> Counts:
    a, b = _as_matrices(*shapes)
    return _gemm(a, b)[0], 0


def _matmul_bwd(ctx, shapes, out, done) -> Counts:
    """da = g @ b^T and db = a^T @ g as MatMul.backward runs them, then unbroadcast."""
    a, b = _as_matrices(*shapes)
    _, g = _gemm(a, b)                                          # (..., M, N)
    swap = lambda s: s[:-2] + (s[-1], s[-2])                    # noqa: E731
    mm = other = 0
    if done[0]:
        flops, da = _gemm(g, swap(b))
        mm, other = mm + flops, other + _unbroadcast(da, a)
    if done[1]:
        if len(b) == 2 and len(a) > 2:                          # the stack summed in one GEMM
            mm += 2 * _n(a) * b[-1]
        else:
            flops, db = _gemm(swap(a), g)
            mm, other = mm + flops, other + _unbroadcast(db, b)
    return mm, other


# --- fused ops (autograd/fused.py) and the rest of functional.py -----------------------

def _rows(shapes: list, axis: int = -1) -> tuple[int, int]:
    """(n, r): elements of the first input and rows of the reduction over `axis`."""
    n = _n(shapes[0])
    return n, n // shapes[0][axis] if n else 0


def _softmax_fwd(ctx, shapes, out) -> Counts:
    n, r = _rows(shapes, ctx.axis)
    return 0, 5 * n - 2 * r                # max, x - max, exp, sum, divide


def _softmax_bwd(ctx, shapes, out, done) -> Counts:
    n, r = _rows(shapes, ctx.axis)
    return 0, 4 * n - r                    # g * y, sum, y * sum, subtract


def _normalize_fwd(ctx, shapes, out) -> Counts:
    n, r = _rows(shapes, ctx.axis)
    return 0, 2 * n - r                    # sum, divide


def _normalize_bwd(ctx, shapes, out, done) -> Counts:
    n, r = _rows(shapes, ctx.axis)
    return 0, 4 * n - r                    # g * y, sum, subtract, divide


def _log_softmax_fwd(ctx, shapes, out) -> Counts:
    n, r = _rows(shapes, ctx.axis)
    return 0, 5 * n - r                    # max, subtract, exp, sum, log (r), subtract


def _log_softmax_bwd(ctx, shapes, out, done) -> Counts:
    n, r = _rows(shapes, ctx.axis)
    return 0, 4 * n - r                    # sum of g, exp(y), multiply, subtract


def _layer_norm_fwd(ctx, shapes, out) -> Counts:
    n, r = _rows(shapes)
    scale = (shapes[1] is not None) + (shapes[2] is not None)
    return 0, (5 + scale) * n + 3 * r      # mean, x - mu, square, mean, +eps, sqrt, 1/, * r


def _layer_norm_bwd(ctx, shapes, out, done) -> Counts:
    n, r = _rows(shapes)
    C = shapes[0][-1]
    other = (7 + (shapes[1] is not None)) * n if done[0] else 0
    other += (2 * n - C if done[1] else 0) + (n - C if done[2] else 0)
    return 0, other


def _cross_entropy_fwd(ctx, shapes, out) -> Counts:
    N, V = shapes[0]
    tail = {"none": 0, "sum": N - 1, "mean": N}[ctx.reduction]
    return 0, 5 * N * V + N + tail         # softmax of z (5n - 2N), log, +max, -z_t (an
    #                                        ignored row's loss is set to 0: no arithmetic)


def _cross_entropy_bwd(ctx, shapes, out, done) -> Counts:
    N, V = shapes[0]
    return 0, N * V + 2 * N + (ctx.reduction == "mean")   # w * g, p * w, subtract at t


def _linear_fwd(ctx, shapes, out) -> Counts:
    return _matmul_fwd(ctx, shapes[:2], out)[0], _n(out)         # the GEMM, then + b


def _linear_bwd(ctx, shapes, out, done) -> Counts:
    mm, other = _matmul_bwd(ctx, shapes[:2], out, done[:2])
    return mm, other + (_unbroadcast(out, shapes[2]) if done[2] else 0)


def _gelu_fwd(ctx, shapes, out) -> Counts:
    return 0, (11 if ctx.approximate == "tanh" else 5) * _n(shapes[0])


def _gelu_bwd(ctx, shapes, out, done) -> Counts:
    return 0, (12 if ctx.approximate == "tanh" else 9) * _n(shapes[0])


def _grouped_segments(ctx, shapes):
    """Per expert segment of nn/grouped_experts.py's GroupedMLP: (n, C, F, bias?)."""
    C = shapes[0][-1]
    for e, n in enumerate(ctx.counts):
        w1, b1 = shapes[1 + 4 * e], shapes[2 + 4 * e]
        yield n, C, w1[-1], b1 is not None


def _grouped_fwd(ctx, shapes, out) -> Counts:
    """Each segment's fc (+ b), tanh GELU and proj (+ b), as the plain MLP's nodes count."""
    mm = other = 0
    for n, C, F_, bias in _grouped_segments(ctx, shapes):
        mm += 2 * n * C * F_ + 2 * n * F_ * C
        other += 11 * n * F_ + (n * F_ + n * C if bias else 0)
    return mm, other


def _grouped_bwd(ctx, shapes, out, done) -> Counts:
    """Each segment's proj, GELU and fc backward (dx and dW of both GEMMs, db sums)."""
    mm = other = 0
    for n, C, F_, bias in _grouped_segments(ctx, shapes):
        mm += 2 * (2 * n * C * F_ + 2 * n * F_ * C)
        other += 12 * n * F_ + ((n - 1) * (C + F_) if bias and n else 0)
    return mm, other


def _selective_attention_bwd(ctx, shapes, out, done) -> Counts:
    """memory/recompute.py's SelectiveAttention calls MatMul's backward rule itself for
    att @ v (att (..., Tq, Tk) rebuilt from q, k; its own ops are counted as they run)."""
    q, k, v = shapes
    return _matmul_bwd(ctx, [q[:-1] + (k[-2],), v], out, [done[0] or done[1], done[2]])


def _embedding_bwd(ctx, shapes, out, done) -> Counts:
    return 0, _n(out)                      # add.at: each row of g added into dw once


def _where_bwd(ctx, shapes, out, done) -> Counts:
    return 0, sum(_unbroadcast(out, s) for s, d in zip(shapes, done) if d)


_A, _F = "minidist.autograd.tensor.", "minidist.autograd.functional."
_U, _P = "minidist.autograd.fused.", "minidist.parallel."
Rule = Callable[..., Counts]
RULES: dict[str, tuple[Rule, Rule]] = {
    _A + "Add": (_out, _add_bwd), _A + "Sub": (_out, _sub_bwd), _A + "Mul": (_out, _mul_bwd),
    _A + "Div": (_out, _div_bwd), _A + "Neg": _elementwise(1, 1),
    _A + "Pow": (lambda ctx, shapes, out: (0, _n(shapes[0])), _pow_bwd),
    _A + "Exp": _elementwise(1, 1), _A + "Log": _elementwise(1, 1),
    _A + "Tanh": _elementwise(1, 3), _A + "Sum": (_reduce, _zero),
    _A + "Mean": (_mean, _mean_bwd), _A + "Max": (_reduce, _max_bwd),
    _A + "Reshape": (_zero, _zero), _A + "Transpose": (_zero, _zero),
    _A + "GetItem": (_zero, _getitem_bwd),
    _A + "MatMul": (_matmul_fwd, _matmul_bwd), _F + "Concatenate": (_zero, _zero),
    _F + "ReLU": _elementwise(1, 2), _F + "Embedding": (_zero, _embedding_bwd),
    _F + "Where": (_zero, _where_bwd), _F + "Normalize": (_normalize_fwd, _normalize_bwd),
    _U + "Softmax": (_softmax_fwd, _softmax_bwd),
    _U + "LogSoftmax": (_log_softmax_fwd, _log_softmax_bwd),
    _U + "LayerNorm": (_layer_norm_fwd, _layer_norm_bwd),
    _U + "CrossEntropy": (_cross_entropy_fwd, _cross_entropy_bwd),
    _U + "Gelu": (_gelu_fwd, _gelu_bwd), _U + "Linear": (_linear_fwd, _linear_bwd),
    "minidist.nn.grouped_experts.GroupedMLP": (_grouped_fwd, _grouped_bwd),
    # communication and data movement only (the adds inside a collective are the
    # collective's, not counted here); ZeRO-3's _HookCall runs layers whose own ops count
    _P + "tensor.tensor_parallel.f": (_zero, _zero),
    _P + "tensor.tensor_parallel.g": (_zero, _zero),
    _P + "tensor.sequence.GatherFromSequenceRegion": (_zero, _zero),
    _P + "tensor.sequence.ReduceScatterToSequenceRegion": (_zero, _zero),
    _P + "context.ulysses.SeqToHeads": (_zero, _zero),
    _P + "context.ulysses.HeadsToSeq": (_zero, _zero),
    _P + "expert.expert_parallel.AllToAll": (_zero, _zero),
    _P + "zero.stage3._HookCall": (_zero, _zero),
    # activation recomputation: the layers inside run (and are recomputed) as their own ops
    "minidist.memory.recompute.Recompute": (_zero, _zero),
    "minidist.memory.recompute.SelectiveAttention": (_zero, _selective_attention_bwd),
}


def rule_for(cls: type) -> tuple[Rule, Rule] | None:
    """The (forward, backward) rules of a Function class; None when it has none here."""
    return RULES.get(f"{cls.__module__}.{cls.__qualname__}")


# --- the optimizer (optim/), counted from its formula ----------------------------------

def optimizer_flops(name: str, n: int, *, weight_decay: float = 0.0,
                    momentum: float = 0.0) -> int:
    """FLOPs of one update of n elements, as optim/adamw.py and optim/sgd.py run it.

    AdamW: 14 per element (m: *, (1-b1) g, +; v: *, g*g, (1-b2)*, +; v / (1-b2^t), sqrt,
    + eps; m / (1-b1^t); divide; * lr; p -) and 2 more with weight decay (wd * p, +).
    SGD: 2 (lr * d, p -), 2 more with weight decay (wd * p, + g), 2 more with momentum
    (buf *, buf +).
    """
    if n < 0:
        raise ValueError(f"optimizer_flops: n={n} elements; it must be >= 0.")
    if name == "adamw":
        return (14 + 2 * (weight_decay != 0)) * n
    if name == "sgd":
        return (2 + 2 * (weight_decay != 0) + 2 * (momentum != 0)) * n
    raise ValueError(f"optimizer_flops: optimizer {name!r} is unknown; use 'adamw' or 'sgd'.")


def grad_norm_flops(sizes: list[int]) -> int:
    """FLOPs of optim.global_grad_norm over arrays of these sizes: a dot product of n
    numbers with itself is n multiplies and n - 1 adds."""
    return sum(2 * n - 1 for n in sizes if n > 0)
