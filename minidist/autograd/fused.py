"""Fused operations: softmax, log-softmax, layer norm, cross-entropy, GELU and linear.

Each of these could be composed from the basic ops (exp, sum, divide, ...),
and autograd would differentiate the composition correctly. But that records
5-15 nodes, keeps every intermediate array alive for the backward, and runs
as many passes over memory. Here each is ONE node whose backward is the
closed-form derivative, worked out once on paper and stated in the docstring:
fewer Python calls, fewer arrays, and better numerics (e.g. the softmax
gradient never divides by a tiny sum).

Notation: the reduction runs over the last axis (or `axis`), of length C (V for
logits); sums over it are written sum_j; g = dL/dy; products are elementwise.

References:
    LayerNorm -- Ba, Kiros & Hinton 2016, arXiv:1607.06450, Sec. 3.
    GELU -- Hendrycks & Gimpel 2016, arXiv:1606.08415, Sec. 2 (tanh form in Sec. 2).
Read next: autograd/functional.py (the public names), autograd/gradcheck.py
"""

from __future__ import annotations

import math
from typing import Any

from minidist import backend
from minidist.autograd.tensor import Context, Function, matmul_grads, mm, unbroadcast

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_CUBIC = 0.044715


class Softmax(Function):
    """y_i = exp(x_i - m) / sum_j exp(x_j - m), with m = max_j x_j.

    Subtracting m changes nothing mathematically and keeps exp from overflowing.
    Backward: dy_i/dx_k = y_i (delta_ik - y_k), hence
        dx = y * (g - sum_j g_j y_j).
    """

    @staticmethod
    def forward(ctx: Context, x: Any, *, axis: int = -1) -> Any:
        xp = backend.xp
        y = x - x.max(axis=axis, keepdims=True)
        xp.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        ctx.save_for_backward(y)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (y,) = ctx.saved_tensors
        dx = g * y
        dx -= y * dx.sum(axis=ctx.axis, keepdims=True)
        return (dx,)


class LogSoftmax(Function):
    """y_i = x_i - m - log(sum_j exp(x_j - m)), with m = max_j x_j.

    Backward: dy_i/dx_k = delta_ik - softmax(x)_k, hence
        dx = g - exp(y) * sum_j g_j.
    """

    @staticmethod
    def forward(ctx: Context, x: Any, *, axis: int = -1) -> Any:
        xp = backend.xp
        z = x - x.max(axis=axis, keepdims=True)
        y = z - xp.log(xp.exp(z).sum(axis=axis, keepdims=True))
        ctx.save_for_backward(y)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (y,) = ctx.saved_tensors
        return (g - backend.xp.exp(y) * g.sum(axis=ctx.axis, keepdims=True),)


class LayerNorm(Function):
    """y = xhat * w + b, xhat = (x - mu) * r, over the last axis of length C.

    mu = mean_j x_j, var = mean_j (x_j - mu)^2 (biased), r = 1 / sqrt(var + eps).
    Backward (with dxhat = g * w):
        dx = r * (dxhat - mean_j dxhat_j - xhat * mean_j (dxhat_j * xhat_j))
        dw = sum over all leading axes of g * xhat,   db = same sum of g.
    Inputs: x (..., C); w, b (C,) or None (then that term is left out).
    """

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any, *, eps: float = 1e-5) -> Any:
        # Two fresh (..., C) arrays, not five: y first holds the squares, then w * xhat.
        # A fresh array is memory no pass has touched lately; one already in cache costs
        # a quarter as much to write (a 2 MB add: 103 us into new memory, 23 us in place).
        xp = backend.xp
        xc = x - x.mean(axis=-1, keepdims=True)
        y = xp.multiply(xc, xc)
        r = 1.0 / xp.sqrt(y.mean(axis=-1, keepdims=True) + eps)           # (..., 1)
        xhat = xc
        xhat *= r                                                          # in place: xc is ours
        ctx.save_for_backward(xhat, r, w)
        if w is None and b is None:
            return xhat
        if w is None:
            xp.add(xhat, b, out=y)
        else:
            xp.multiply(xhat, w, out=y)
            if b is not None:
                y += b
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return layer_norm_grads(ctx, g, sum_leading_axes)


def sum_leading_axes(v: Any) -> Any:
    """v (..., C) -> (C,): the sum over every axis but the last (NumPy's order)."""
    return v.reshape(-1, v.shape[-1]).sum(axis=0)


def layer_norm_grads(ctx: Context, g: Any, sum_over_tokens) -> tuple:
    """LayerNorm's (dx, dw, db) for g (..., C), with dw and db added over the tokens (the
    leading axes) by sum_over_tokens (..., C) -> (C,)."""
    xhat, r, w = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    xp = backend.xp
    dx = dw = db = None
    scratch = None                   # one (..., C) array, reused for each product below
    if need_x:
        dxhat = g if w is None else xp.multiply(g, w)
        dx = dxhat - dxhat.mean(axis=-1, keepdims=True)
        scratch = xp.multiply(dxhat, xhat, out=None if w is None else dxhat)
        m = scratch.mean(axis=-1, keepdims=True)                   # mean_j dxhat_j xhat_j
        dx -= xp.multiply(xhat, m, out=scratch)
        dx *= r
    if need_w:
        dw = sum_over_tokens(xp.multiply(g, xhat, out=scratch))
    if need_b:
        db = sum_over_tokens(g)
    return dx, dw, db


class CrossEntropy(Function):
    """loss_n = log(sum_v exp(z_nv)) - z_{n, t_n}: logits z (N, V), integer targets t (N,).

    Rows whose target equals ignore_index contribute 0 and get 0 gradient.
    reduction "mean" divides the sum by the number of counted rows (0 when
    there are none), "sum" does not, "none" returns one loss per row.
    Backward, per counted row with weight w_n (1/count, 1 or g_n):
        dz_n = w_n * (softmax(z_n) - onehot(t_n)).
    The softmax is computed once, in the forward, and reused.
    """

    @staticmethod
    def forward(ctx: Context, z: Any, *, t: Any, ignore_index: int, reduction: str) -> Any:
        losses = softmax_losses(ctx, z, t, ignore_index, reduction, sum_over_classes)
        if reduction == "none":
            return losses
        total = losses.sum()
        return total if reduction == "sum" else total / max(ctx.count, 1)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        p, t_safe, w = ctx.saved_tensors
        if ctx.reduction == "none":
            w = w * g
        else:
            w = w * (g if ctx.reduction == "sum" else g / max(ctx.count, 1))
        dz = p * w[:, None]
        dz[backend.xp.arange(p.shape[0]), t_safe] -= w
        return (dz,)


def sum_over_classes(p: Any) -> Any:
    """p (N, V) -> (N, 1): the sum over each row (NumPy's order)."""
    return p.sum(axis=1, keepdims=True)


def softmax_losses(ctx: Context, z: Any, t: Any, ignore_index: int, reduction: str,
                   row_sums) -> Any:
    """CrossEntropy's per-row losses (N,), 0 where ignored, the softmax's denominators
    added by row_sums (N, V) -> (N, 1); saves what its backward needs on ctx."""
    xp = backend.xp
    N = z.shape[0]
    rows = xp.arange(N)
    keep = t != ignore_index                                   # (N,) bool
    t_safe = xp.where(keep, t, 0)
    z_max = z.max(axis=1, keepdims=True)                       # (N, 1)
    p = xp.exp(z - z_max)
    sums = row_sums(p)
    p /= sums                                                  # softmax (N, V)
    losses = (xp.log(sums[:, 0]) + z_max[:, 0]) - z[rows, t_safe]
    w = keep.astype(z.dtype)                                   # 1 counted, 0 ignored
    losses[~keep] = 0     # not losses *= w: an ignored row's z[0] may be -inf (padding)
    ctx.save_for_backward(p, t_safe, w)
    ctx.reduction, ctx.count = reduction, int(keep.sum())
    return losses


class Gelu(Function):
    """GELU(x) = x * Phi(x), Phi the standard normal CDF.

    approximate="none":  y = x * Phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2
        dx = g * (Phi(x) + x * phi(x)),   phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    approximate="tanh" (GPT-2):  u = sqrt(2/pi) * (x + 0.044715 x^3),  t = tanh(u)
        y = x * (1 + t) / 2
        dx = g * ((1 + t) / 2 + x * (1 - t^2) / 2 * sqrt(2/pi) * (1 + 3 * 0.044715 x^2))
    """

    @staticmethod
    def forward(ctx: Context, x: Any, *, approximate: str = "tanh") -> Any:
        # In-place steps on fresh arrays: large temporaries cost more than the arithmetic.
        xp = backend.xp
        if approximate == "tanh":
            # tanh(u) = 1 - 2 / (exp(2u) + 1): NumPy's exp is vectorised, its tanh is not
            # (2.5x slower in float64); exp overflowing to inf still gives tanh = 1.
            s = x * x
            s *= 2.0 * _GELU_CUBIC * _SQRT_2_OVER_PI
            s += 2.0 * _SQRT_2_OVER_PI
            s *= x                                                 # s = 2u
            xp.exp(s, out=s)
            s += 1.0
            xp.divide(-2.0, s, out=s)
            s += 1.0                                               # s = tanh(u)
        else:
            s = backend.erf(x * _INV_SQRT_2)                       # s = 2 Phi(x) - 1
        ctx.save_for_backward(x, s)
        ctx.approximate = approximate
        y = s + 1.0
        y *= 0.5
        y *= x
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        x, s = ctx.saved_tensors
        if ctx.approximate == "tanh":
            d = x * x
            d *= 3.0 * _GELU_CUBIC
            d += 1.0
            d *= 0.5 * _SQRT_2_OVER_PI
            d *= x
            d *= 1.0 - s * s                                       # d = x (1 - t^2) du / 2
        else:
            d = x * x
            d *= -0.5
            backend.xp.exp(d, out=d)
            d *= _INV_SQRT_2PI
            d *= x                                                 # d = x phi(x)
        d += 0.5 * s
        d += 0.5                                                   # d += (1 + s) / 2
        d *= g
        return (d,)


class Linear(Function):
    """y = x @ W + b in one node: x (..., C), W (C, F), b (F,) -> y (..., F).

    The same numbers as MatMul then Add, bit for bit: the bias is added into the GEMM's
    fresh output in place instead of into a second (..., F) array. That array would be
    memory no pass has touched lately, and writing it costs more than the add (a 2 MB add
    measured 103 us into a new array, 23 us in place). Backward: MatMul's rule for dx and
    dW (matmul_grads), and db = unbroadcast(g), the sum over the leading axes, as Add's.
    """

    @staticmethod
    def forward(ctx: Context, x: Any, w: Any, b: Any) -> Any:
        ctx.save_for_backward(x, w)
        ctx.bias_shape = b.shape
        y = mm(x, w)                                               # (..., F), ours
        if backend.xp.result_type(y, b) != y.dtype:                # b wider: as Add does
            return y + b
        y += b
        return y

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        dx, dw = matmul_grads(x, w, g, need_x, need_w)
        return dx, dw, unbroadcast(g, ctx.bias_shape) if need_b else None
