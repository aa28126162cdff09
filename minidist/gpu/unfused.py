"""The unfused ops: the fused kernels' computations as one simple kernel per step.

This is what fusion is measured against. Each function below computes what its fused
namesake in gpu/fused.py computes, as a framework without fusion would: one launch per
NumPy-like step, every intermediate written to global memory and read back by the next
launch (kernels in gpu/kernels/unfused.cu). The tests check that both give the twin's
numbers; dev.launches then shows the launch counts side by side, and the compulsory
bytes of each version are written in the kernel files' headers (and computed in
hardware/roofline.py). The LayerNorm backward is its twin's own passes, one kernel per
NumPy expression of autograd/fused.LayerNorm.backward, so its launches and the bytes of
each are exactly hardware/op_costs.layernorm_backward's unfused count (a test checks it):

    op                  fused launches   unfused launches   unfused intermediates
    LayerNorm forward   1                4                  mean, rstd, xhat (N, C)
    LayerNorm backward  2                11                 dxhat, dx, a product (N, C)
    bias + GeLU fwd     1                2                  u = x + bias (N, C)
    bias + GeLU bwd     2                3                  u, du (N, C)
    causal softmax      1                5                  s, exp (R, T), max, sum
    softmax backward    1                2                  rowsum(dy * y)
    cross-entropy       1                5                  exp (N, V), max, sum
    AdamW               1                2 per tensor       (none: m, v read twice)
    attention           1                7                  scores, probabilities (BH, T, T)

One op's view (e.g. layernorm_forward): allocate every intermediate, launch the steps in
order on the same device, return the op's outputs. Same Device protocol as fused.py.
Read next: emulate/cases.py
"""

from __future__ import annotations

from typing import Any, Sequence

from minidist.gpu.fused import Device, ce_dloss, ce_setup, check_block, grid_for, rows_of

U = "unfused.cu"


def layernorm_forward(dev: Device, x: Any, w: Any, b: Any, eps: float = 1e-5, *,
                      block: int = 128) -> tuple[Any, Any, Any, Any]:
    """(y, mean, rstd, xhat) by row_mean, row_rstd, normalize, scale_shift: mean and rstd
    as the fused kernel writes them, and xhat, which the twin keeps for its backward."""
    N, C = rows_of(x, "unfused layernorm_forward")
    check_block(block, "unfused layernorm_forward", warp_multiple=False)
    mean, rstd = dev.empty((N,)), dev.empty((N,))
    xhat, y = dev.empty(x.shape), dev.empty(x.shape)
    dev.launch(U, "row_mean", grid_for(N, block), block, (x, mean, N, C))
    dev.launch(U, "row_rstd", grid_for(N, block), block, (x, mean, rstd, N, C, eps))
    dev.launch(U, "normalize", grid_for(N * C, block), block, (x, mean, rstd, xhat, N * C, C))
    dev.launch(U, "scale_shift", grid_for(N * C, block), block, (xhat, w, b, y, N * C, C))
    return y, mean, rstd, xhat


def layernorm_backward(dev: Device, dy: Any, xhat: Any, w: Any, rstd: Any, *,
                       block: int = 128) -> tuple[Any, Any, Any]:
    """(dx, dw, db) from the forward's xhat and rstd by LayerNorm.backward's 11 passes:
    dxhat = dy * w; dx = dxhat - mean(dxhat); dx -= xhat * mean(dxhat * xhat); dx *= rstd;
    dw = column sums of dy * xhat; db = column sums of dy."""
    N, C = rows_of(xhat, "unfused layernorm_backward")
    check_block(block, "unfused layernorm_backward", warp_multiple=False)
    n, each, rows, cols = N * C, grid_for(N * C, block), grid_for(N, block), grid_for(C, block)
    dxhat, dx, t = dev.empty(xhat.shape), dev.empty(xhat.shape), dev.empty(xhat.shape)
    m1, m2, dw, db = dev.empty((N,)), dev.empty((N,)), dev.empty((C,)), dev.empty((C,))
    dev.launch(U, "column_multiply", each, block, (dy, w, dxhat, n, C))    # dxhat = dy * w
    dev.launch(U, "row_mean", rows, block, (dxhat, m1, N, C))
    dev.launch(U, "row_subtract", each, block, (dxhat, m1, dx, n, C))      # dx = dxhat - m1
    dev.launch(U, "multiply", each, block, (dxhat, xhat, t, n))            # t = dxhat * xhat
    dev.launch(U, "row_mean", rows, block, (t, m2, N, C))
    dev.launch(U, "row_multiply", each, block, (xhat, m2, t, n, C))        # t = xhat * m2
    dev.launch(U, "subtract", each, block, (dx, t, dx, n))                 # dx -= t
    dev.launch(U, "row_multiply", each, block, (dx, rstd, dx, n, C))       # dx *= rstd
    dev.launch(U, "multiply", each, block, (dy, xhat, t, n))               # t = dy * xhat
    dev.launch(U, "column_sum", cols, block, (t, dw, N, C))
    dev.launch(U, "column_sum", cols, block, (dy, db, N, C))
    return dx, dw, db


def bias_gelu_forward(dev: Device, x: Any, bias: Any, *, block: int = 256) -> Any:
    """y = gelu(x + bias) by add_bias, gelu_forward."""
    N, C = rows_of(x, "unfused bias_gelu_forward")
    u, y = dev.empty(x.shape), dev.empty(x.shape)
    dev.launch(U, "add_bias", grid_for(N * C, block), block, (x, bias, u, N * C, C))
    dev.launch(U, "gelu_forward", grid_for(N * C, block), block, (u, y, N * C))
    return y


def bias_gelu_backward(dev: Device, dy: Any, x: Any, bias: Any, *,
                       block: int = 128) -> tuple[Any, Any]:
    """(dx, dbias) by add_bias (u again), gelu_backward, column_sum."""
    N, C = rows_of(x, "unfused bias_gelu_backward")
    u, dx, dbias = dev.empty(x.shape), dev.empty(x.shape), dev.empty((C,))
    dev.launch(U, "add_bias", grid_for(N * C, block), block, (x, bias, u, N * C, C))
    dev.launch(U, "gelu_backward", grid_for(N * C, block), block, (dy, u, dx, N * C))
    dev.launch(U, "column_sum", grid_for(C, block), block, (dx, dbias, N, C))
    return dx, dbias


def softmax_forward(dev: Device, x: Any, scale: float, *, causal: bool = True,
                    block: int = 128) -> Any:
    """y = softmax(scale * x + mask) by scale_mask, row_max, exp_sub, row_sum, row_divide."""
    R, T = rows_of(x, "unfused softmax_forward")
    n = R * T
    s, e, y = dev.empty(x.shape), dev.empty(x.shape), dev.empty(x.shape)
    m, total = dev.empty((R,)), dev.empty((R,))
    dev.launch(U, "scale_mask", grid_for(n, block), block, (x, s, n, T, scale, int(causal)))
    dev.launch(U, "row_max", grid_for(R, block), block, (s, m, R, T))
    dev.launch(U, "exp_sub", grid_for(n, block), block, (s, m, e, n, T))
    dev.launch(U, "row_sum", grid_for(R, block), block, (e, total, R, T))
    dev.launch(U, "row_divide", grid_for(n, block), block, (e, total, y, n, T))
    return y


def softmax_backward(dev: Device, dy: Any, y: Any, scale: float, *, block: int = 128) -> Any:
    """dx = scale * y * (dy - rowsum(dy * y)) by row_dot, softmax_grad."""
    R, T = rows_of(y, "unfused softmax_backward")
    d, dx = dev.empty((R,)), dev.empty(y.shape)
    dev.launch(U, "row_dot", grid_for(R, block), block, (dy, y, d, R, T))
    dev.launch(U, "softmax_grad", grid_for(R * T, block), block,
               (dy, y, d, dx, R * T, T, scale))
    return dx


def cross_entropy(dev: Device, logits: Any, targets: Any, *, reduction: str = "mean",
                  ignore_index: int = -100, block: int = 128,
                  count: int | None = None) -> tuple[Any, Any, Any]:
    """(loss, losses, dlogits) by row_max, exp_sub, row_sum, ce_loss, ce_grad; logits kept.
    count: as fused.cross_entropy (from ce_setup; without it the targets are copied to the
    host and counted here)."""
    N, V = rows_of(logits, "unfused cross_entropy")
    if count is None:
        count, dloss = ce_setup(dev, targets, V, reduction, ignore_index)
    else:
        dloss = ce_dloss(count, reduction)
    m, total, losses = dev.empty((N,)), dev.empty((N,)), dev.empty((N,))
    e, dz = dev.empty(logits.shape), dev.empty(logits.shape)
    dev.launch(U, "row_max", grid_for(N, block), block, (logits, m, N, V))
    dev.launch(U, "exp_sub", grid_for(N * V, block), block, (logits, m, e, N * V, V))
    dev.launch(U, "row_sum", grid_for(N, block), block, (e, total, N, V))
    dev.launch(U, "ce_loss", grid_for(N, block), block,
               (logits, m, total, targets, losses, N, V, ignore_index))
    dev.launch(U, "ce_grad", grid_for(N * V, block), block,
               (e, total, targets, dz, N * V, V, dloss, ignore_index))
    loss = losses.sum() * (1.0 / max(count, 1) if reduction == "mean" else 1.0)
    return loss, losses, dz


def adamw(dev: Device, params: Sequence[Any], grads: Sequence[Any], ms: Sequence[Any],
          vs: Sequence[Any], *, lr: float, b1: float, b2: float, eps: float, wd: float,
          t: int, block: int = 256) -> None:
    """One AdamW step, tensor by tensor, by adam_moments then adam_param (in place)."""
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    for p, g, m, v in zip(params, grads, ms, vs):
        n = p.size
        dev.launch(U, "adam_moments", grid_for(n, block), block, (g, m, v, n, b1, b2))
        dev.launch(U, "adam_param", grid_for(n, block), block,
                   (p, m, v, n, lr, eps, wd, bc1, bc2))


def attention_forward(dev: Device, q: Any, k: Any, v: Any, *, causal: bool = True,
                      scale: float | None = None, block: int = 128) -> Any:
    """o = softmax(scale q k^T + mask) v with the (BH, T, T) scores in global memory."""
    T, D = q.shape[-2], q.shape[-1]
    rows_of(q, "unfused attention_forward")
    BH = q.size // (T * D) if T * D else 0
    s = dev.empty(q.shape[:-1] + (T,))
    dev.launch(U, "attn_scores", grid_for(BH * T * T, block), block, (q, k, s, BH, T, D))
    p = softmax_forward(dev, s, D ** -0.5 if scale is None else scale, causal=causal,
                        block=block)
    o = dev.empty(q.shape)
    dev.launch(U, "attn_apply", grid_for(BH * T * D, block), block, (p, v, o, BH, T, D))
    return o

