"""The engine interface: what train.py drives, whatever the layout.

A training step in train.py never talks to a group or a collective itself. It
hands the model to an engine, which owns the gradient communication and the
optimizer, and calls only these:

    engine.no_sync()             context: backward inside only accumulates locally
                                 (micro-batches 0..M-2 of gradient accumulation)
    engine.forward(idx, targets, n_tokens=..., aux_weight=..., dropout_key=...)
                                 -> (logits, loss); ZeRO-3 gathers parameters here
    engine.step(lr, clip_grad)   finish communication, clip by the GLOBAL norm,
                                 update; returns that norm
    engine.full_params(), engine.full_optimizer_state(), engine.memory()
    engine.comm_wait_s           seconds the last step() waited for communication

Engines: parallel/data.py's DataParallel (ZeRO stage 0) and parallel/zero.py's
ZeroEngine (stages 1-3). An engine syncs gradients over ONE group, the dp group, for
whatever parameters the model holds: under tensor parallelism those are this rank's tp
shards, and the engine's `sharding` (parallel/sharding.py) turns dp-global values into
global ones (norm over tp, full parameters gathered over tp). This base class holds what
they share: the no_sync switch and that last step.
Read next: parallel/data.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator


class Engine:
    """Base of the engines: `self._sync` is False inside no_sync()."""

    _sync = True
    comm_wait_s = 0.0
    sharding = None              # parallel/sharding.ModelSharding, or None: the whole model

    def _norm(self, dp_sq: float) -> float:
        """sqrt of ||g||^2 summed over the model-parallel ranks; dp_sq covers the dp axis."""
        return math.sqrt(dp_sq if self.sharding is None else self.sharding.sum_over_model(dp_sq))

    def _global_params(self, local: dict) -> dict:
        return local if self.sharding is None else self.sharding.full_values(local)

    def _global_state(self, state: dict) -> dict:
        return state if self.sharding is None else self.sharding.full_optimizer_state(state)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally and communicates nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous
