"""NumPy twins of the fused kernels: what each kernel must compute, in float64.

Every kernel in gpu/kernels/ is checked against the function of the same name here
(emulate/cases.py does the comparing). Where the autograd already has the op, the twin
calls its forward and backward rules (autograd/fused.py, optim/adamw.py), so the kernel is
held to the numbers the CPU training path produces, not to a second copy of the formulas.
Two twins are new: the causal mask of the attention softmax, and attention itself, both as
the plain formula (`attention`) and as the tiled online softmax the kernel runs
(`flash_attention`, Dao et al. 2022, arXiv:2205.14135, Algorithm 1), so that a reader can
step through the algorithm in NumPy and see it give the plain formula's numbers.

One twin's view: take the kernel's float32 inputs, compute in float64, return the outputs
the kernel writes, with the same names and shapes (e.g. layernorm_forward returns y, mean
and rstd, because the kernel writes all three).

Shapes: as the kernels (gpu/kernels/*.cu): rows (N, C), scores (R, T) with query position
r % T, heads (BH, T, D).
Read next: gpu/fused.py, emulate/cases.py
"""

from __future__ import annotations

import math

import numpy as np

from minidist.autograd.tensor import Context
from minidist.autograd.fused import CrossEntropy, Gelu, LayerNorm, Softmax
from minidist.optim.adamw import adamw_step


def _ctx(n_inputs: int) -> Context:
    ctx = Context()
    ctx.needs_input_grad = [True] * n_inputs
    return ctx


def _f64(*arrays: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(a, np.float64) for a in arrays]


def layernorm_forward(x, w, b, eps: float = 1e-5) -> dict:
    """y = LayerNorm(x) * w + b over the last axis; also mean and rstd = 1/sqrt(var + eps)."""
    x, w, b = _f64(x, w, b)
    ctx = _ctx(3)
    y = LayerNorm.forward(ctx, x, w, b, eps=eps)
    return {"y": y, "mean": x.mean(axis=-1), "rstd": ctx.saved_tensors[1][..., 0]}


def layernorm_backward(dy, x, w, b, eps: float = 1e-5) -> dict:
    """dx, dw, db of sum(dy * LayerNorm(x; w, b))."""
    dy, x, w, b = _f64(dy, x, w, b)
    ctx = _ctx(3)
    LayerNorm.forward(ctx, x, w, b, eps=eps)
    dx, dw, db = LayerNorm.backward(ctx, dy)
    return {"dx": dx, "dw": dw, "db": db}


def bias_gelu_forward(x, bias) -> dict:
    """y = gelu_tanh(x + bias), bias broadcast over the rows."""
    x, bias = _f64(x, bias)
    return {"y": Gelu.forward(_ctx(1), x + bias, approximate="tanh")}


def bias_gelu_backward(dy, x, bias) -> dict:
    """dx = dy * gelu_tanh'(x + bias) and dbias = dx summed over the rows."""
    dy, x, bias = _f64(dy, x, bias)
    ctx = _ctx(1)
    Gelu.forward(ctx, x + bias, approximate="tanh")
    (dx,) = Gelu.backward(ctx, dy)
    return {"dx": dx, "dbias": dx.reshape(-1, dx.shape[-1]).sum(axis=0)}


def causal_mask(R: int, T: int) -> np.ndarray:
    """(R, T) bool: row r may see column j when j <= r % T (r = ((b*H + h)*T + i))."""
    return np.arange(T)[None, :] <= (np.arange(R) % T)[:, None]


def softmax_forward(x, scale: float) -> dict:
    """y = softmax(scale * x) over each row's visible columns, 0 on the masked ones."""
    (x,) = _f64(x)
    scores = np.where(causal_mask(*x.shape), scale * x, -np.inf)
    return {"y": Softmax.forward(_ctx(1), scores)}


def softmax_backward(dy, x, scale: float) -> dict:
    """dx of sum(dy * softmax_forward(x, scale)): the scale times Softmax's backward."""
    dy, x = _f64(dy, x)
    ctx = _ctx(1)
    Softmax.forward(ctx, np.where(causal_mask(*x.shape), scale * x, -np.inf))
    (dscores,) = Softmax.backward(ctx, dy)
    return {"dx": scale * dscores}


def cross_entropy(logits, targets, reduction: str = "mean", ignore_index: int = -100) -> dict:
    """Per-row losses, the reduced loss, and dlogits = d loss / d logits (CrossEntropy)."""
    (z,) = _f64(logits)
    t = np.asarray(targets, np.int64)
    losses = CrossEntropy.forward(_ctx(1), z, t=t, ignore_index=ignore_index, reduction="none")
    ctx = _ctx(1)
    loss = CrossEntropy.forward(ctx, z, t=t, ignore_index=ignore_index, reduction=reduction)
    (dz,) = CrossEntropy.backward(ctx, np.float64(1.0))
    return {"losses": losses, "loss": np.asarray(loss), "dlogits": dz}


def adamw(params, grads, ms, vs, *, lr: float, b1: float, b2: float, eps: float, wd: float,
          t: int) -> dict:
    """One AdamW step (optim.adamw.adamw_step) on float64 copies of every tensor."""
    out = {"p": [], "m": [], "v": []}
    for p, g, m, v in zip(params, grads, ms, vs):
        p, g, m, v = _f64(p, g, m, v)
        p, m, v = p.copy(), m.copy(), v.copy()
        adamw_step(p, g, m, v, lr=lr, b1=b1, b2=b2, eps=eps, wd=wd, t=t)
        out["p"].append(p), out["m"].append(m), out["v"].append(v)
    return out


def attention(q, k, v, causal: bool = True, scale: float | None = None) -> dict:
    """o = softmax(scale q k^T + mask) v and lse = log sum exp of the scores; (BH, T, D)."""
    q, k, v = _f64(q, k, v)
    T, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = scale * q @ np.swapaxes(k, -1, -2)                               # (BH, T, T)
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    return {"o": (e / l) @ v, "lse": (m + np.log(l))[..., 0]}           # (BH, T, D), (BH, T)


def flash_attention(q, k, v, causal: bool = True, scale: float | None = None,
                    block_q: int = 32, block_k: int = 32) -> dict:
    """attention() computed tile by tile with the online softmax (FlashAttention, Alg. 1).

    For each tile of block_q query rows, walk the tiles of block_k keys, keeping per row a
    running max m, sum l and unnormalised output acc:
        m_new = max(m, rowmax(S)),  c = exp(m - m_new),  P = exp(S - m_new)
        l = c l + rowsum(P),        acc = c acc + P V_tile,   m = m_new
    then o = acc / l and lse = m + log l. The kernel takes the keys of a tile one at a
    time (the same update with a tile of one key); both equal the plain formula.
    """
    q, k, v = _f64(q, k, v)
    BH, T, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o, lse = np.empty_like(q), np.empty((BH, T))
    for q0 in range(0, T, block_q):
        rows = np.arange(q0, min(q0 + block_q, T))
        m = np.full((BH, len(rows), 1), -np.inf)
        l, acc = np.zeros((BH, len(rows), 1)), np.zeros((BH, len(rows), D))
        kv_end = min(T, q0 + block_q) if causal else T
        for k0 in range(0, kv_end, block_k):
            cols = np.arange(k0, min(k0 + block_k, kv_end))
            s = scale * q[:, rows] @ np.swapaxes(k[:, cols], -1, -2)      # (BH, rows, cols)
            if causal:
                s = np.where(cols[None, :] <= rows[:, None], s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            c, p = np.exp(m - m_new), np.exp(s - m_new)
            l = c * l + p.sum(axis=-1, keepdims=True)
            acc = c * acc + p @ v[:, cols]
            m = m_new
        o[:, rows] = acc / l
        lse[:, rows] = (m + np.log(l))[..., 0]
    return {"o": o, "lse": lse}
