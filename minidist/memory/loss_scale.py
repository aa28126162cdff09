"""Dynamic loss scaling: multiply the fp16 loss by S so small gradients do not flush to zero.

fp16 has 5 exponent bits: its smallest subnormal is 2^-24 ~ 6e-8 and its largest value
65504. Activation gradients of a trained network are often below 2^-24 and would round to
zero in the backward's fp16 GEMMs. Scaling the loss by S scales every gradient by S (the
chain rule is linear), lifting them into range; the optimizer divides by S again, in fp32,
before it uses them (Micikevicius et al. 2018, Sec. 3.2). bf16 keeps fp32's 8 exponent
bits and needs no scaling.

Too large an S overflows: some gradient becomes inf or NaN. Dynamic scaling finds S by
trial, as PyTorch's GradScaler does:
    - every step checks the gradients for inf/NaN;
    - found: SKIP the step (no parameter or optimizer-state change) and S *= 0.5;
    - not found: update as usual; after `growth_interval` (2000) such steps in a row,
      S *= 2 (probe upwards again). S starts at 2^16.
Powers of two keep x S and x / S exact.

Under data parallelism every rank must take the same decision, or the replicas part ways:
one rank skipping while the others step. The check is local (this rank's gradients, or
its shard of them under ZeRO), so the flag is all-reduced (max) over the gradient-sync
group: one 8-byte number per rank per step (memory/mixed_precision.found_inf_everywhere).

One rank's view of a step (scale S):
    1. forward; loss.backward() sees S * loss (`ScaleGrad`: identity forward, x S backward)
    2. the engine sums the (scaled) gradients over dp as usual
    3. found = all_reduce(max) over dp of "my gradients hold an inf/NaN"
    4. found: skip the update; else unscale (g / S in fp32) and update
    5. scaler.update(found): S and the good-step count, the same on every rank.

Reference: Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740,
    Sec. 3.2 (loss scaling); PyTorch torch.amp.GradScaler (init_scale 2^16, growth_factor
    2, backoff_factor 0.5, growth_interval 2000).
Read next: memory/master_weights.py, memory/mixed_precision.py (where the scaler is used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from minidist.autograd.tensor import Context, Function


@dataclass(frozen=True)
class ScalerConfig:
    """GradScaler's settings (PyTorch's defaults)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1
                and 0 < self.backoff_factor < 1) or isinstance(self.growth_interval, bool) \
                or not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ValueError(
                f"ScalerConfig: init_scale={self.init_scale} must be > 0, growth_factor="
                f"{self.growth_factor} > 1, backoff_factor={self.backoff_factor} in (0, 1) and "
                f"growth_interval={self.growth_interval!r} an int >= 1 (PyTorch: 65536, 2, "
                "0.5, 2000).")


class LossScaler:
    """The state machine: `scale` S, the good steps since the last change, the history.

    update(found_inf) -> True if the step was taken (no inf/NaN), False if skipped.
    history: one (scale used, stepped) per update, for plots and tests.
    """

    def __init__(self, config: ScalerConfig = ScalerConfig()) -> None:
        self.config = config
        self.scale = float(config.init_scale)
        self.good_steps = 0
        self.history: list[tuple[float, bool]] = []

    def update(self, found_inf: bool) -> bool:
        """Advance by one step whose gradients did (found_inf) or did not overflow."""
        c = self.config
        self.history.append((self.scale, not found_inf))
        if found_inf:
            self.scale *= c.backoff_factor
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == c.growth_interval:
            self.scale *= c.growth_factor
            self.good_steps = 0
        return True

    @property
    def skipped(self) -> int:
        """Steps skipped so far."""
        return sum(not stepped for _, stepped in self.history)


def has_inf_or_nan(arrays) -> bool:
    """True if any array (None skipped) holds an inf or a NaN."""
    return any(a is not None and not np.isfinite(a).all() for a in arrays)


class ScaleGrad(Function):
    """y = x in the forward; dx = S * dy in the backward: the loss is reported unscaled,
    while every gradient behind it is multiplied by S."""

    @staticmethod
    def forward(ctx: Context, x: Any, *, scale: float) -> Any:
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g * ctx.scale,)
