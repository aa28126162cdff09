"""Memory budget: the bytes one rank holds in a training step, by category, before running it.

Whether a model trains at all is decided by memory, and users mostly find out by trial and
out-of-memory. This module says it ahead, per rank, for a GPT and a layout (`MemoryPlan`:
dp, tp, pp, cp, ZeRO stage, recomputation, precision, micro-batches), in six categories:
    params       the parameters I keep: my tp shard of my pipeline stage's layers (ZeRO-3:
                 a 1/W slice of that, W = dp cp the gradient-sync group)
    grads        their gradients (ZeRO-1: the full padded buffer; ZeRO-2 and 3: a slice)
    optimizer    AdamW's m and v (and the fp32 master copy under bf16 / fp16)
    activations  what the autograd keeps for the backward at its peak, the end of a
                 forward: one micro-batch's graph, or the k_s a pipeline stage holds
    buffers      ZeRO's transient full-size arrays at their high-water marks: unsharded
                 gradients (stages 2-3) and gathered parameters (stage 3)
    recompute    with recomputation, what the backward of one layer rebuilds beside what is
                 kept (the dropped terms, and under full recomputation the block's output
                 again, R T' C b), alive until that layer's backward ends
The total adds them up: an upper bound on the peak, since the activations peak at the
end of a forward and ZeRO's gradient buffers during the backward. Every category is
compared with measured bytes by memory/budget_measure.py.

Bytes per element (parameter, gradient, optimizer state K with AdamW, activation):
    fp64  8 8 16 8   minidist's training today: one dtype, no master copy, K = 2b (m, v)
    fp32  4 4  8 4
    bf16  2 2 12 2   mixed precision as ZeRO counts it: K = 4 + 4 + 4 (master, m, v)
    fp16  2 2 12 2   (SGD with momentum: K = b, or 4 + 4; plain SGD: 0, or 4)
Model states are zero_memory.exact_bytes(zero, units, W = dp cp, b, K / b), units the
elements per ZeRO unit of my shard (memory/budget_models.unit_numels); its peaks are
the buffers. Activations of one micro-batch of R = B / (dp M) rows of T positions
(b bytes; T_c = T / cp my positions; T' = T_c / tp under sequence parallelism, else T_c):
    per layer   none       tensor_memory.activation_terms (cp = 1), context_memory's (tp = 1)
                selective  without the attention core's T^2 terms (scores, softmax,
                           attention dropout), plus its query and key positions 8 T:
                           Korthikanti et al.'s selective recomputation keeps q, k, v
                full       the block's input R T' C b, all a recomputed block keeps
                (selective and full: memory/recompute.kept_terms, the recomputation's own)
    embedding   token ids R T_c 8 + positions T_c 8 (int64); tp > 1: the vocabulary-
                parallel lookup and its mask, R T_c (C + 1) b; dropout p > 0: 2 R T' C b
    head, loss  ln_f R T' (C + 1) b, head input R T' C b, softmax R T_c V' b (V' = V, or
                the padded V / tp), targets R T_c 8, R T_c b (tp: two bool masks, 2 R T_c),
                the 1/n scale b
    ZeRO-3      the same: each call keeps its graph for the backward, the unit's
                parameters cut out of it (parallel/zero/stage3.py); their gathers are in
                buffers
A pipeline stage s holds k_s micro-batches at once, schedule_sim.peak_activations (1F1B:
min(P - s, M); GPipe: M): the first stage also the embedding, the last the head and loss.

One rank's view (stage s of P):
    1. units = my tp shard of stage s's layers -> params, grads, optimizer, buffers
    2. R, T_c, T' -> per-layer bytes x my layers (+ embedding, + head and loss) x k_s
    3. + what one layer's backward rebuilds under recomputation (dropped terms, output)
Every stage is estimated; the plan's figure is the stage with the largest total. The
adding up (`stage_estimates`) takes any model that states its units, its terms per
micro-batch and what a layer's backward rebuilds: hardware/architecture_memory.py's Llama
blocks use it too.
Communication: none; these are formulas.

Published examples, reproduced by the tests: `zero_figure1` (Rajbhandari et al. 2020,
Fig. 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB) and
`korthikanti_layer_bytes` (Korthikanti et al. 2022, Table 2 and Sec. 5).
References: Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 3.1, 5 and Fig. 1;
    Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4 (Table 2) and 5 (selective);
    Chen et al. 2016, arXiv:1604.06174 (recomputation); Micikevicius et al. 2018,
    arXiv:1710.03740 (fp32 master weights).
Read next: memory/budget_measure.py (estimate vs measured), memory/budget_fit.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minidist.memory import recompute
from minidist.memory.budget_models import stage_layers, unit_numels
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan
from minidist.parallel.context import memory as cm
from minidist.parallel.pipeline.schedule_sim import peak_activations
from minidist.parallel.placement import piece_length
from minidist.parallel.tensor import memory as tm
from minidist.parallel.zero import memory as zm

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "recompute")


@dataclass(frozen=True)
class Precision:
    """Bytes per element: parameter, gradient, fp32 master copy (0: none), optimizer
    state array, activation."""

    name: str
    param: int
    grad: int
    master: int
    state: int
    activation: int

    def optimizer_bytes(self, optimizer: str) -> int:
        """K: optimizer bytes per parameter element (master copy + state arrays)."""
        return self.master + self.state * zm.STATE_PER_ELEMENT[optimizer]


PRECISIONS = {"fp64": Precision("fp64", 8, 8, 0, 8, 8), "fp32": Precision("fp32", 4, 4, 0, 4, 4),
              "bf16": Precision("bf16", 2, 2, 4, 4, 2), "fp16": Precision("fp16", 2, 2, 4, 4, 2)}


@dataclass(frozen=True)
class MemoryPlan:
    """A layout and the memory options: W = dp tp pp cp ranks; see the module docstring.
    Pipeline schedules: 1F1B and GPipe (interleaved chunks and zero-bubble's deferred
    weight gradients keep other sets of activations, not modelled here)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    recompute: str = "none"
    precision: str = "fp64"
    micro_batches: int = 1
    sp: bool = False
    cp_algo: str = "ring"
    schedule: str = "1f1b"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        for name, value, allowed in (("recompute", self.recompute, RECOMPUTE),
                                     ("precision", self.precision, tuple(PRECISIONS)),
                                     ("schedule", self.schedule, SCHEDULES),
                                     ("optimizer", self.optimizer, tuple(zm.STATE_PER_ELEMENT))):
            if value not in allowed:
                raise ValueError(f"MemoryPlan: {name}={value!r} must be one of {allowed}.")
        self.to_plan()                                    # dp, tp, ..., zero: Plan's checks

    def to_plan(self) -> Plan:
        """The compose.Plan that trains this layout (placement checks off)."""
        return Plan(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, zero=self.zero,
                    micro_batches=self.micro_batches, sequence_parallel=self.sp,
                    cp_algo=self.cp_algo, schedule=self.schedule, check_placements=False)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def describe(self) -> str:
        """'dp=2 tp=2+sp pp=1 zero=1 recompute=none bf16 M=1'."""
        tp = f"tp={self.tp}" + ("+sp" if self.sp else "")
        cp = f" cp={self.cp}({self.cp_algo})" if self.cp > 1 else ""
        return (f"dp={self.dp} {tp} pp={self.pp}{cp} zero={self.zero} "
                f"recompute={self.recompute} {self.precision} M={self.micro_batches}")


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of pipeline stage `stage` by category (module docstring); `held`
    micro-batches of `per_micro_batch` activation bytes, {what: bytes} itemised."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    recompute: int
    held: int = 1
    per_micro_batch: dict = field(default_factory=dict)

    def categories(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}

    @property
    def total(self) -> int:
        return sum(self.categories().values())


def model_states(zero: int, numels: list[int], W: int, precision: str = "fp64",
                 optimizer: str = "adamw", accumulating: bool = False) -> dict[str, int]:
    """zero_memory.exact_bytes for units `numels` over W ranks in `precision`: params,
    grads, optimizer and the ZeRO peaks. accumulating: gradients of several backwards are
    kept before the reduction (micro-batches, or any pipeline: its schedule runs in
    no_sync), so ZeRO-2/3 hold full-size gradient buffers."""
    p = PRECISIONS[precision]
    return zm.exact_bytes(zero, numels, W, p.param, p.optimizer_bytes(optimizer) // p.param,
                          micro_batches=2 if accumulating else 1)


def layer_terms(cfg: GPTConfig, plan: MemoryPlan, rows: int, T: int,
                mode: str = "none") -> dict[str, int]:
    """{term: bytes} one layer keeps for one micro-batch on one rank under recompute `mode`:
    recompute.kept_terms (cp = 1), context_memory.activation_terms or the block input."""
    C, H, F, b = cfg.n_embd, cfg.n_head, cfg.mlp_ratio * cfg.n_embd, _act(plan)
    if plan.cp == 1:
        return recompute.kept_terms(mode, rows, T, C, H, F, tp=plan.tp, sp=plan.sp,
                                    itemsize=b, dropout=cfg.dropout > 0)
    if mode == "full":
        return {"block input": rows * (T // plan.cp) * C * b}
    return cm.activation_terms(rows, T, C, H, F, cp=plan.cp, algo=plan.cp_algo, itemsize=b,
                               dropout=cfg.dropout > 0)


def _mode(plan: MemoryPlan) -> str:
    """What a block keeps: what `recompute` says, under every ZeRO stage (stage 3 keeps each
    call's graph without the unit's parameters, zero/stage3.py)."""
    return plan.recompute


def micro_batch_terms(cfg: GPTConfig, plan: MemoryPlan, rows: int, T: int,
                      stage: int = 0) -> dict[str, int]:
    """{what: bytes} the graph of one micro-batch keeps on a rank of pipeline stage `stage`."""
    b, C, V, tp = _act(plan), cfg.n_embd, cfg.vocab_size, plan.tp
    Tc = T // plan.cp
    Tl = Tc // tp if plan.sp else Tc
    n = len(stage_layers(cfg, plan.pp, stage))
    out = {f"{n} layer{'s' * (n != 1)} x {k}": n * v
           for k, v in layer_terms(cfg, plan, rows, T, _mode(plan)).items()}
    if stage == 0:
        out["embedding: token ids, positions"] = rows * Tc * 8 + Tc * 8
        if tp > 1:
            out["embedding: vocab-parallel lookup, mask"] = rows * Tc * (C + 1) * b
        if cfg.dropout > 0:
            out["embedding: dropout input, mask"] = 2 * rows * Tl * C * b
    if stage == plan.pp - 1:
        out["head: ln_f xhat, 1/sigma; matmul input"] = rows * Tl * (2 * C + 1) * b
        Vl = piece_length(V, tp) if tp > 1 else V
        masks = 2 * rows * Tc if tp > 1 else rows * Tc * b
        out["loss: softmax, targets, masks, 1/n"] = rows * Tc * (Vl * b + 8) + masks + b
    return out


def recompute_bytes(cfg: GPTConfig, plan: MemoryPlan, rows: int, T: int) -> int:
    """What the backward of one layer rebuilds beside what is kept (`rebuilt_bytes` of the
    layer's terms under "none" and under the plan's mode)."""
    mode = _mode(plan)
    return rebuilt_bytes(layer_terms(cfg, plan, rows, T),
                         layer_terms(cfg, plan, rows, T, mode), mode)


def rebuilt_bytes(none: dict[str, int], kept: dict[str, int], mode: str) -> int:
    """From a layer's terms kept without recomputation (`none`) and under `mode` (`kept`):
    the terms the mode drops (selective: the T^2 ones, the rebuilt attention weights among
    them; full, and ZeRO-3: all) and under full the rebuilt block output, the size of the
    kept block input."""
    dropped = sum(v for k, v in none.items() if k not in kept)
    return dropped + (kept["block input"] if mode == "full" else 0)


def estimate_stages(cfg: GPTConfig, plan: MemoryPlan, batch: int,
                    seq_len: int | None = None) -> list[Estimate]:
    """One Estimate per pipeline stage for global batches of `batch` sequences of
    seq_len (default block_size) tokens; ValueError if the plan cannot run the model."""
    T = cfg.block_size if seq_len is None else seq_len
    _check(cfg, plan, batch, T)
    rows = batch // (plan.dp * plan.micro_batches)
    return stage_estimates(plan, lambda s: unit_numels(cfg, plan.tp, plan.pp, s),
                           lambda s: micro_batch_terms(cfg, plan, rows, T, s),
                           recompute_bytes(cfg, plan, rows, T))


def stage_estimates(plan: MemoryPlan, numels: Callable[[int], list[int]],
                    terms: Callable[[int], dict[str, int]], rebuilt: int) -> list[Estimate]:
    """The Estimate of every pipeline stage s from what the model says of it: numels(s), the
    elements per ZeRO unit of my shard there; terms(s), {what: bytes} one micro-batch's
    graph keeps there; rebuilt, what one layer's backward rebuilds. Model states over the
    gradient-sync group W = dp cp; activations: terms(s) x the micro-batches the schedule
    holds at once (schedule_sim.peak_activations). Any model that states these three is
    estimated this way (the GPT here, hardware/architecture_memory.py's Llama blocks)."""
    held = peak_activations(plan.to_plan().pipeline_schedule()) if plan.pp > 1 else [1]
    out = []
    for s in range(plan.pp):
        states = model_states(plan.zero, numels(s), plan.dp * plan.cp, plan.precision,
                              plan.optimizer, accumulating=plan.micro_batches > 1 or plan.pp > 1)
        per = terms(s)
        out.append(Estimate(s, states["params"], states["grads"], states["optimizer"],
                            held[s] * sum(per.values()),
                            states.get("peak_unsharded_grads", 0)
                            + states.get("peak_gathered_params", 0), rebuilt, held[s], per))
    return out


def estimate(cfg: GPTConfig, plan: MemoryPlan, batch: int,
             seq_len: int | None = None) -> Estimate:
    """The Estimate of the stage with the largest total (the plan's per-rank need)."""
    return max(estimate_stages(cfg, plan, batch, seq_len), key=lambda e: e.total)


def _act(plan: MemoryPlan) -> int:
    return PRECISIONS[plan.precision].activation


def _check(cfg: GPTConfig, plan: MemoryPlan, batch: int, T: int) -> None:
    if not 1 <= T <= cfg.block_size:
        raise ValueError(f"memory budget: seq_len={T} must be in 1..block_size="
                         f"{cfg.block_size}; the model has no positions beyond it.")
    if plan.cp > 1 and plan.tp > 1:
        raise ValueError(f"memory budget: cp={plan.cp} with tp={plan.tp} has no activation "
                         "formula (parallel/context/memory.py covers tp = 1); use one of them.")
    if plan.cp > 1 and _mode(plan) == "selective":
        raise ValueError("memory budget: selective recomputation wraps the single-rank "
                         "attention core (nn/attention.py), not ring attention or Ulysses; "
                         "use recompute=full or none with cp > 1.")
    plan.to_plan().validate(cfg, batch, T)


# --- the published examples --------------------------------------------------------------

def zero_figure1() -> dict[int, float]:
    """Rajbhandari et al.'s Fig. 1 through this estimator: one unit of Ψ = 7.5B elements
    on N_d = 64 ranks in bf16 (2 + 2 + K, K = 12); GB (1e9 B) per device, stages 0-3."""
    psi, n = int(zm.PAPER_EXAMPLE["psi"]), zm.PAPER_EXAMPLE["n"]
    out = {}
    for stage in range(4):
        states = model_states(stage, [psi], n, "bf16")
        out[stage] = (states["params"] + states["grads"] + states["optimizer"]) / 1e9
    return out


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer (16-bit, with dropout;
    s sequence, b micro-batch, h hidden, a heads, t tensor-parallel ranks):
        none       sbh (10 + 24/t + 5as/(ht)); with SP sbh (34/t + 5as/(ht))
        selective  sbh (10 + 24/t);            with SP sbh 34/t
        full       2 sbh (only the layer's input is kept)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"korthikanti_layer_bytes: recompute={recompute!r} must be one of "
                         f"{RECOMPUTE}.")
    if recompute == "full":
        return 2 * s * b * h
    total = tm.paper_activation_bytes(s, b, h, a, t, sp)
    return total - 5 * a * s * s * b / t if recompute == "selective" else total


__all__ = ["RECOMPUTE", "PRECISIONS", "CATEGORIES", "Precision", "MemoryPlan", "Estimate",
           "model_states", "layer_terms", "micro_batch_terms", "recompute_bytes",
           "rebuilt_bytes", "estimate_stages", "stage_estimates", "estimate", "zero_figure1",
           "korthikanti_layer_bytes"]
