"""The per-rank training loop: baseline.py's loop, with a Plan saying how work is split.

`train_on_rank(ctx, ...)` runs on every rank (spawn it). It is baseline.train_single_process
with three changes, and nothing else may differ:
    1. this rank reads only its rows of each global batch (its dp slice), cut into
       plan.micro_batches micro-batches; the loss is still divided by the token count of
       the WHOLE global batch, so local losses and gradients simply add up across ranks;
    2. the model is driven through an engine: DataParallel (plan.zero == 0,
       parallel/data.py) or ZeroEngine (stage 1-3, parallel/zero.py), which owns the
       gradient communication and the optimizer;
    3. the loss of a step is the sum of every rank's micro-batch losses, all-reduced once
       after the loop (so the per-step byte counts hold gradient traffic only).

One rank's view of step s (dp rank r of W, global batch B, M micro-batches):
    1. ids = data.global_indices(s, B); my rows are ids[r B/W : (r+1) B/W]
    2. n = number of targets != -100 in the whole global batch (free to compute for the
       synthetic tasks; a real loader would all-reduce one integer)
    3. for m < M-1, inside engine.no_sync(): forward + backward on micro-batch m
       (B/(W M) rows, dropout keyed by its global sample ids, aux_weight = rows / B)
    4. micro-batch M-1 without no_sync: its backward starts the gradient communication
    5. engine.step(lr_s, clip_grad): wait, (clip,) update; returns the global grad norm
Shapes: x, y (B/(W M), T) per micro-batch.
Result (RankResult): losses (global), grad_norms, lrs, full params and optimizer state
(gathered for ZeRO), bytes sent/received per step (group.stats deltas around the step),
memory (engine.memory()) and timing per step in seconds: "compute" (forward + backward),
"comm_wait" (engine.comm_wait_s: what step() waited for communication), "step" (wall
time of the whole step) and "cpu" (this process's CPU time in the step, all threads).

CLI: `python -m minidist train --dp 2 [--zero 1] [--check]` (see `main`).
Read next: parallel/engine.py, parallel/data.py, parallel/zero.py.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from minidist import collectives as C
from minidist import baseline, optim
from minidist.baseline import check_compatible
from minidist.data import IGNORE_INDEX, DataConfig, SyntheticData
from minidist.nn import GPT, DropoutKey, GPTConfig
from minidist.parallel.data import ALGOS, DataParallel


def _positive_int(value, minimum: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) \
        and value >= minimum


@dataclass(frozen=True)
class Plan:
    """How one training job is laid out: dp ranks, ZeRO stage, micro-batches, buckets."""

    dp: int = 1
    zero: int = 0
    micro_batches: int = 1
    bucket_bytes: int = 1 << 20
    algo: str = "auto"
    overlap: bool = True
    replica_check_every: int = 0

    def __post_init__(self) -> None:
        for field, minimum in (("dp", 1), ("micro_batches", 1), ("bucket_bytes", 1),
                               ("replica_check_every", 0)):
            if not _positive_int(getattr(self, field), minimum):
                raise ValueError(f"Plan: {field}={getattr(self, field)!r} must be an int >= "
                                 f"{minimum}.")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"Plan: zero={self.zero!r} must be 0 (plain DDP), 1 (shard the "
                             "optimizer state), 2 (+ gradients) or 3 (+ parameters).")
        if self.algo not in ALGOS:
            raise ValueError(f"Plan: algo={self.algo!r} is unknown; use one of {ALGOS}.")
        if self.zero and self.algo == "tree":
            raise ValueError("Plan: ZeRO needs a reduce-scatter, which the tree algorithm "
                             "does not have; use algo 'auto', 'direct', 'ring' or 'halving'.")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"Plan: overlap={self.overlap!r} must be True or False.")

    def rows_per_micro_batch(self, global_batch: int) -> int:
        """B / (dp M), or ValueError saying how to fix a batch that does not split."""
        parts = self.dp * self.micro_batches
        if not _positive_int(global_batch, 1) or global_batch % parts:
            near = max(parts, (global_batch // parts) * parts) if _positive_int(
                global_batch, 1) else parts
            raise ValueError(
                f"global_batch={global_batch!r} does not split over dp={self.dp} ranks x "
                f"micro_batches={self.micro_batches} (= {parts} equal parts). Use a multiple "
                f"of {parts}, e.g. {near} or {near + parts}, or change dp / micro_batches.")
        return global_batch // parts


@dataclass(frozen=True)
class RankResult:
    """What one rank returns; losses, norms, params and state comparable to baseline.py."""

    losses: tuple[float, ...]                       # global-batch loss per step
    grad_norms: tuple[float, ...]                   # global grad norm before clipping
    lrs: tuple[float, ...]
    params: dict[str, np.ndarray]                   # full values (gathered under ZeRO-3)
    optimizer_state: dict                           # baseline's state_dict() layout
    bytes_per_step: tuple[dict[str, int], ...]      # {"sent": B, "recv": B} per step
    memory: dict[str, int]                          # engine.memory() after the last step
    timing: dict[str, tuple[float, ...]]            # "compute", "comm_wait", "step", "cpu"



def make_engine(model: GPT, group, plan: Plan, *, optimizer: str, lr: float,
                weight_decay: float, betas: tuple[float, float], momentum: float):
    """DataParallel for plan.zero == 0, else parallel/zero.py's ZeroEngine (imported here,
    so that DDP works on its own)."""
    opt = dict(optimizer=optimizer, lr=lr, weight_decay=weight_decay, betas=betas,
               momentum=momentum)
    if plan.zero == 0:
        return DataParallel(model, group, bucket_bytes=plan.bucket_bytes, algo=plan.algo,
                            overlap=plan.overlap, replica_check_every=plan.replica_check_every,
                            **opt)
    from minidist.parallel.zero import ZeroEngine
    return ZeroEngine(model, group, plan.zero, algo=plan.algo, **opt)


def _dp_group(ctx, plan: Plan):
    if plan.dp != ctx.world_size:
        raise ValueError(f"Plan: dp={plan.dp} but the job has {ctx.world_size} ranks; data "
                         f"parallelism alone uses every rank. Spawn {plan.dp} ranks or set "
                         f"dp={ctx.world_size}.")
    return ctx.world


def _micro_steps(engine, data: SyntheticData, step: int, B: int, plan: Plan, rank: int,
                 seed: int) -> float:
    """Forward + backward of this rank's micro-batches of `step`; return their loss sum."""
    rows = plan.rows_per_micro_batch(B)
    ids = data.global_indices(step, B)                                   # (B,)
    x_all, y_all = data.batch(ids)                                       # (B, T) each
    n_tokens = int((y_all != IGNORE_INDEX).sum())                        # GLOBAL count
    total = 0.0
    for m in range(plan.micro_batches):
        lo = (rank * plan.micro_batches + m) * rows                      # global row
        part = slice(lo, lo + rows)
        last = m == plan.micro_batches - 1
        with contextlib.nullcontext() if last else engine.no_sync():
            key = DropoutKey(seed, step, tuple(int(i) for i in ids[part]))
            _, loss = engine.forward(x_all[part], y_all[part], n_tokens=n_tokens,
                                     aux_weight=rows / B, dropout_key=key)
            loss.backward()
        total += float(loss.item())
    return total


def train_on_rank(ctx, model_cfg: GPTConfig, data_cfg: DataConfig, plan: Plan, *,
                  steps: int, global_batch: int, lr: float, seed: int = 0,
                  optimizer: str = "adamw", weight_decay: float = 0.0,
                  betas: tuple[float, float] = (0.9, 0.999), momentum: float = 0.0,
                  clip_grad: float | None = None, warmup_steps: int = 0,
                  lr_schedule: str = "constant", min_lr: float = 0.0,
                  on_step: Callable[[int, float], None] | None = None) -> RankResult:
    """Train GPT(model_cfg, seed) on this rank's share of `steps` global batches.

    Same arguments as baseline.train_single_process (grad_accum is plan.micro_batches)
    and, for a dense model, the same result up to the order of additions (~1e-16).
    on_step(step, global loss), for progress output, is called on every rank after each
    step; it costs one extra 8-byte all-reduce per step (not counted in bytes_per_step).
    """
    check_compatible(model_cfg, data_cfg)
    plan.rows_per_micro_batch(global_batch)
    if not _positive_int(steps, 0) or lr_schedule not in ("constant", "cosine"):
        raise ValueError(f"train_on_rank: steps={steps!r} must be an int >= 0 and "
                         f"lr_schedule={lr_schedule!r} 'constant' or 'cosine'.")
    group = _dp_group(ctx, plan)
    model, data = GPT(model_cfg, seed), SyntheticData(data_cfg)
    engine = make_engine(model, group, plan, optimizer=optimizer, lr=lr,
                         weight_decay=weight_decay, betas=betas, momentum=momentum)
    local, norms, lrs, traffic = [], [], [], []
    timing: dict[str, list[float]] = {"compute": [], "comm_wait": [], "step": [], "cpu": []}
    for step in range(steps):
        lr_s = lr if lr_schedule == "constant" else optim.lr_at(
            step, lr=lr, warmup_steps=warmup_steps, total_steps=steps, min_lr=min_lr)
        sent, recv = group.stats["bytes_sent"], group.stats["bytes_recv"]
        t0, c0 = time.perf_counter(), time.process_time()
        local.append(_micro_steps(engine, data, step, global_batch, plan, group.rank, seed))
        t1 = time.perf_counter()
        norms.append(float(engine.step(lr_s, clip_grad)))
        t2 = time.perf_counter()
        lrs.append(float(lr_s))
        traffic.append({"sent": group.stats["bytes_sent"] - sent,
                        "recv": group.stats["bytes_recv"] - recv})
        timing["compute"].append(t1 - t0)
        timing["comm_wait"].append(float(getattr(engine, "comm_wait_s", t2 - t1)))
        timing["step"].append(t2 - t0)
        timing["cpu"].append(time.process_time() - c0)
        if on_step is not None:
            loss = C.all_reduce(np.array([local[-1]]), group=group, algo="direct")[0]
            on_step(step, float(loss))
    losses = C.all_reduce(np.array(local, np.float64), group=group, algo="direct")
    return RankResult(losses=tuple(float(v) for v in losses), grad_norms=tuple(norms),
                      lrs=tuple(lrs), params=engine.full_params(),
                      optimizer_state=engine.full_optimizer_state(),
                      bytes_per_step=tuple(traffic), memory=engine.memory(),
                      timing={k: tuple(v) for k, v in timing.items()})


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist train [--dp W] [--zero K] [--check]`: train the tiny GPT on W
    ranks (one process each; W = 1 and K = 0 is the single-process baseline), print
    progress and held-out samples; --check also trains the single-process baseline and
    compares the loss curves and final parameters."""
    ap = baseline.train_arguments("python -m minidist train")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (processes)")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    ap.add_argument("--check", action="store_true",
                    help="also run the single-process baseline and compare")
    a = ap.parse_args(argv)
    if a.dp == 1 and a.zero == 0 and not a.check:
        return baseline.main(argv)
    from minidist.runtime.launch import spawn
    if a.check and a.dtype != "float64":
        print("--check trains in float64: in float32 the layouts' different rounding grows "
              "over hundreds of Adam steps, so only float64 can show they compute the same.")
        a.dtype = "float64"
    cfg, data_cfg = baseline.configs_from(a)
    plan = Plan(dp=a.dp, zero=a.zero, micro_batches=a.grad_accum)
    plan.rows_per_micro_batch(a.batch)                        # bad splits fail here, early
    t0 = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step % a.every == 0 or step == a.steps - 1:
            sys.stdout.write(f"step {step:4d} | loss {loss:.4f} | "
                             f"{time.perf_counter() - t0:5.1f} s\n")
            sys.stdout.flush()

    def rank_main(ctx):
        # every rank takes part in on_step's all-reduce; only rank 0 prints
        show = progress if ctx.rank == 0 else (lambda step, loss: None)
        return train_on_rank(ctx, cfg, data_cfg, plan, steps=a.steps, global_batch=a.batch,
                             lr=a.lr, seed=a.seed, optimizer=a.optimizer, on_step=show)

    print(f"task {a.task} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.dtype} · batch "
          f"{a.batch} on dp={a.dp} ranks, ZeRO-{a.zero} · {a.optimizer} lr {a.lr}")
    run = spawn(a.dp, rank_main)[0]
    baseline.show_samples(cfg, data_cfg, run.params)
    if not a.check:
        return 0
    ref = baseline.train_single_process(cfg, data_cfg, steps=a.steps, global_batch=a.batch,
                                        lr=a.lr, seed=a.seed, grad_accum=a.grad_accum,
                                        optimizer=a.optimizer)
    d_loss = max((abs(x - y) for x, y in zip(run.losses, ref.losses)), default=0.0)
    d_param = max(float(np.max(np.abs(run.params[k] - v))) for k, v in ref.params.items())
    d_first = abs(run.losses[0] - ref.losses[0]) if ref.losses else 0.0
    # The layouts add the same numbers in a different order (W partial gradients, then
    # their sum), a ~1e-16 difference per step that Adam's 1/sqrt(v) amplifies over many
    # steps; hence a tight bound on the first step and a looser one over the whole run.
    verdict = "OK" if d_first <= 1e-12 and max(d_loss, d_param) <= 1e-6 else "MISMATCH"
    print(f"{verdict}: dp={a.dp} ZeRO-{a.zero} training matches the single-process run "
          f"(float64; |Δ| loss at step 0 = {d_first:.1e}, max over {a.steps} steps = "
          f"{d_loss:.1e}, final params max |Δ| = {d_param:.1e})")
    return 0 if verdict == "OK" else 1
