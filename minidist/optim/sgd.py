"""SGD with momentum and (coupled, L2) weight decay.

Per parameter p with gradient g, learning rate lr, momentum mu, decay wd:

    d   = g + wd * p            (L2 penalty wd/2 |p|^2 folded into the gradient)
    buf = mu * buf + d          (buf starts at 0, so the first step has buf = d)
    p   = p - lr * buf          (with mu = 0: p = p - lr * d, and no buffer at all)

This matches torch.optim.SGD with dampening 0 and nesterov off.

Reference: Sutskever et al. 2013, "On the importance of initialization and
momentum in deep learning", ICML, Eq. 1-2 (here in the PyTorch form).
Read next: optim/adamw.py
"""

from __future__ import annotations

from typing import Any, Iterable

from minidist import backend
from minidist.optim.optimizer import Optimizer


def sgd_step(p: Any, g: Any, buf: Any, *, lr: float, momentum: float,
             weight_decay: float) -> None:
    """One SGD step on the array p, in place (and on buf, in place, when momentum != 0).

    g is not modified. buf may be None when momentum == 0.
    """
    d = g if weight_decay == 0 else g + weight_decay * p
    if momentum != 0:
        if buf is None:
            raise ValueError("sgd_step: momentum != 0 needs a buffer (zeros like p), got None.")
        buf *= momentum
        buf += d
        d = buf
    p -= lr * d


class SGD(Optimizer):
    """SGD(params, lr, momentum=0.0, weight_decay=0.0); see the module docstring."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: momentum={momentum} and weight_decay={weight_decay} "
                             "must both be >= 0.")
        self.momentum, self.weight_decay = momentum, weight_decay
        xp = backend.xp
        self.buffers = [xp.zeros_like(p.data) for p in self.params] if momentum else []

    def step(self) -> None:
        """Update every parameter that has a gradient."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self.buffers[i] if self.momentum else None
            sgd_step(p.data, p.grad, buf, lr=self.lr, momentum=self.momentum,
                     weight_decay=self.weight_decay)

    def state_dict(self) -> dict:
        """{"momentum_buffer.i": array} for each parameter i (empty without momentum)."""
        return {f"momentum_buffer.{i}": b.copy() for i, b in enumerate(self.buffers)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum buffers (copied in place)."""
        self._load_arrays(state, "momentum_buffer", self.buffers)
