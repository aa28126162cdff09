"""Loss spikes: notice a step whose loss or gradient norm jumps, and decide what to do.

Large runs see sudden loss spikes, from bad data, a numerical blow-up or a faulty
machine. PaLM (Chowdhery et al. 2022, sec. 5.1) restarted ~100 steps before each spike
and skipped 200-500 batches; OPT and others skip the update; Megatron-LM's re-run state
machine runs a suspicious step again to tell a transient fault (the rerun is fine) from
bad data (it spikes again).

The detector (`Detector`) keeps exponential running means of the loss and the gradient
norm and of their squared deviations (decay beta = 0.95, about the last 20 steps):

    mean_t = beta mean_{t-1} + (1 - beta) x_t,   var_t = beta var_{t-1} + (1 - beta)(x_t - mean_{t-1})^2

A step is a spike when its loss or norm is not finite, or, after WARMUP steps (the early
loss falls fast and says nothing), when it exceeds mean + K sigma with K = 6 and sigma
floored at 2 % of the mean (a plateau has no variance, and a 1e-6 wiggle is no spike).
Only accepted steps update the statistics, so a spike does not raise its own bar.

Policies (`--spike`):
    detect    log the spike, apply the step anyway
    skip      do not apply the update: the gradients are zeroed, parameters and optimizer
              state are untouched (engine.step's skip); the run goes on with the next batch
    rollback  stop every rank (SpikeDetected), and let recovery restart from the latest
              checkpoint with the data moved on by --spike-skip-batches batches (PaLM):
              step s then trains on the batch of index s + offset (data.py addresses
              batches by index), the offset is kept in later checkpoints
    rerun     zero the gradients and compute the same step again (same batch, same
              dropout): a rerun that is not a spike was a transient fault and is
              applied; a second spike is bad data, and the step is skipped

One rank's view (train.py calls `Guard.step` in place of engine.step): all-reduce the
step's loss (8 bytes; the detector needs the global loss before the update), then
engine.step(lr, clip, skip=decide): `decide(norm)` runs the detector on (loss, norm).
Every rank sees the same global loss and norm and runs the same detector, so every rank
decides the same without further communication.

Read next: reliability/straggler.py
"""

from __future__ import annotations

import math
from typing import Callable

POLICIES = ("off", "detect", "skip", "rollback", "rerun")
BETA, K, WARMUP, REL_FLOOR = 0.95, 6.0, 10, 0.02


class SpikeDetected(RuntimeError):
    """Raised on every rank under the rollback policy: restart from a checkpoint."""


class Detector:
    """Running mean and deviation of the loss and the gradient norm (module docstring)."""

    def __init__(self, beta: float = BETA, k: float = K, warmup: int = WARMUP,
                 rel_floor: float = REL_FLOOR):
        self.beta, self.k, self.warmup, self.rel_floor = beta, k, warmup, rel_floor
        self.seen = 0
        self.mean = {"loss": 0.0, "norm": 0.0}
        self.var = {"loss": 0.0, "norm": 0.0}

    def check(self, loss: float, norm: float) -> str | None:
        """Why (loss, norm) is a spike, or None; does not change the statistics."""
        for name, x in (("loss", loss), ("norm", norm)):
            if not math.isfinite(x):
                return f"{name} is {x}"
        if self.seen < self.warmup:
            return None
        for name, x in (("loss", loss), ("grad norm", norm)):
            key = "loss" if name == "loss" else "norm"
            sigma = max(math.sqrt(self.var[key]), self.rel_floor * abs(self.mean[key]))
            bar = self.mean[key] + self.k * sigma
            if x > bar:
                return (f"{name} {x:.4g} > mean {self.mean[key]:.4g} + {self.k:g} sigma "
                        f"({sigma:.3g}) = {bar:.4g}")
        return None

    def state_dict(self) -> dict:
        """The statistics, JSON-able (floats round-trip exactly): what a checkpoint keeps so
        that a resumed run judges its next step as the uninterrupted run would."""
        return {"seen": self.seen, "mean": dict(self.mean), "var": dict(self.var)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = int(state["seen"])
        self.mean = {k: float(state["mean"][k]) for k in ("loss", "norm")}
        self.var = {k: float(state["var"][k]) for k in ("loss", "norm")}

    def accept(self, loss: float, norm: float) -> None:
        """Fold an applied step into the statistics."""
        b = self.beta
        for key, x in (("loss", loss), ("norm", norm)):
            if self.seen == 0:
                self.mean[key] = x
            else:
                d = x - self.mean[key]
                self.mean[key] += (1 - b) * d
                self.var[key] = b * self.var[key] + (1 - b) * d * d
        self.seen += 1


class Guard:
    """One rank's spike handling under a policy (see the module docstring). `log(line)` is
    called with what happened (rank 0 prints it)."""

    def __init__(self, policy: str, log: Callable[[str], None]):
        if policy not in POLICIES or policy == "off":
            raise ValueError(f"--spike {policy!r}: use one of {', '.join(POLICIES[1:])}")
        self.policy, self.log, self.detector = policy, log, Detector()
        self.skipped: list[int] = []

    def state_dict(self) -> dict:
        """The detector's statistics and the skipped steps (a checkpoint keeps them)."""
        return {"detector": self.detector.state_dict(), "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.skipped = [int(s) for s in state["skipped"]]

    def step(self, step: int, engine, lr: float, clip: float | None, global_loss: float,
             rerun: Callable[[], float]) -> tuple[float, float]:
        """Update (or not) under the policy; returns (norm, the step's global loss).
        rerun() computes the step's gradients again and returns its global loss."""
        why: list[str | None] = [None]

        def decide(norm: float) -> bool:
            why[0] = self.detector.check(global_loss, norm)
            return why[0] is not None and self.policy != "detect"

        norm = engine.step(lr, clip, skip=decide)
        if why[0] is None:
            self.detector.accept(global_loss, norm)
            return norm, global_loss
        self.log(f"spike at step {step}: {why[0]}; policy {self.policy}")
        if self.policy == "detect":
            return norm, global_loss
        if self.policy == "rollback":
            raise SpikeDetected(f"loss spike at step {step} ({why[0]}): rolling back")
        if self.policy == "rerun":
            global_loss = rerun()
            norm = engine.step(lr, clip, skip=decide)
            if why[0] is None:
                self.log(f"spike at step {step}: the rerun is normal (a transient fault); "
                         "its update is applied")
                self.detector.accept(global_loss, norm)
                return norm, global_loss
            self.log(f"spike at step {step}: the rerun spikes again ({why[0]}): bad data, "
                     "the step is skipped")
        self.skipped.append(step)
        return norm, global_loss
