"""Grouped experts: every expert MLP of a MoE layer on its own rows, in one autograd node.

The plain path (nn/moe.py, MoE.run_experts) runs expert e as an MLP of its own on the
tokens routed to it: a gather, fc, GELU and proj per expert, about 5 E autograd nodes and
E x 3 small matmuls per layer. The grouped path takes the kept assignments sorted by
expert, x (A, C) with counts (E,) (expert e's rows are x[start_e : start_e + counts[e]],
start_e = counts[0] + ... + counts[e-1]), and runs

    y[rows_e] = GELU(x[rows_e] @ W1_e + b1_e) @ W2_e + b2_e        for e = 0 .. E-1

inside ONE Function, whose backward runs each segment's backward, last layer first, with
the same fused.Linear and fused.Gelu rules the plain path's nodes use: the same arithmetic
on the same arrays in the same order, so the same bits (tests/nn/test_grouped_experts.py),
and one node. This is the "grouped GEMM" of dropless MoE (MegaBlocks, Megatron-core's
GroupedMLP): uneven segments, no padding, no token dropped, and one call per layer
instead of one per expert. NumPy has no kernel for it, so the segments still loop in
Python; what the node saves is the autograd walk and bookkeeping of the 5 E small ones.

Shapes: x (A, C); counts (E,) summing to A; expert e: W1 (C, F), b1 (F,), W2 (F, C), b2
(C,) (or no biases); y (A, C). An expert with no rows gets zero gradients, as its plain
MLP on 0 rows does. FLOPs: the sum of the segments' Linear and GELU counts
(observe/op_flops.py). Under mixed precision the plain path runs instead (memory/precision.py
sets the layers' `grouped` off): its MatMul nodes round their outputs in the policy's format.
Reference: Gale et al. 2022, "MegaBlocks: Efficient Sparse Training with Mixture-of-
    Experts", arXiv:2211.15841 (dropless MoE as block-sparse / grouped matmuls).
Read next: nn/moe.py (MoE.run_experts_grouped uses it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minidist import backend
from minidist.autograd import Context, Function, fused


class GroupedMLP(Function):
    """y = the expert MLPs on their row segments of x (module docstring). Positional
    inputs: x, then each expert's W1, b1, W2, b2 (biases None when the MLPs have none)."""

    @staticmethod
    def forward(ctx: Context, x: Any, *weights: Any, counts: tuple[int, ...]) -> Any:
        ctx.counts, ctx.steps = counts, []
        ctx.has_bias = weights[1] is not None
        out, at = [], 0
        for e, n in enumerate(counts):
            w1, b1, w2, b2 = weights[4 * e:4 * e + 4]
            fc, act, proj = Context(), Context(), Context()
            for c, k in ((fc, 3), (proj, 3)):
                c.needs_input_grad = (True,) * k
            h = _linear(fc, x[at:at + n], w1, b1)                      # (n, F)
            a = fused.Gelu.forward(act, h, approximate="tanh")
            out.append(_linear(proj, a, w2, b2))                      # (n, C)
            ctx.steps.append((fc, act, proj))
            at += n
        # what the segments keep, where memory accounting looks (autograd/saved.py)
        ctx.save_for_backward(*(a for step in ctx.steps for c in step
                                for a in c.saved_tensors))
        return backend.xp.concatenate(out, axis=0) if out else x[:0]

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        grads, dx, at = [], [], 0
        for (fc, act, proj), n in zip(ctx.steps, ctx.counts):
            da, dw2, db2 = _linear_backward(proj, g[at:at + n])
            (dh,) = fused.Gelu.backward(act, da)
            dxe, dw1, db1 = _linear_backward(fc, dh)
            grads += [dw1, db1 if ctx.has_bias else None, dw2, db2 if ctx.has_bias else None]
            dx.append(dxe)
            at += n
        x_grad = backend.xp.concatenate(dx, axis=0) if dx else g[:0]
        return (x_grad, *grads)


def _linear(ctx: Context, x, w, b):
    """fused.Linear's forward (x @ w + b), or MatMul's rule alone without a bias."""
    if b is None:
        ctx.save_for_backward(x, w)
        return fused.mm(x, w)
    return fused.Linear.forward(ctx, x, w, b)


def _linear_backward(ctx: Context, g) -> tuple:
    """(dx, dw, db or None) of _linear: the rules the plain path's nodes run."""
    x, w = ctx.saved_tensors
    dx, dw = fused.matmul_grads(x, w, g, True, True)
    return dx, dw, (fused.unbroadcast(g, ctx.bias_shape) if hasattr(ctx, "bias_shape")
                    else None)


def grouped_mlp(x, experts: list, counts: np.ndarray):
    """The experts (nn.MLP modules, no dropout) on their segments of x: (A, C) Tensor."""
    weights = []
    for m in experts:
        weights += [m.fc.weight, getattr(m.fc, "bias", None), m.proj.weight,
                    getattr(m.proj, "bias", None)]
    return GroupedMLP.apply(x, *weights, counts=tuple(int(c) for c in counts))

