"""fp32 master weights: the optimizer updates an fp32 copy; the model gets its rounding.

A 16-bit weight cannot take a small update: lr * m / sqrt(v) is often below half an ulp of
the weight it is added to, and it would vanish. So the optimizer steps an fp32 MASTER copy
of every object it updates (its m and v are fp32 too), and after each step the model's
low-precision copy is rounded from it in place (Micikevicius et al. 2018, Sec. 3.1).

`MasterWeights(params, dtype, make)` is an optimizer (the interface of optim.Optimizer:
lr, step, zero_grad, state_dict, load_state_dict) over `params`, the objects an engine
updates (DDP: Parameters; ZeRO: the FlatShard of each unit, so the master copy and m, v
are sharded exactly like the shards), built around the real optimizer `make(masters)`:
    step():  master.grad = fp32(p.grad) / S     (inv_scale: 1 / S of fp16 loss scaling)
             the real optimizer's step on the masters
             p.data[...] = round(master)        (in the dtype p is stored in)
Its users: memory/mixed_precision.py's MixedPrecision (any engine, any layout) and
baseline.py's single process under a precision policy.

Memory (per rank, Ψ parameters on this rank's engine, AdamW, grad_reduce "low"): model copy
2Ψ + gradients 2Ψ + master 4Ψ + m 4Ψ + v 4Ψ: ZeRO's 2Ψ + 2Ψ + KΨ with K = 12
(Rajbhandari et al. 2020, Sec. 3.1), each term divided by N_d where the stage shards it
(parallel/zero/memory.py). grad_reduce "fp32" stores parameters and gradients in 4 bytes.

References: Micikevicius et al. 2018, arXiv:1710.03740, Sec. 3.1 (master copy);
    Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 3.1 (K = 12).
Read next: memory/mixed_precision.py.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class _Master:
    """One fp32 master array with its .grad: what the real optimizer sees."""

    __slots__ = ("data", "grad")

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.grad = data, None


class MasterWeights:
    """The engine's optimizer, in fp32: steps master copies of `params` and writes their
    rounding back. Same interface as optim.Optimizer (lr, step, state_dict, ...)."""

    def __init__(self, params: list, dtype: np.dtype, make: Callable[[list], Any]) -> None:
        self.params, self.dtype = list(params), np.dtype(dtype)
        self.master = [_Master(np.asarray(p.data, np.float32).copy()) for p in self.params]
        self.inner = make(self.master)
        self.inv_scale = 1.0                  # 1 / S of the step being taken

    lr = property(lambda self: self.inner.lr,
                  lambda self, value: setattr(self.inner, "lr", value))

    def step(self) -> None:
        """master.grad = fp32(g) / S; the real step on the masters; params = round(master)."""
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else \
                p.grad.astype(np.float32) * np.float32(self.inv_scale)
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.data[...] = m.data.astype(self.dtype)           # round, then store
            m.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """The real optimizer's state (fp32 m, v or momentum), in its usual layout."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    @property
    def master_bytes(self) -> int:
        return sum(int(m.data.nbytes) for m in self.master)
