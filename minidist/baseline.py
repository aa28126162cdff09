"""Single-process training: the ground truth that every parallel layout must reproduce.

One process holds the whole model and reads the whole global batch of every step. Nothing
here knows about ranks, groups or shared memory (it imports nothing from runtime/ or
parallel/), so when a 4-rank layout and this function disagree, the layout is wrong.

One training step (step s, global batch B, M = grad_accum micro-batches of B/M rows):
    1. x, y = data.global_batch(s, B)                        (B, T) each, by sample index
    2. n = number of targets != -100 in the WHOLE global batch
    3. for each micro-batch m: loss_m = sum CE over its tokens / n
                                        + (B/M / B) * aux_m;  loss_m.backward()
       (aux_m: the MoE layers' weighted auxiliary losses, means over routing groups)
       The gradients add up in .grad, so after M micro-batches .grad is the gradient of
       the global-batch loss, sum_m loss_m (not a mean of per-micro-batch means, which
       would weigh a token by how many answer tokens its micro-batch happens to hold).
    4. optional: clip the global gradient norm; set lr from the schedule (optim.lr_at)
    5. optimizer step (AdamW or SGD), zero the gradients.
    6. MoE with aux-loss-free balancing (bias_rate > 0): each layer's routing bias moves by
       the rule of nn/routing.py from the load the step's forwards counted (the global
       batch's: this one process routed all of it).
A dense model gives the same gradients (to rounding) for any M; so does a MoE model whose
routing groups (nn/moe.py: capacity and the aux losses are decided per group of G tokens)
lie inside the micro-batches, i.e. B/M rows hold whole groups.

Determinism: same arguments -> bitwise the same result (the parameters come from
(seed, name), batches from (data seed, step), dropout masks from (seed, step, layer, row);
BLAS should run single-threaded, OMP_NUM_THREADS=1, for run-to-run bitwise equality).

CLI: `python -m minidist train --task sort --steps 300` runs it (train_cli.py).
Read next: train.py (the per-rank loop that applies a parallel Plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from minidist import optim
from minidist.data import DataConfig, SyntheticData, check_compatible
from minidist.deterministic.layers import determinize
from minidist.deterministic.tree_sum import TreeSum, combine
from minidist.memory import loss_scale
from minidist.memory.master_weights import MasterWeights
from minidist.memory.precision import Autocast, Policy, cast_parameters, round_to
from minidist.nn import DropoutKey, GPT, GPTConfig


@dataclass(frozen=True)
class TrainResult:
    """What a run produced: one entry per step, final parameters and optimizer state."""

    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]           # global gradient norm before clipping
    lrs: tuple[float, ...]
    params: dict[str, np.ndarray]           # full name -> final values
    optimizer_state: dict
    routing_biases: tuple[dict[str, np.ndarray], ...] = ()   # per step: {MoE layer: bias}


def train_single_process(model_cfg: GPTConfig, data_cfg: DataConfig, *, steps: int,
                         global_batch: int, lr: float, seed: int = 0, grad_accum: int = 1,
                         optimizer: str = "adamw", weight_decay: float = 0.0,
                         betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.0,
                         clip_grad: float | None = None, warmup_steps: int = 0,
                         lr_schedule: str = "constant", min_lr: float = 0.0,
                         on_step: Callable[[int, float, GPT], None] | None = None,
                         deterministic: bool = False, grain: int = 1,
                         token_tiles: int | None = None, precision: str = "fp32",
                         grad_reduce: str = "fp32", fp8_recipe: str = "delayed") -> TrainResult:
    """Train GPT(model_cfg, seed) on `steps` global batches of `data_cfg`; the ground truth.

    lr_schedule "constant" keeps lr; "cosine" uses optim.lr_at (linear warm-up over
    warmup_steps, cosine decay to min_lr at `steps`). on_step(step, loss, model) is called
    after each optimizer step (progress printing). deterministic: every sample is its own
    micro-batch, and the per-sample gradients and losses are added in the fixed tree of
    minidist/deterministic/tree_sum.py, so the bits depend on no grouping: grad_accum changes nothing,
    and the layouts that do the same (train.py --deterministic) equal this run bit for bit.
    grain (deterministic only): samples per micro-batch (the leaves of the tree are runs of
    `grain` consecutive rows); every layout compared must use the same grain. token_tiles
    (deterministic only): every sum over positions is a tree over runs of T / token_tiles
    of them (what context-parallel layouts need; deterministic/attention.py).
    precision "bf16", "fp16" or "fp8" (memory/precision.py): the same policy a layout's
    MixedPrecision applies, on this one process: the model holds the rounded copy, the
    GEMMs run under Autocast, the optimizer steps fp32 master weights
    (memory/master_weights.MasterWeights), and under fp16 the loss is scaled, a step with
    an inf or NaN gradient skipped and the scale halved (memory/loss_scale.py). grad_reduce
    "low": the summed gradients are rounded to the format before the update, as the
    layouts store them; fp8_recipe: memory/fp8_recipes.RECIPES. The reference every layout
    is checked against under that policy.
    """
    check_compatible(model_cfg, data_cfg)
    if steps < 0 or grad_accum < 1 or global_batch % grad_accum:
        raise ValueError(f"steps={steps}, global_batch={global_batch}, grad_accum={grad_accum}:"
                         " need steps >= 0 and global_batch a multiple of grad_accum >= 1.")
    if deterministic and (not isinstance(grain, int) or grain < 1 or global_batch % grain):
        raise ValueError(f"grain={grain!r}: the deterministic grain must be an int >= 1 that "
                         f"divides global_batch={global_batch}.")
    if lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule={lr_schedule!r} is unknown; use 'constant' or 'cosine'.")
    model, data = GPT(model_cfg, seed), SyntheticData(data_cfg)
    if deterministic:                        # matmuls over the tiles every layout uses
        determinize(model, token_tiles)
    mixed = _Mixed(model, Policy(precision, grad_reduce, fp8_recipe=fp8_recipe),
                   lambda params: optim.make_optimizer(
        optimizer, params, lr, weight_decay, betas, momentum))
    opt = mixed.opt
    losses, norms, lrs, biases = [], [], [], []
    balanced = {name: m for name, m in model.named_modules()
                if hasattr(m, "update_bias") and m.rule.bias_rate}
    for step in range(steps):
        opt.lr = lr if lr_schedule == "constant" else optim.lr_at(
            step, lr=lr, warmup_steps=warmup_steps, total_steps=steps, min_lr=min_lr)
        with mixed:
            losses.append(
                _accumulate_canonical(model, data, step, global_batch, seed, grain, mixed.loss)
                if deterministic else _accumulate_gradients(model, data, step, global_batch,
                                                            grad_accum, seed, mixed.loss))
        S, skip = mixed.unscale()                           # 1 and False in fp32
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append((optim.clip_grad_norm(model.parameters(), clip_grad * S)
                      if clip_grad is not None and not skip
                      else optim.global_grad_norm(grads)) / S)
        lrs.append(float(opt.lr))
        if not skip:
            opt.step()
        opt.zero_grad()
        for layer in balanced.values():
            layer.update_bias(layer.take_routed())
        if balanced:
            biases.append({name: m.score_bias.copy() for name, m in balanced.items()})
        if on_step is not None:
            on_step(step, losses[-1], model)
    return TrainResult(losses=tuple(losses), grad_norms=tuple(float(n) for n in norms),
                       lrs=tuple(lrs), params=model.state_dict(),
                       optimizer_state=opt.state_dict(), routing_biases=tuple(biases))


def _accumulate_gradients(model: GPT, data: SyntheticData, step: int, global_batch: int,
                          grad_accum: int, seed: int, scaled=lambda loss: loss) -> float:
    """Backward every micro-batch of `step` into .grad; return the global-batch loss."""
    ids = data.global_indices(step, global_batch)                    # (B,)
    x, y = data.batch(ids)                                           # (B, T) each
    n_tokens = int((y != -100).sum())                                # over the GLOBAL batch
    rows = global_batch // grad_accum
    total = 0.0
    for m in range(grad_accum):
        part = slice(m * rows, (m + 1) * rows)
        key = DropoutKey(seed, step, tuple(int(i) for i in ids[part]))
        _, loss = model(x[part], y[part], n_tokens=n_tokens,
                        aux_weight=rows / global_batch, dropout_key=key)
        scaled(loss).backward()
        total += float(loss.item())
    return total


def _accumulate_canonical(model: GPT, data: SyntheticData, step: int, global_batch: int,
                          seed: int, grain: int = 1, scaled=lambda loss: loss) -> float:
    """_accumulate_gradients with `grain` samples per micro-batch, whose gradients and losses
    are summed in the aligned tree of tree_sum.py (leaf b: rows b grain .. (b+1) grain - 1)."""
    ids = data.global_indices(step, global_batch)                    # (B,)
    x, y = data.batch(ids)                                           # (B, T) each
    n_tokens = int((y != -100).sum())                                # over the GLOBAL batch
    params = model.parameters()
    grads, losses = TreeSum(), TreeSum()
    leaves = global_batch // grain
    for b in range(leaves):
        rows = slice(b * grain, (b + 1) * grain)
        key = DropoutKey(seed, step, tuple(int(i) for i in ids[rows]))
        _, loss = model(x[rows], y[rows], n_tokens=n_tokens,
                        aux_weight=grain / global_batch, dropout_key=key)
        scaled(loss).backward()
        grads.push(b, flat_grads(params))
        losses.push(b, loss.data.astype(np.float64))
        for p in params:
            p.grad = None
    set_flat_grads(params, combine(grads.nodes(), leaves))
    return float(combine(losses.nodes(), leaves))


class _Mixed:
    """A precision policy on one process (train_single_process's `precision`): `with` it
    around a step's forwards and backwards (Autocast on), `loss` scales each loss (fp16),
    `unscale()` after them says (S, skip): the scale the gradients carry and whether they
    hold an inf/NaN (the step is then skipped and S halved). `opt` steps the fp32 master
    weights (their update divides by S). fp32: no change, opt the plain optimizer."""

    def __init__(self, model: GPT, policy: Policy, make) -> None:
        self.model, self.policy = model, policy
        self.autocast = self.scaler = None
        if not policy.low:
            self.opt = make(model.parameters())
            return
        cast_parameters(model, policy)
        self.autocast = Autocast(policy)
        self.scaler = loss_scale.LossScaler() if policy.loss_scaling else None
        self.opt = MasterWeights(model.parameters(), policy.dtype, make)

    def __enter__(self) -> "_Mixed":
        if self.autocast is not None:
            self.autocast.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.autocast is not None:
            self.autocast.stop()

    def loss(self, loss):
        return loss if self.scaler is None else \
            loss_scale.ScaleGrad.apply(loss, scale=self.scaler.scale)

    def unscale(self) -> tuple[float, bool]:
        params = self.model.parameters()
        if self.policy.low and self.policy.grad_reduce == "low":   # stored in the format
            for p in params:
                if p.grad is not None:
                    p.grad = round_to(p.grad, self.policy.dtype)
        if self.scaler is None:
            return 1.0, False
        S = self.scaler.scale
        skip = loss_scale.has_inf_or_nan(p.grad for p in params)
        self.opt.inv_scale = 1.0 / S
        self.scaler.update(skip)
        return S, skip


def flat_grads(params: list) -> np.ndarray:
    """The .grad of params, in order, as one flat array (zeros for a parameter without)."""
    return np.concatenate([(p.grad if p.grad is not None else np.zeros_like(p.data))
                           .reshape(-1) for p in params])


def set_flat_grads(params: list, flat: np.ndarray) -> None:
    """The inverse of flat_grads: each parameter's .grad becomes its slice of flat."""
    at = 0
    for p in params:
        p.grad = flat[at:at + p.data.size].reshape(p.data.shape).copy()
        at += p.data.size
