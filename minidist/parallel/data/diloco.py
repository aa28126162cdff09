"""DiLoCo (local SGD with an outer optimizer): synchronise every H steps instead of every step.

Data parallelism sums the gradients over the W dp ranks at every step: 2 (W-1)/W Psi numbers
a rank sends per step. Across nodes that is the slow link's bill, step after step. Local SGD
lets each replica train alone for H steps and only then averages what the replicas
learned; DiLoCo (Douillard et al. 2023) treats that average as a gradient for an outer
optimizer, Nesterov momentum, which recovers most of what synchronising every step gives.

One rank's view (rank r of the W dp ranks; theta: this rank's parameters, theta_0 the
anchor, the parameters every replica agreed on at the last outer step):
    inner step (every step): the local gradient g_r of my rows, scaled by W (the loss of a
        micro-batch is divided by the GLOBAL batch's token count, so W g_r is the gradient
        of my rows' mean loss: what one replica training alone would see); clip by its
        norm; one step of the inner optimizer (AdamW, or SGD), whose state stays local.
        No communication.
    outer step (after every H inner steps):
        delta_r   = theta_0 - theta                      (what I learned, as a descent)
        delta     = (1/W) sum_r delta_r                  (all_reduce(sum) over dp, / W)
        v         = mu v + delta                          (Nesterov momentum, mu = 0.9)
        theta_0   = theta_0 - eta (delta + mu v)          (outer lr eta = 0.7)
        theta     = theta_0 on every replica.
Communication: one all-reduce of each parameter per H steps, in DataParallel's order and
with its algorithm: exactly DDP's bytes for one step, so 1/H of DDP's per step on average
(and none at all in the H - 1 steps between).
With H = 1, SGD inside (no momentum, no weight decay) and an outer SGD of lr 1 without
momentum, the outer step is theta_0 - (1/W) sum_r lr W g_r = theta_0 - lr sum_r g_r: DDP's
SGD step, up to rounding (tests/parallel/data/test_diloco.py).

Not an exact method: between outer steps the replicas differ, so `full_params` (and the
inner optimizer's state) are this rank's replica's (equal on every rank right after an outer step), and the global gradient
norm DDP returns is not known: `step` returns this rank's (scaled) gradient norm.
Reference: Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
    Language Models", arXiv:2311.08105 (Algorithm 1; outer Nesterov, lr 0.7, momentum 0.9);
    Stich 2019, "Local SGD Converges Fast and Communicates Little", ICLR.
Read next: parallel/data/ddp.py (every step's sum).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minidist import backend, collectives as C
from minidist.nn import Module
from minidist.optim import make_optimizer
from minidist.parallel.engine import ReplicatedEngine


class DiLoCo(ReplicatedEngine):
    """Local steps on each dp replica, an outer Nesterov step on their mean every H steps;
    the engine interface of parallel/engine.py (the module docstring has the algorithm)."""

    def __init__(self, model: Module, group, *, local_steps: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, optimizer: str = "adamw", lr: float = 1e-3,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 momentum: float = 0.0, algo: str = "auto", sharding=None) -> None:
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"DiLoCo: local_steps={local_steps!r} must be an int >= 1 (the "
                             "inner steps between two outer steps).")
        if not (outer_lr > 0 and 0 <= outer_momentum < 1):
            raise ValueError(f"DiLoCo: outer_lr={outer_lr} must be > 0 and outer_momentum="
                             f"{outer_momentum} in [0, 1).")
        self.model, self.group, self.sharding = model, group, sharding
        self.H, self.eta, self.mu = local_steps, outer_lr, outer_momentum
        named = list(model.named_parameters())
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.opt = make_optimizer(optimizer, self.params, lr, weight_decay, betas, momentum)
        shared = getattr(group, "supports_shared", False)
        self.algo = "direct" if algo == "auto" and shared else algo
        self.anchor = [backend.to_numpy(p.data).copy() for p in self.params]    # theta_0
        self.velocity = [np.zeros_like(a) for a in self.anchor]
        self.inner = 0                           # inner steps since the last outer step

    # --- what train.py calls (forward and the full state: ReplicatedEngine's) ---
    def step(self, lr: float, clip_grad: float | None = None,
             skip: Callable[[float], bool] | None = None) -> float:
        """One inner step on my rows' gradient (x W), then the outer step every H-th call.
        Returns the norm of that local gradient (module docstring)."""
        W = self.group.size
        grads = self.local_gradients(lambda i, g: g * W)
        norm = self.grad_norm(grads)
        self.update(grads, norm, lr, clip_grad, skip)
        self.inner += 1
        if self.inner == self.H:
            self.outer_step()
        return norm

    def outer_step(self) -> None:
        """COLLECTIVE over dp: average the replicas' progress, one Nesterov step from the
        anchor, every replica back on the new anchor (module docstring)."""
        W = self.group.size
        for i in reversed(range(len(self.params))):     # DataParallel's order and algorithm
            p = self.params[i]
            delta = self.anchor[i] - backend.to_numpy(p.data)
            mean = C.all_reduce(delta, op="sum", group=self.group, algo=self.algo) / W
            self.velocity[i] = self.mu * self.velocity[i] + mean
            self.anchor[i] = self.anchor[i] - self.eta * (mean + self.mu * self.velocity[i])
            p.data[...] = backend.xp.asarray(self.anchor[i])
        self.inner = 0

    def load_full_state(self, params: dict, optimizer_state: dict) -> None:
        """My pieces of the global state, taken as a fresh anchor (outer momentum zero)."""
        local, state = self._local_full_state(params, optimizer_state)
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            p.data[...] = backend.xp.asarray(local[n])
            self.anchor[i] = np.array(local[n], copy=True)
            self.velocity[i] = np.zeros_like(self.anchor[i])
        self.opt.load_state_dict(state)
        self.inner = 0

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, the inner optimizer's state and, as outer
        state, the anchor and the velocity (2 Psi more than DDP)."""
        state = self.opt.state_dict()
        return {"params": sum(int(p.data.nbytes) for p in self.params), "grads": 0,
                "optimizer": sum(int(a.nbytes) for a in state.values()
                                 if isinstance(a, np.ndarray))
                + sum(a.nbytes + v.nbytes for a, v in zip(self.anchor, self.velocity))}
