"""Gradient clipping by global norm.

The global norm is the 2-norm of all gradients taken as one long vector:

    ||g|| = sqrt( sum over arrays k of sum_i g_k,i^2 )

If it exceeds max_norm, every gradient is scaled by max_norm / (||g|| + 1e-6),
so the direction of the update is kept and only its length shrinks. The
1e-6 keeps the division safe and matches torch.nn.utils.clip_grad_norm_.

Under sharding (ZeRO, tensor parallel) each rank sums the squares of its own
shards and the partial sums are all-reduced before the sqrt; this module is
the single-process version those are tested against.

Reference: Pascanu, Mikolov & Bengio 2013, arXiv:1211.5063, Sec. 3.2 (Alg. 1).
Read next: optim/schedule.py
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from minidist import backend


def wide(x: Any) -> Any:
    """x as float32 if it is stored in fewer than 4 bytes (bf16, fp16: memory/precision.py),
    else x itself: sums of squares of 16-bit gradients overflow (fp16) or lose their
    digits (bf16) if accumulated in 16 bits."""
    return x.astype("float32") if x.dtype.itemsize < 4 else x


def global_grad_norm(grads: Sequence[Any]) -> float:
    """sqrt(sum of squares of every element of every array in grads); None entries skipped.

    Arrays are visited in list order, so the result is the same on every run.
    """
    xp = backend.xp
    total = 0.0
    for g in grads:
        if g is not None:
            flat = wide(g.reshape(-1))
            total += float(xp.dot(flat, flat))
    return math.sqrt(total)


def clip_grad_norm(params: Iterable[Any], max_norm: float) -> float:
    """Scale the .grad of params in place so their global norm is at most max_norm.

    Returns the norm before clipping. Gradients are left untouched when the
    norm is already <= max_norm.
    """
    if max_norm <= 0:
        raise ValueError(f"clip_grad_norm: max_norm={max_norm}; it must be > 0.")
    grads = [p.grad for p in params if p.grad is not None]
    norm = global_grad_norm(grads)
    clip_to(grads, norm, max_norm)
    return norm


def clip_to(grads: Sequence[Any], norm: float, max_norm: float | None) -> None:
    """Scale grads in place by max_norm / (norm + 1e-6) if norm > max_norm (None: never).

    `norm` is the GLOBAL norm: the engines compute it over every shard and replica
    (parallel/sharding.py) and every rank then scales its own pieces by the same factor.
    """
    if max_norm is None:
        return
    if not max_norm > 0:
        raise ValueError(f"clip: max_norm={max_norm}; it must be > 0 or None.")
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            if g is not None:
                g *= scale
