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
    engine.full_params()         COLLECTIVE: {name: full global array}, in the
                                 single-process model's order (baseline.py's params);
                                 these and full_optimizer_state()'s are new arrays, the
                                 caller's own (an asynchronous checkpoint keeps them)
    engine.full_optimizer_state()  COLLECTIVE: the single-process optimizer's state_dict():
                                 "step", "m.i", "v.i" (AdamW) or "momentum_buffer.i" (SGD),
                                 i = index in the single-process model.parameters()
    engine.load_full_state(params, optimizer_state)
                                 the inverse of the two, between steps: every rank is handed
                                 the same global arrays and keeps its pieces (no
                                 communication), so a state saved under any Plan loads under
                                 any other and training goes on bitwise as it would have;
                                 full_params() / full_optimizer_state() then return the
                                 loaded arrays bitwise (and the integer step). ValueError
                                 naming the key for a missing or unexpected name, a wrong
                                 shape or dtype, or another optimizer's state.
    engine.memory()
    engine.begin_step(), engine.loss_seed()
                                 for a pipeline stage, which runs the model's pieces and
                                 seeds the backward itself: what forward() would switch on
                                 (mixed precision's autocast), and the seed of the loss's
                                 backward (S under fp16 loss scaling, else 1)

Engines: parallel/data/ddp.py's DataParallel (ZeRO stage 0) and parallel/zero/engine.py's
ZeroEngine (stages 1-3); DiLoCo and OneBitAdam (parallel/data/) sync less, or in fewer
bits. The first and the last two keep the whole model (shard) on every dp rank and share
`ReplicatedEngine`'s forward and full-state methods. An engine syncs gradients over ONE group, the dp group, for
whatever parameters the model holds: under tensor parallelism those are this rank's tp
shards, and the engine's `sharding` (parallel/sharding.py) turns dp-global values into
global ones (norm over tp, full parameters gathered over tp) and back (`local_values`).
This base class holds what they share: the no_sync switch and those last steps.
Read next: parallel/data/ddp.py.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import numpy as np

from minidist import backend
from minidist.optim import SGD, AdamW, clip_to
from minidist.optim.clip import wide
from minidist.parallel.sharding import check_state, check_values


class Engine:
    """Base of the engines: `self._sync` is False inside no_sync()."""

    _sync = True
    sharding = None              # parallel/sharding.ModelSharding, or None: the whole model

    def _norm(self, dp_sq: float) -> float:
        """sqrt of ||g||^2 summed over the model-parallel ranks; dp_sq covers the dp axis."""
        return math.sqrt(dp_sq if self.sharding is None else self.sharding.sum_over_model(dp_sq))

    def _global_params(self, local: dict) -> dict:
        return local if self.sharding is None else self.sharding.full_values(local)

    def _global_state(self, state: dict) -> dict:
        return state if self.sharding is None else self.sharding.full_optimizer_state(state)

    def load_full_state(self, params: dict, optimizer_state: dict) -> None:
        """Load the global training state (see the module docstring); per engine."""
        raise NotImplementedError

    def _local_full_state(self, params: dict, optimizer_state: dict) -> tuple[dict, dict]:
        """(this rank's pieces of the parameters, its optimizer state_dict()), both checked
        before anything is written; a ValueError says which rank refused."""
        try:
            return self._local_params(params), self._local_state(optimizer_state)
        except ValueError as e:
            prefix = getattr(getattr(self, "group", None), "prefix", "")
            raise ValueError(f"{prefix} {e}".lstrip()) from None

    def _local_params(self, full: dict) -> dict:
        """{name: this rank's piece} of the full parameters, validated."""
        if self.sharding is not None:
            return self.sharding.local_values(full)
        names, shapes, dtype = self._catalogue()
        check_values(full, names, shapes, dtype)
        return {n: np.array(full[n], copy=True) for n in names}

    def _local_state(self, full_state: dict) -> dict:
        """This rank's optimizer state_dict() ("m.i": i in this rank's parameter order) of
        the single-process one, validated against the kind of self.opt."""
        layout = state_layout(self.opt)
        if self.sharding is not None:
            return self.sharding.local_optimizer_state(full_state, layout)
        names, shapes, dtype = self._catalogue()
        check_state(full_state, names, shapes, dtype, layout)
        return {k: v.copy() if isinstance(v, np.ndarray) else int(v)
                for k, v in full_state.items()}

    def _catalogue(self) -> tuple[list[str], list[tuple], np.dtype]:
        """(names, shapes, dtype) of the whole model's parameters (no sharding)."""
        named = list(self.model.named_parameters())
        return ([n for n, _ in named], [tuple(p.shape) for _, p in named],
                np.dtype(named[0][1].dtype))

    def begin_step(self) -> None:
        """Before a step's first forward, for a caller that runs the model's pieces itself
        instead of forward() (a pipeline stage): nothing here; mixed precision turns its
        autocast on (memory/mixed_precision.py)."""

    def loss_seed(self) -> float:
        """d loss / d loss for a caller that starts the backward itself (a pipeline's last
        stage; a stage's MoE auxiliary terms): 1 here; S under fp16 loss scaling."""
        return 1.0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates gradients locally and communicates nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def overlaps_backward(self) -> bool:
        """True if a backward outside no_sync() starts reducing the gradients it finished
        while the rest of the backward runs (DDP's hooks); a pipeline stage then runs each
        chunk's last backward outside no_sync() (parallel/pipeline/stage.py). False here:
        the reduction waits for step()."""
        return False

    def hold(self, p) -> None:
        """p's gradient will not be final when its backward ends: the caller adds to it in
        place (local_grad) and then calls release(p); until then its reduction does not
        start (the tied wte of a pipeline). Nothing to do where it waits for step()."""

    def release(self, p) -> None:
        """hold(p)'s end: p's gradient is final now."""


class ReplicatedEngine(Engine):
    """An engine whose every dp rank holds its whole model (tp shard): `model`, `group`,
    `names` and `params` (model.named_parameters()) and `opt` over those params."""

    def forward(self, idx, targets, *, n_tokens: int, aux_weight: float = 1.0,
                dropout_key=None):
        """(logits, loss) of the local replica; nothing to communicate in the forward."""
        return self.model(idx, targets, n_tokens=n_tokens, aux_weight=aux_weight,
                          dropout_key=dropout_key)

    def local_grad(self, p):
        """p's gradient accumulated on this rank, not yet summed over dp (after backwards
        inside no_sync()); writable in place (pipeline.sync_tied adds the tied copy's)."""
        if p.grad is None:
            raise RuntimeError(f"{self.group.prefix} local_grad: this parameter has no "
                               "gradient yet; call it after the backward passes of the step.")
        return p.grad

    def full_params(self) -> dict[str, np.ndarray]:
        """{name: full values} of this replica (gathered over tp if sharded)."""
        return self._global_params({n: backend.to_numpy(p.data).copy()
                                    for n, p in zip(self.names, self.params)})

    def full_optimizer_state(self) -> dict:
        """The optimizer's state_dict(), the layout baseline.py returns (gathered over tp)."""
        return self._global_state(self.opt.state_dict())

    # --- the steps' common parts ---
    def local_gradients(self, transform: Callable) -> list:
        """[transform(i, g_i)] for every parameter i, g_i its gradient on this rank (zeros
        if it got none), each also left in .grad for the optimizer."""
        out = []
        for i, p in enumerate(self.params):
            g = p.grad if p.grad is not None else np.zeros_like(p.data)
            p.grad = transform(i, g)
            out.append(p.grad)
        return out

    def grad_norm(self, grads: list) -> float:
        """||grads|| over this rank's parameters and the model-parallel ranks (not dp: the
        caller's grads are already what every dp rank uses, or its own)."""
        sq = self.sharding.grad_sq(grads) if self.sharding is not None else \
            sum(float(wide(g.reshape(-1)) @ wide(g.reshape(-1))) for g in grads)
        return self._norm(sq)

    def update(self, grads: list, norm: float, lr: float, clip_grad: float | None,
               skip: Callable[[float], bool] | None) -> bool:
        """Unless skip(norm): clip the .grad arrays by norm, one optimizer step at lr. Then
        .grad = None everywhere. True if it stepped."""
        stepped = skip is None or not skip(norm)
        if stepped:
            clip_to(grads, norm, clip_grad)
            self.opt.lr = lr
            self.opt.step()
        for p in self.params:
            p.grad = None
        return stepped


def state_layout(opt) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(name, scalar keys, per-parameter prefixes) of opt.state_dict(): what a loaded
    optimizer state must hold."""
    if isinstance(opt, AdamW):
        return "AdamW", ("step",), ("m", "v")
    if isinstance(opt, SGD):
        return f"SGD (momentum={opt.momentum})", (), ("momentum_buffer",) if opt.momentum \
            else ()
    raise ValueError(f"load_full_state: no state layout known for {type(opt).__name__}.")
