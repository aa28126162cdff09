"""fp32 master weights: the optimizer updates an fp32 copy; the model gets its rounding.

`MixedPrecision(engine, policy, ...)` wraps any engine of parallel/engine.py (DDP, ZeRO
1-3) and keeps its interface, so train.py cannot tell it is there. The engine still owns
the gradient sync and the norm; the wrapper adds what mixed precision needs around them:
    - precision.Autocast (the rounded GEMMs, FP32_OPS) is on from a step's first forward
      to its step(): the backward sees it too, and so does what the backward recomputes;
      under fp16 forward hands back
      loss_scale.ScaleGrad(loss): the backward then sees S * loss;
    - it replaces the engine's optimizer by `MasterWeights`: for every object the engine
      updates (DDP: a Parameter; ZeRO: the FlatShard of a unit, so the master copy and m, v
      are sharded exactly like the shards) an fp32 master array, the real optimizer on
      those, and the write-back model_copy[...] = round(master) in place (ZeRO-1/2 then
      all-gather the rounded shards as before; ZeRO-3 gathers them when it needs them);
    - (fp16) its step() checks the summed gradients for inf/NaN (the flag all-reduced over
      the gradient-sync group), skips the update everywhere if found, advances the scaler.

One rank's view of step(lr, clip_grad) under fp16 (scale S):
    1. engine.step(lr, S clip_grad, skip=decide): the engine sums the gradients (in the
       storage dtype: precision.Policy.grad_reduce) and computes the global norm of the
       SCALED gradients, ||S g|| = S ||g||; clipping at S max_norm is clipping g at max_norm
    2. decide(norm): found = all_reduce(max) over the group of "my (shard of the) summed
       gradients hold an inf/NaN"; found -> the engine skips (zeroes the gradients only)
    3. else MasterWeights.step: master.grad = fp32(g) / S (exact: S is a power of two),
       AdamW / SGD on the master, then model copy = round(master)
    4. scaler.update(found); return ||g|| = norm / S.

Memory (per rank, Ψ parameters on this rank's engine, AdamW, grad_reduce "low"):
    model copy 2Ψ + gradients 2Ψ + master 4Ψ + m 4Ψ + v 4Ψ: ZeRO's 2Ψ + 2Ψ + KΨ with K = 12
    (Rajbhandari et al. 2020, Sec. 3.1), each term divided by N_d where the stage shards it
    (parallel/zero/memory.py). memory() reports the master in "optimizer". grad_reduce
    "fp32" stores parameters and gradients in 4 bytes: 4Ψ + 4Ψ + 12Ψ.

Limits: full_params() is the model copy (upcast to fp32), full_optimizer_state() the fp32
m and v; the master itself is not in them, so load_full_state (resuming) is refused.
Under ZeRO-3 each block's input is a leaf of the call's own graph, so the activation
gradient crossing a block boundary is stored, rounded, in its dtype (DDP keeps it fp32).

References: Micikevicius et al. 2018, arXiv:1710.03740, Sec. 3.1 (master copy) and 3.2;
    Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 3.1 (K = 12).
Read next: demos/20_mixed_precision.py.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from minidist.memory import loss_scale
from minidist.memory.precision import Autocast, Policy
from minidist.optim import make_optimizer


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


class MixedPrecision:
    """An engine (parallel/engine.py's interface) training its inner engine's model under
    `policy`. The model must hold the low-precision copy already (precision.cast_parameters
    before the engine was built). `group`: the gradient-sync group (the inf/NaN flag)."""

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
                found[0] = loss_scale.found_inf_everywhere(local, self.group)
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
