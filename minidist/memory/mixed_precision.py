"""Mixed precision around any engine: autocast, fp32 master weights, loss scaling, one skip.

`MixedPrecision(engine, policy, group, ...)` wraps any engine of parallel/engine.py (DDP,
ZeRO 1-3, on any layout) and keeps its interface, so train.py cannot tell it is there. The
engine still owns the gradient sync and the norm; the wrapper adds what mixed precision
needs around them:
    - precision.Autocast (the rounded GEMMs, FP32_OPS) is on from a step's first forward
      to its step(): the backward sees it too, and so does what the backward recomputes;
      under fp16 forward hands back
      loss_scale.ScaleGrad(loss): the backward then sees S * loss;
    - it replaces the engine's optimizer by master_weights.MasterWeights: for every object
      the engine updates an fp32 master array, the real optimizer on those, and the
      write-back model_copy[...] = round(master) in place (ZeRO-1/2 then all-gather the
      rounded shards as before; ZeRO-3 gathers them when it needs them);
    - a pipeline stage, which runs the model's pieces without forward(), calls begin_step()
      (autocast on) and seeds its loss's backward with loss_seed() (S under fp16);
    - (fp16) its step() checks the summed gradients for inf/NaN (the flag all-reduced over
      the whole job: an inf on one pipeline stage, tp shard or expert rank must skip the
      step on every rank, or the model's pieces part ways), skips the update everywhere if
      found, advances the scaler.

One rank's view of step(lr, clip_grad) under fp16 (scale S):
    1. engine.step(lr, S clip_grad, skip=decide): the engine sums the gradients (in the
       storage dtype: precision.Policy.grad_reduce) and computes the global norm of the
       SCALED gradients, ||S g|| = S ||g||; clipping at S max_norm is clipping g at max_norm
    2. decide(norm): found = all_reduce(max) over the job of "my (shard of the) summed
       gradients hold an inf/NaN"; found -> the engine skips (zeroes the gradients only)
    3. else MasterWeights.step: master.grad = fp32(g) / S (exact: S is a power of two),
       AdamW / SGD on the master, then model copy = round(master)
    4. scaler.update(found); return ||g|| = norm / S.

Memory: master_weights.py's; memory() reports the master copy in "optimizer".
The inf/NaN flag (`found_inf_everywhere`): all_reduce(max) of one float per rank (8 bytes)
over the job, so every rank takes the same decision.

Limits: full_params() is the model copy (upcast to fp32), full_optimizer_state() the fp32
m and v; the master itself is not in them, so load_full_state (resuming) is refused.
Under ZeRO-3 each block's input is a leaf of the call's own graph, so the activation
gradient crossing a block boundary is stored, rounded, in its dtype (DDP keeps it fp32).

References: Micikevicius et al. 2018, arXiv:1710.03740, Sec. 3.1 (master copy) and 3.2
    (loss scaling).
Read next: demos/20_mixed_precision.py.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from minidist import collectives as C
from minidist.memory import loss_scale
from minidist.memory.master_weights import MasterWeights
from minidist.memory.precision import Autocast, Policy
from minidist.optim import make_optimizer


def found_inf_everywhere(local: bool, group: Any = None) -> bool:
    """COLLECTIVE over `group`: True on every rank if `local` is True on any.

    all_reduce(max) of one float per rank (8 bytes); no group (one process): local."""
    if group is None or getattr(group, "size", 1) == 1:
        return bool(local)
    flag = C.all_reduce(np.array([1.0 if local else 0.0]), op="max", group=group)
    return bool(flag[0] > 0)


class MixedPrecision:
    """An engine (parallel/engine.py's interface) training its inner engine's model under
    `policy`. The model must hold the low-precision copy already (precision.cast_parameters
    before the engine was built). `group`: the ranks that decide a skip together (the inf/NaN
    flag): the whole job (parallel/compose.build passes the world group)."""

    def __init__(self, engine: Any, policy: Policy, group: Any, *, optimizer: str, lr: float,
                 weight_decay: float, betas: tuple[float, float], momentum: float,
                 scaler: loss_scale.ScalerConfig = loss_scale.ScalerConfig()) -> None:
        params = engine.opt.params
        if any(np.dtype(p.data.dtype) != policy.storage_dtype for p in params):
            raise ValueError(f"MixedPrecision: the engine's parameters are not stored in "
                             f"{policy.storage_dtype}; call precision.cast_parameters(model, "
                             "policy) before building the engine.")
        self.inner, self.policy, self.group = engine, policy, group
        self.autocast = Autocast(policy)
        self.scaler = loss_scale.LossScaler(scaler) if policy.loss_scaling else None
        if self.scaler is not None:           # overflow is an expected event: the scaler
            warnings.filterwarnings(          # handles it; NumPy need not warn about it
                "ignore", r"(overflow|invalid value) encountered", RuntimeWarning,
                r"minidist\.")
        self.master = MasterWeights(params, policy.dtype, lambda masters: make_optimizer(
            optimizer, masters, lr, weight_decay, betas, momentum))
        engine.opt = self.master

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)      # no_sync, model, sharding, ...

    def forward(self, idx, targets=None, **kwargs):
        """(logits, loss) of the inner engine, Autocast on until step(); loss x S in the
        backward."""
        self.autocast.start()
        logits, loss = self.inner.forward(idx, targets, **kwargs)
        if self.scaler is not None and loss is not None:
            loss = loss_scale.ScaleGrad.apply(loss, scale=self.scaler.scale)
        return logits, loss

    def begin_step(self) -> None:
        """Autocast on, for a pipeline stage that runs the model's pieces itself."""
        self.autocast.start()

    def loss_seed(self) -> float:
        """The backward's seed for the loss: S under fp16 loss scaling (what ScaleGrad gives
        forward()'s loss), else 1."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def step(self, lr: float, clip_grad: float | None = None,
             skip: Callable[[float], bool] | None = None) -> float:
        """The inner step on unscaled numbers; returns the global norm of the true gradient.
        skip(norm) (e.g. reliability/spike.py) is asked only on steps without inf/NaN."""
        self.autocast.stop()                  # the backward is done
        S = self.scaler.scale if self.scaler is not None else 1.0
        self.master.inv_scale = 1.0 / S
        found = [False]

        def decide(norm: float) -> bool:
            if self.scaler is not None:
                local = loss_scale.has_inf_or_nan(p.grad for p in self.master.params)
                found[0] = found_inf_everywhere(local, self.group)
            return found[0] or (skip is not None and bool(skip(norm / S)))

        norm = self.inner.step(lr, None if clip_grad is None else clip_grad * S, skip=decide)
        if self.scaler is not None:
            self.scaler.update(found[0])
        return norm / S

    def full_params(self) -> dict[str, np.ndarray]:
        """COLLECTIVE as the inner one: the model copy, upcast to fp32 (exact)."""
        return {k: np.asarray(v, np.float32) for k, v in self.inner.full_params().items()}

    def memory(self) -> dict[str, int]:
        """The inner engine's bytes, with the fp32 master copy counted in "optimizer"."""
        out = dict(self.inner.memory())
        out["optimizer"] += self.master.master_bytes
        return out

    def load_full_state(self, params: dict, optimizer_state: dict) -> None:
        raise ValueError("MixedPrecision: resuming is not built: a saved state holds the "
                         "rounded model copy, not the fp32 master weights, so the run would "
                         "not continue as it would have. Restart the run from step 0, or "
                         "train with precision fp32.")
