"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

    lr_at(s) = lr * s / W                                        for 0 <= s < W
    lr_at(s) = min_lr + (lr - min_lr) * (1 + cos(pi * q)) / 2    for W <= s < S,
               with q = (s - W) / (S - W)
    lr_at(s) = min_lr                                            for s >= S

W = warmup_steps, S = total_steps. The warmup starts from 0 at step 0 and
reaches the peak lr at s = W; the cosine then falls from lr (q = 0) to min_lr
(q = 1), reached at s = S. Warmup keeps the first Adam steps, whose second
moment estimate rests on few samples, small.

References: warmup -- Goyal et al. 2017, arXiv:1706.02677, Sec. 2.2; cosine decay --
Loshchilov & Hutter 2017 (SGDR), arXiv:1608.03983, Eq. 5 (without restarts).
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int,
          min_lr: float = 0.0) -> float:
    """The learning rate at `step` (counted from 0); formula in the module docstring."""
    if step < 0 or warmup_steps < 0 or total_steps < warmup_steps:
        raise ValueError(
            f"lr_at: need step >= 0 and 0 <= warmup_steps <= total_steps, got step={step}, "
            f"warmup_steps={warmup_steps}, total_steps={total_steps}."
        )
    if min_lr > lr:
        raise ValueError(f"lr_at: min_lr={min_lr} is above the peak lr={lr}.")
    if step < warmup_steps:
        return lr * step / warmup_steps
    if step >= total_steps:
        return min_lr
    q = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * q))
