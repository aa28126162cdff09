"""AdamW: Adam with decoupled weight decay.

Per parameter p with gradient g at step t = 1, 2, ... (Loshchilov & Hutter
2019, arXiv:1711.05101, Algorithm 2, with the schedule multiplier folded into lr):

    m = b1 * m + (1 - b1) * g              first moment (mean of g)
    v = b2 * v + (1 - b2) * g^2            second moment (uncentred variance)
    m_hat = m / (1 - b1^t)                 bias corrections: m and v start at 0
    v_hat = v / (1 - b2^t)
    p = p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)

"Decoupled": the decay wd * p is added to the update, not to g, so it is not
rescaled by 1/sqrt(v_hat) -- large-gradient weights decay as fast as others.
This is the same update as torch.optim.AdamW (which multiplies p by 1 - lr*wd
first), up to rounding.

State per parameter: m and v (2 numbers per weight; ZeRO-1 shards exactly these),
plus the step count t shared by all parameters.
Read next: optim/clip.py, optim/schedule.py
"""

from __future__ import annotations

from typing import Any, Iterable

from minidist import backend
from minidist.optim.optimizer import Optimizer


def adamw_step(p: Any, g: Any, m: Any, v: Any, *, lr: float, b1: float, b2: float,
               eps: float, wd: float, t: int) -> None:
    """One AdamW step on the array p at step t >= 1, updating p, m and v in place."""
    if t < 1:
        raise ValueError(f"adamw_step: step t={t}; t counts from 1 (the bias correction "
                         "divides by 1 - b1^t, which is 0 at t = 0).")
    xp = backend.xp
    m *= b1
    m += (1.0 - b1) * g
    v *= b2
    v += (1.0 - b2) * (g * g)
    denom = xp.sqrt(v / (1.0 - b2 ** t))                   # sqrt(v_hat)
    denom += eps
    update = m / (1.0 - b1 ** t)                           # m_hat
    update /= denom
    if wd != 0:
        update += wd * p
    update *= lr
    p -= update


class AdamW(Optimizer):
    """AdamW(params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0) or eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW: betas={betas} must lie in [0, 1), eps={eps} and "
                             f"weight_decay={weight_decay} must be >= 0.")
        self.betas, self.eps, self.weight_decay = (b1, b2), eps, weight_decay
        xp = backend.xp
        self.m = [xp.zeros_like(p.data) for p in self.params]
        self.v = [xp.zeros_like(p.data) for p in self.params]
        self.t = 0

    def step(self) -> None:
        """Advance t by one and update every parameter that has a gradient."""
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            adamw_step(p.data, p.grad, m, v, lr=self.lr, b1=b1, b2=b2, eps=self.eps,
                       wd=self.weight_decay, t=self.t)

    def state_dict(self) -> dict:
        """{"step": t, "m.i": array, "v.i": array} for each parameter i (copies)."""
        state: dict = {"step": self.t}
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            state[f"m.{i}"], state[f"v.{i}"] = m.copy(), v.copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore t, m and v (m and v copied in place)."""
        self._load_arrays(state, "m", self.m)
        self._load_arrays(state, "v", self.v)
        self.t = int(state["step"])
