"""Optimizer: what SGD and AdamW share -- a parameter list, a settable lr, zero_grad.

An optimizer holds a list of objects with `.data` and `.grad` xp arrays
(nn.Parameter, or any object shaped like one) and updates `.data` IN PLACE, so
whoever else holds the array (a module, a view into a flat buffer) sees the
new values. ZeRO hands it one parallel/zero/flat.py FlatShard per unit, (.data,
.grad) = (w_shard, dw_shard), and the optimizer's state (m, v, momentum
buffers: `zeros_like(.data)`) is then sharded too: one code path for DDP and
every ZeRO stage. The updates are elementwise, so a shard gets exactly the
bits that the update of the whole parameters would give it.

Each optimizer's math lives in a pure array function (`sgd_step`,
`adamw_step`) that works on one array and its state; the class only loops over
parameters and keeps the state. The GPU kernel is tested against it.

State is a plain dict of arrays and ints (`state_dict()`), so a checkpoint can
store it as .npy files plus a JSON manifest, never as a pickle.

Read next: optim/sgd.py, optim/adamw.py
"""

from __future__ import annotations

from typing import Any, Iterable


class Optimizer:
    """Base class: keeps `params` and `lr`; subclasses implement step() and the state."""

    def __init__(self, params: Iterable[Any], lr: float) -> None:
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not (hasattr(p, "data") and hasattr(p, "grad")):
                raise ValueError(f"{type(self).__name__}: params[{i}] is a {type(p).__name__}, "
                                 "which has no .data/.grad; pass nn.Parameters (or objects "
                                 "with both, like parallel/zero/flat.py's FlatShard).")
        if lr < 0:
            raise ValueError(f"{type(self).__name__}: lr={lr} is negative; use lr >= 0.")
        self.lr = lr

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (.grad = None), ready for the next backward."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        raise NotImplementedError

    def _load_arrays(self, state: dict, prefix: str, arrays: list) -> None:
        """Copy state[f"{prefix}.{i}"] into arrays[i] in place, checking shapes."""
        for i, a in enumerate(arrays):
            key = f"{prefix}.{i}"
            if key not in state:
                raise ValueError(f"load_state_dict: '{key}' is missing; the state was saved "
                                 f"for a different parameter list.")
            if tuple(state[key].shape) != a.shape:
                raise ValueError(f"load_state_dict: '{key}' has shape {tuple(state[key].shape)} "
                                 f"but parameter {i} has shape {a.shape}.")
            a[...] = state[key]
