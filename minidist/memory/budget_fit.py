"""Which plans fit: every layout of a model on G devices whose per-rank estimate fits, cheapest
communication first.

The question users ask of a new machine ("does a 13B model train on eight 141 GB H200s,
and how?") has many answers: dp x tp x pp = G, a ZeRO stage, recomputation or not, bf16
or fp32. `fit` enumerates them, estimates each with memory/budget.py (the largest stage's
total) and keeps those at most `device_memory`, sorted by the bytes a rank sends per
training step, the cost that separates plans which all fit: the smallest first; ties by
recomputation (none, selective, full: the extra compute), then by memory. The table also
shows each plan's pipeline bubble, (P-1)/(M+P-1): the price of pp's small traffic.

Communication per rank and step (b bytes per number: 2 in bf16 / fp16; ring algorithms;
the stage that sends most):
    dp (gradient sync over W = dp)  ZeRO-0 (DDP): all-reduce of my Ψ_r gradients,
                                    2 Ψ_r (W-1)/W; ZeRO 1-3: zero_memory.comm_elements
                                    (1-2: 2 S (W-1); 3: (2M + 1) S (W-1), each unit
                                    gathered twice per micro-batch) + the norm's W - 1
    tp                              4 all-reduces of R T C per layer and micro-batch,
                                    tensor_memory.megatron_layer_bytes (SP: all-gathers and
                                    reduce-scatters, the same bytes), plus the embedding's
                                    g on the first and the head's f on the last stage
    pp                              per micro-batch, the boundary activations R T' C
                                    forward (all but the last stage) and their gradients
                                    backward (all but the first)
with R = B / (dp M) rows per micro-batch of M = B / (dp R) (the micro-batch rows R are
fixed, so every plan trains on the same global batch of B sequences).

One rank's view: none; a loop over plans, each a formula.
Plans skipped: those compose.Plan refuses (a head count or the vocabulary split by tp,
ZeRO-3 with pp).
References: Narayanan et al. 2021, arXiv:2104.04473, Sec. 3 (choosing dp, tp and pp);
    Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 7 (ZeRO's communication).
Read next: memory/budget_cli.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.memory.budget import PRECISIONS, RECOMPUTE, Estimate, MemoryPlan, estimate
from minidist.memory.budget_models import stage_layers, unit_numels
from minidist.nn import GPTConfig
from minidist.parallel.tensor import memory as tm
from minidist.parallel.zero import memory as zm


@dataclass(frozen=True)
class Fit:
    """One plan that fits: its estimate (the largest stage) and bytes sent per rank/step."""

    plan: MemoryPlan
    estimate: Estimate
    comm: dict


def comm_bytes(cfg: GPTConfig, plan: MemoryPlan, batch: int, seq_len: int) -> dict[str, float]:
    """{"dp", "tp", "pp", "total"}: bytes one rank sends per step on the stage that sends
    most (module docstring)."""
    p, W, M = PRECISIONS[plan.precision], plan.dp * plan.cp, plan.micro_batches
    rows, C, T = batch // (plan.dp * M), cfg.n_embd, seq_len // plan.cp
    boundary = rows * (T // plan.tp if plan.sp else T) * C * p.activation
    worst: dict[str, float] = {"total": -1.0}
    for s in range(plan.pp):
        numels = unit_numels(cfg, plan.tp, plan.pp, s)
        if W == 1:
            dp = 0.0
        elif plan.zero == 0:
            dp = 2 * sum(numels) * (W - 1) / W * p.grad
        else:
            dp = float(zm.comm_elements(plan.zero, numels, W, M) * p.grad)
        # a layer's 4 all-reduces, and 1 more (a quarter layer) for the embedding, the head
        layers = len(stage_layers(cfg, plan.pp, s)) + ((s == 0) + (s == plan.pp - 1)) / 4
        tp = M * layers * tm.megatron_layer_bytes(rows, T, C, plan.tp, p.activation)
        pp = M * boundary * ((s < plan.pp - 1) + (s > 0))
        if dp + tp + pp > worst["total"]:
            worst = {"dp": dp, "tp": tp, "pp": pp, "total": dp + tp + pp}
    return worst


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(gpus: int, batch: int, rows: int = 1,
               precisions: tuple[str, ...] = ("bf16",)) -> list[MemoryPlan]:
    """Every plan dp x tp x pp = gpus (cp = 1) with micro-batches of `rows` sequences,
    SP on and off for tp > 1, ZeRO 0-3 (0 only when dp = 1: it has nothing to shard),
    each recomputation and precision."""
    out = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if batch % (dp * rows):
                continue
            for sp in (False, True) if tp > 1 else (False,):
                for zero in range(4 if pp == 1 else 3) if dp > 1 else (0,):
                    for rc in RECOMPUTE:
                        out += [MemoryPlan(dp=dp, tp=tp, pp=pp, zero=zero, recompute=rc,
                                           precision=prec, micro_batches=batch // (dp * rows),
                                           sp=sp) for prec in precisions]
    return out


def fit(cfg: GPTConfig, gpus: int, device_memory: float, batch: int, rows: int = 1,
        seq_len: int | None = None, precisions: tuple[str, ...] = ("bf16",)
        ) -> tuple[list[Fit], int]:
    """(the plans whose estimate is at most device_memory bytes, sorted by communication
    then memory; how many plans were valid in all)."""
    for name in precisions:
        if name not in PRECISIONS:
            raise ValueError(f"fit: precision {name!r} is unknown; choose from "
                             f"{tuple(PRECISIONS)}.")
    if gpus < 1 or batch < 1 or rows < 1 or not device_memory > 0:
        raise ValueError(f"fit: gpus={gpus}, batch={batch}, rows={rows} must be >= 1 and "
                         f"device_memory={device_memory} > 0.")
    T = cfg.block_size if seq_len is None else seq_len
    fits, valid = [], 0
    for plan in candidates(gpus, batch, rows, precisions):
        try:
            est = estimate(cfg, plan, batch, T)
        except ValueError:                    # a layout the model does not split into
            continue
        valid += 1
        if est.total <= device_memory:
            fits.append(Fit(plan, est, comm_bytes(cfg, plan, batch, T)))
    # ties (same traffic): less recomputed compute first, then less memory
    fits.sort(key=lambda f: (f.comm["total"], RECOMPUTE.index(f.plan.recompute),
                             f.estimate.total))
    return fits, valid


__all__ = ["Fit", "comm_bytes", "candidates", "fit"]
