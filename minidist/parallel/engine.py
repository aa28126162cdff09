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
ZeroEngine (stages 1-3). This base class holds what they share: the no_sync switch.
Read next: parallel/data.py.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


class Engine:
    """Base of the engines: `self._sync` is False inside no_sync()."""

    _sync = True
    comm_wait_s = 0.0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally and communicates nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous
