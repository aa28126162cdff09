"""Predicting a training step at scale: step time, tokens/s, MFU and memory of a layout.

minidist runs every parallelism for real on one machine; this module uses the same pieces
to say what a layout would do on a cluster of thousands of GPUs, and shows its work:

    the layout      parallel/compose.Plan and its validation (the mesh, the schedule),
                    Plan.group_ranks on the hardware's nodes (hardware/profiles.py)
    compute         hardware/roofline.gpt_ops: one tp rank's ops per micro-batch, each a
                    list of kernels with their FLOPs and bytes (hardware/op_costs.py)
    communication   collectives/tiers.py: each collective of the layout priced where its
                    group lies (NVLink inside a node, the network across), cheapest algorithm
    the pipeline    parallel/pipeline/schedule_sim.simulate on the real schedule object,
                    with each stage's forward and backward costs (the closed form of
                    schedule_sim.bubble_closed_form when P M is too large to simulate)
    memory          memory/budget.estimate: bytes per GPU by category

One step of a dense GPT (L layers, width C, T positions, vocabulary V), global batch B,
micro-batches of b rows, M = B / (dp b) of them, on P = pp stages of L / P layers:
    kernel time     a GEMM: its FLOPs / (peak eta(I)), I its arithmetic intensity (FLOPs
                    per byte moved, op_costs), eta(I) = eta_max I / (I + I_0): thin GEMMs
                    (a small dimension, as tp slices make them) run further below the
                    peak; any other kernel: its bytes / (rho HBM) or its FLOPs / the
                    vector peak, the larger
    F, B per stage  the forward (backward) kernels of its layers for one micro-batch, plus
                    the tp all-reduces (2 per layer each way, b T C bytes in the format;
                    with sequence parallelism a reduce-scatter and an all-gather instead)
                    and, with full recomputation, the forward again inside B (selective:
                    the attention core again); the first
                    stage adds the embedding, the last the LM head and the loss
    pipeline        the makespan of the schedule with those costs and a p2p message of
                    b T C / tp bytes (Megatron's scatter/gather) between stages
    data parallel   the gradients (2 bytes an element) all-reduced over dp (ZeRO-1/2: a
                    reduce-scatter and an all-gather; ZeRO-3 also all-gathers the
                    parameters for each micro-batch's forward and backward); exposed after
                    the pipeline unless `overlap_dp` (then hidden behind the last backward)
    optimizer       AdamW over my parameters: 34 bytes an element through HBM (fp32 master,
                    m, v read and written, the gradient read, the bf16 copy written)
    step            pipeline + exposed data-parallel time + optimizer
Reported with one convention (observe/throughput.py's): MFU = model FLOPs per step (6N +
12LHQT per token, N every parameter) / (step time x GPUs x peak); HFU adds the recomputed
forward (selective: the attention core's 4LHQT). Megatron's paper reports FLOP/s by its
Eq. 3, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), which counts the recomputation:
`megatron_flops`.

The model: a GPTConfig (minidist's GPT, MoE layers included) or an Architecture
(hardware/architecture.py; the Llama 2 and 3 presets of hardware/llama.py). An
Architecture's ops come from the same gpt_ops (RMSNorm, rotary positions, grouped-query
attention and its smaller qkv GEMM, SwiGLU); tp splits its heads, KV heads and F as
Megatron does; its N counts every parameter, both untied embedding tables and the norms'
gains (H in 12LHQT: the query heads); its memory is hardware/architecture_memory.py's
(Korthikanti's count for GQA and SwiGLU). Modelled on dp, tp with or without SP and pp;
not on cp.

Global parameters (`Efficiency`): eta_max, I_0 and rho, the same for every row; the paper
replay fits them on a third of the published rows and reports the error on the rest.
Left out: attention's causal half (counted whole, as the kernels run), kernel launch
latency, congestion between groups sharing a link, stragglers, data loading.
References: Narayanan et al. 2021, arXiv:2104.04473 (PTD-P, Table 1, Eq. 3); Korthikanti
    et al. 2022, arXiv:2205.05198 (sequence parallelism, selective recomputation, MFU vs HFU);
    Chowdhery et al. 2022, arXiv:2204.02311, App. B (MFU).
Read next: hardware/predict_cli.py (the command), collectives/tiers.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minidist.collectives.tiers import choose
from minidist.hardware import architecture, architecture_layout, architecture_memory
from minidist.hardware import op_costs as oc
from minidist.hardware.architecture import Architecture
from minidist.hardware.profiles import Hardware
from minidist.hardware.roofline import gpt_ops
from minidist.memory import budget
from minidist.memory.budget_models import parameter_count
from minidist.nn import GPTConfig
from minidist.observe.throughput import palm_flops_per_token
from minidist.parallel.compose import Plan
from minidist.parallel.context import memory as context_memory
from minidist.parallel.pipeline.schedule_sim import bubble_closed_form, simulate

SIMULATE_LIMIT = 20_000          # P x M actions at most go through simulate()
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}
PER_LAYER = ("layernorm", "rmsnorm", "qkv matmul", "rotary", "attention", "attn proj matmul",
             "residual add", "fc matmul", "bias + gelu", "gelu", "swiglu", "fc2 matmul",
             "residual grad add", "router", "experts")
DENSE_MLP = ("fc matmul", "bias + gelu", "gelu", "fc2 matmul")


@dataclass(frozen=True)
class Efficiency:
    """The model's global parameters (module docstring)."""

    eta_max: float = 1.0         # the best fraction of the tensor-core peak a GEMM reaches
    knee: float = 10 ** 0.75     # I_0 in ridge points (peak / HBM bandwidth): a GEMM this
                                 # intense reaches half of eta_max
    rho: float = 0.9             # the fraction of HBM bandwidth a memory-bound kernel reaches

    def __post_init__(self) -> None:
        if not (0 < self.eta_max <= 1 and self.knee >= 0 and 0 < self.rho <= 1):
            raise ValueError(f"Efficiency: eta_max={self.eta_max} and rho={self.rho} must be "
                             f"in (0, 1], knee={self.knee} >= 0.")


@dataclass(frozen=True)
class Prediction:
    """One layout's step, in seconds, FLOP/s and bytes (per GPU unless said)."""

    step_s: float
    tokens_per_s: float
    model_flops: float           # per step, 6N + 12LHQT per token
    hardware_flops: float        # per step, with the recomputed forward
    gpus: int
    peak: float
    breakdown: dict              # seconds: compute, recompute, tp, pp, dp, bubble, optimizer
    memory: dict                 # bytes per GPU by category (memory/budget.py), "total"
    fits: bool
    unmodelled: str = ""         # why `memory` is {} although asked for (no formula)

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.gpus * self.peak)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_s * self.gpus * self.peak)

    @property
    def flops_per_gpu(self) -> float:
        """Model FLOP/s per GPU."""
        return self.model_flops / self.step_s / self.gpus


def megatron_flops(cfg: GPTConfig, batch: int, seq: int) -> float:
    """Narayanan et al. 2021, Eq. 3: the FLOPs of one step with activation recomputation,
    96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    l, h, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + V / (16 * l * h))


def _kernel_seconds(k, hw: Hardware, fmt: str, eff: Efficiency) -> float:
    """A kernel's time: GEMMs at eta(F) of the peak, the rest at rho of HBM bandwidth or
    the vector units' rate, the larger."""
    mm = 0.0
    if k.matmul:
        intensity = k.matmul / max(k.bytes, 1)                 # FLOPs per byte
        knee = eff.knee * hw.peak(fmt) / hw.hbm_bytes_per_s      # I_0 in FLOP/B
        eta = eff.eta_max * intensity / (intensity + knee)
        mm = k.matmul / (eta * hw.peak(fmt))
    vector = k.other / hw.peak("fp32") if k.other else 0.0
    return max(mm, vector, k.bytes / (eff.rho * hw.hbm_bytes_per_s))


def _ops_seconds(ops, hw, fmt, eff) -> dict[tuple[str, str], float]:
    """{(phase, op name): seconds of all its runs} of gpt_ops' list."""
    out: dict[tuple[str, str], float] = {}
    for op in ops:
        t = op.times * sum(_kernel_seconds(k, hw, fmt, eff) for k in op.fused)
        out[op.phase, op.name] = out.get((op.phase, op.name), 0.0) + t
    return out


def predict(cfg: GPTConfig | Architecture, plan: Plan, global_batch: int, hw: Hardware, *,
            fmt: str = "bf16", eff: Efficiency = Efficiency(), overlap_dp: bool = False,
            check: bool = True, memory: bool = True, imbalance: float = 1.0) -> Prediction:
    """The step of GPT(cfg) under `plan` with `global_batch` sequences of cfg.block_size
    tokens on `hw` (module docstring); cfg an Architecture (hardware/architecture.py, the
    Llama presets of hardware/llama.py): the step of that model, dense, on dp, tp, SP and pp.
    plan.micro_batches sets M; cfg.recompute "full" recomputes the forward. memory=False
    skips the memory estimate ({} and fits=True), as does a layout memory/budget.py has no
    formula for (MoE, cp with tp: `unmodelled` says).
    imbalance: under expert parallelism, the rows the busiest rank's experts run over the
    balanced share (1: balanced, as a trained router with load balancing keeps it; the
    capacity factor bounds it for an untrained one); every MoE layer waits for that rank."""
    if not imbalance >= 1:
        raise ValueError(f"predict: imbalance={imbalance} must be >= 1 (1: balanced routing).")
    T, L, P, cp = cfg.block_size, cfg.n_layer, plan.pp, plan.cp
    moe = cfg.moe_every if isinstance(cfg, GPTConfig) else 0
    shape = architecture.of(cfg)                 # the dense shapes every op is priced on
    if moe and (plan.tp > 1 or plan.expert_tp > 1):
        raise ValueError("predict: MoE models are modelled with dp, cp, pp and ep; tensor "
                         "parallelism of a MoE model (and --expert-tp) is not modelled yet.")
    if cp > 1 and isinstance(cfg, Architecture):
        raise ValueError(f"predict: context parallelism (cp={cp}) is modelled for minidist's "
                         "GPT; an Architecture's (grouped K/V passed round the ring) is not.")
    if check:
        architecture_layout.validate(cfg, plan, global_batch, T)
    M, s = plan.micro_batches, BYTES[fmt]
    b = global_batch // (plan.dp * M)                          # rows per micro-batch
    topo, groups = hw.topology(), plan.group_ranks(0)
    precision = "bf16" if s == 2 else "float32"
    # my T / cp positions through every per-token op; attention: my share of the scores
    # a MoE GPT's dense shapes: its MoE layers' experts come in through _swap_in_experts
    sec = _ops_seconds(gpt_ops(shape, b, T // cp, precision, tp=plan.tp), hw, fmt, eff)
    if cp > 1:
        whole = _ops_seconds(gpt_ops(shape, b, T, precision, tp=plan.tp), hw, fmt, eff)
        share = max(context_memory.attention_scores(T, cp, plan.cp_algo, plan.cp_layout)) / T**2
        for phase in ("forward", "backward"):
            sec[phase, "attention"] = whole[phase, "attention"] * share
    if moe:
        _swap_in_experts(sec, cfg, b * T // cp, hw, fmt, eff,
                         imbalance if plan.ep > 1 else 1.0)
    layer_f = sum(t for (ph, n), t in sec.items() if ph == "forward" and n in PER_LAYER)
    layer_b = sum(t for (ph, n), t in sec.items() if ph == "backward" and n in PER_LAYER)
    ln = sec["forward", shape.norm] / (2 * L + 1)               # one norm, forward
    ln_b = sec["backward", shape.norm] / (2 * L + 1)
    layer_f, layer_b = (layer_f - ln) / L, (layer_b - ln_b) / L  # ln_f belongs to the head
    embed_f, embed_b = sec["forward", "embedding"], sec["backward", "embedding"]
    head_f = sec["forward", "lm head matmul"] + sec["forward", "cross-entropy"] + ln
    head_b = sec["backward", "lm head matmul"] + sec["backward", "cross-entropy"] + ln_b
    # exposed communication per layer, each way: tp's 2 collectives of b T C / cp bytes,
    # cp's ring passes beyond the attention block they hide behind (or Ulysses' all-to-alls),
    # ep's dispatch and combine (a layer's share of them: MoE layers / L)
    tp_one = 0.0
    if plan.tp > 1:
        n = b * T // cp * shape.n_embd * s
        if plan.sequence_parallel:
            tp_one = choose("reduce_scatter", groups["tp"], n, topo)[1] + \
                choose("all_gather", groups["tp"], n / plan.tp, topo)[1]
        else:
            tp_one = choose("all_reduce", groups["tp"], n, topo)[1]
    cp_f, cp_b = _cp_seconds(cfg, plan, b, s, sec, groups, topo)
    ep_f = ep_b = _ep_seconds(cfg, plan, b * T // cp, s, groups, topo, imbalance) \
        if moe else 0.0
    comm_f, comm_b = 2 * tp_one + cp_f + ep_f, 2 * tp_one + cp_b + ep_b
    recompute, selective = cfg.recompute == "full", cfg.recompute == "selective"
    per_stage = L / P
    # what the backward runs again: the whole forward (with its collectives), or under
    # selective recomputation the attention core (Korthikanti et al. 2022)
    again = layer_f + comm_f if recompute else \
        sec["forward", "attention"] / L if selective else 0.0
    F = [per_stage * (layer_f + comm_f) for _ in range(P)]
    B = [per_stage * (layer_b + comm_b + again) for _ in range(P)]
    F[0] += embed_f
    B[0] += embed_b
    F[-1] += head_f
    B[-1] += head_b
    p2p = 0.0
    if P > 1:
        span = topo.span(groups["pp"][:2])
        link = topo.inter if span[0] > 1 else topo.intra
        p2p = link.alpha + b * T // cp * shape.n_embd * s / plan.tp * link.beta
    pipeline = _pipeline_seconds(plan, F, B, p2p)
    # data parallelism over dp (x cp): the gradients of my dense parameters; my experts'
    # over their replicas (edp x cp)
    dense, experts = _elements(cfg)
    mine = (dense / plan.tp + experts / plan.ep) / P                  # elements on my rank
    dp = _dp_seconds(plan, groups["grad"], dense / (plan.tp * P), s, topo, M)
    if experts:
        dp += _dp_seconds(plan, groups["edp"] if plan.ep > 1 else groups["grad"],
                          experts / (plan.ep * P), s, topo, M)
    last_b = max(B)
    exposed_dp = max(0.0, dp - last_b) if overlap_dp else dp
    optimizer = 34 * mine / (plan.dp if plan.zero else 1) / (eff.rho * hw.hbm_bytes_per_s)
    step = pipeline + exposed_dp + optimizer
    compute = M * max(f + bb for f, bb in zip(F, B))
    tp_total = M * per_stage * (4 + (2 if recompute else 0)) * tp_one
    cp_total = M * per_stage * (cp_f * (1 + recompute) + cp_b)
    ep_total = M * per_stage * (ep_f * (1 + recompute) + ep_b)
    redone = M * per_stage * (layer_f if recompute else again)
    tokens = global_batch * T
    N = _active_elements(cfg)                 # a token's parameters: its top-k experts
    H, Q = shape.n_head, shape.head_dim       # query heads (grouped-query: still all H)
    model = palm_flops_per_token(N, L, H, Q, T) * tokens
    attention = 4 * L * H * Q * T * tokens                    # QK^T and AV, forward
    hardware = model + (2 * N * tokens + attention) * recompute + attention * selective
    mem, unmodelled = {}, ""
    if memory:
        try:
            mem = _memory(cfg, plan, global_batch, T, fmt)
        except ValueError as e:                 # a layout the estimator has no formula for
            unmodelled = str(e)
    return Prediction(
        step_s=step, tokens_per_s=tokens / step, model_flops=model, hardware_flops=hardware,
        gpus=plan.world_size, peak=hw.peak(fmt),
        breakdown={"pipeline": pipeline,
                   "compute": compute - tp_total - cp_total - ep_total - redone,
                   "recompute": redone,
                   "tp exposed": tp_total, "cp exposed": cp_total, "ep exposed": ep_total,
                   "pp p2p": 2 * M * p2p * (P > 1),
                   "bubble": max(0.0, pipeline - compute),
                   "dp exposed": exposed_dp, "optimizer": optimizer},
        memory=mem, fits=not mem or mem["total"] <= hw.hbm_bytes, unmodelled=unmodelled)


def _pipeline_seconds(plan: Plan, F: list, B: list, p2p: float) -> float:
    """The schedule's makespan with these per-stage costs (simulated, or the closed form
    for uniform stages when P M is large)."""
    P, M = plan.pp, plan.micro_batches
    if P == 1:
        return M * (F[0] + B[0])
    if P * M <= SIMULATE_LIMIT:
        return simulate(plan.pipeline_schedule(), {"F": F, "B": B, "W": [0.0] * P},
                        comm=p2p).makespan
    slowest = max(f + b for f, b in zip(F, B)) + 2 * p2p
    name = plan.schedule if isinstance(plan.schedule, str) else "1f1b"
    bubble = bubble_closed_form(name, P, M, plan.chunks)
    return M * slowest / (1 - bubble)


def _cp_seconds(cfg: GPTConfig, plan: Plan, b: int, s: int, sec: dict, groups: dict,
                topo) -> tuple[float, float]:
    """Per layer and micro-batch, the exposed seconds of context parallelism, forward and
    backward (parallel/context/memory.cp_calls: the messages). Ring: each pass of a K/V
    block (or of the dK/dV accumulators) to the next cp rank runs while the previous block
    is attended to, so a pass costs only what exceeds one block's attention (a layer's
    attention / cp); Ulysses: its all-to-alls, nothing to hide them behind."""
    cp, L, T = plan.cp, cfg.n_layer, cfg.block_size
    if cp == 1:
        return 0.0, 0.0
    calls = context_memory.cp_calls(cfg, b, T, cp, plan.cp_algo, plan.tp)
    if plan.cp_algo == "ring":
        link = topo.inter if topo.span(groups["cp"][:2])[0] > 1 else topo.intra
        out = []
        for phase, names in (("forward", ("forward",)), ("backward", ("backward",))):
            block = sec[phase, "attention"] / L / cp
            out.append(sum(c.times / L * max(0.0, link.alpha + c.n * s * link.beta - block)
                           for c in calls if c.what.startswith(names)))
        return out[0], out[1]
    f = sum(c.times / L * choose("all_to_all", groups["cp"], c.n * cp / (cp - 1) * s, topo)[1]
            for c in calls if c.what.startswith("forward"))
    bw = sum(c.times / L * choose("all_to_all", groups["cp"], c.n * cp / (cp - 1) * s, topo)[1]
             for c in calls if c.what.startswith("backward"))
    return f, bw


def _kept(cfg: GPTConfig, tokens: int) -> int:
    """The (token, expert) pairs one rank's experts run for `tokens` tokens when the routing
    is balanced: top_k per token, all of them up to the capacity factor (0: dropless)."""
    cf = cfg.capacity_factor
    return int(cfg.top_k * tokens * (min(1.0, cf) if cf else 1.0))


def _swap_in_experts(sec: dict, cfg: GPTConfig, tokens: int, hw, fmt: str, eff,
                     imbalance: float) -> None:
    """A MoE model's ops: in its MoE layers (every moe_every-th) the dense MLP's ops give way
    to the router (a C x E GEMM), the routed experts on the kept pairs (each rank's experts
    run as many rows as its tokens choose, `_kept`, times the imbalance of the busiest
    rank), the shared experts and the gather and weighted scatter of the rows. `sec` is
    updated in place."""
    L, C, s = cfg.n_layer, cfg.n_embd, BYTES[fmt]
    moe = L // cfg.moe_every
    Fe = cfg.expert_hidden or cfg.mlp_ratio * C
    kept, bias = int(_kept(cfg, tokens) * imbalance), cfg.bias
    forward = [oc.gemm(tokens, C, cfg.n_experts, s), oc.gemm(kept, C, Fe, s, bias),
               oc.bias_gelu(kept, Fe, s, bias), oc.gemm(kept, Fe, C, s, bias),
               oc.residual(kept * C, s), oc.residual(kept * C, s)]
    backward = [oc.gemm_backward(tokens, C, cfg.n_experts, s),
                oc.gemm_backward(kept, C, Fe, s, bias), oc.bias_gelu_backward(kept, Fe, s, bias),
                oc.gemm_backward(kept, Fe, C, s, bias), oc.residual(kept * C, s),
                oc.residual(kept * C, s)]
    if cfg.shared_experts:
        Fs = cfg.shared_experts * Fe
        forward += [oc.gemm(tokens, C, Fs, s, bias), oc.bias_gelu(tokens, Fs, s, bias),
                    oc.gemm(tokens, Fs, C, s, bias)]
        backward += [oc.gemm_backward(tokens, C, Fs, s, bias),
                     oc.bias_gelu_backward(tokens, Fs, s, bias),
                     oc.gemm_backward(tokens, Fs, C, s, bias)]
    for phase, ops in (("forward", forward), ("backward", backward)):
        for name in DENSE_MLP:
            if (phase, name) in sec:
                sec[phase, name] *= (L - moe) / L
        sec[phase, "experts"] = moe * sum(_kernel_seconds(k, hw, fmt, eff)
                                          for fused, _ in ops for k in fused)


def _ep_seconds(cfg: GPTConfig, plan: Plan, tokens: int, s: int, groups: dict, topo,
                imbalance: float) -> float:
    """Per layer (its share of the MoE layers) and micro-batch, one direction's expert-
    parallel all-to-alls: the counts, then the kept rows out (dispatch) and back (combine);
    the backward sends the same rows the other way (parallel/expert/expert_parallel.py).
    The busiest rank's rows (x imbalance) set the pace."""
    if not cfg.moe_every or plan.ep == 1:
        return 0.0
    rows = _kept(cfg, tokens) * imbalance * cfg.n_embd * s
    one = 2 * choose("all_to_all", groups["ep"], rows, topo)[1] + \
        choose("all_to_all", groups["ep"], 8 * cfg.n_experts, topo)[1]
    return one * (cfg.n_layer // cfg.moe_every) / cfg.n_layer


def _elements(cfg: GPTConfig | Architecture) -> tuple[int, int]:
    """(dense, routed-expert) parameter elements of GPT(cfg): a MoE layer's dense MLP
    replaced by its router, shared experts and n_experts experts of width expert_hidden.
    An Architecture: (all of its parameters, architecture.parameter_count, 0)."""
    if isinstance(cfg, Architecture):
        return architecture.parameter_count(cfg), 0
    dense = parameter_count(replace(cfg, moe_every=0))
    if not cfg.moe_every:
        return dense, 0
    C, F = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
    Fe = cfg.expert_hidden or F
    mlp = lambda f: 2 * C * f + (f + C) * cfg.bias                     # noqa: E731
    moe = cfg.n_layer // cfg.moe_every
    dense += moe * (C * cfg.n_experts + (mlp(cfg.shared_experts * Fe) if cfg.shared_experts
                                         else 0) - mlp(F))
    return dense, moe * cfg.n_experts * mlp(Fe)


def _active_elements(cfg: GPTConfig | Architecture) -> int:
    """The parameters one token runs through: the dense ones and top_k experts a MoE layer."""
    dense, experts = _elements(cfg)
    return dense + experts * cfg.top_k // cfg.n_experts if experts else dense


def _dp_seconds(plan: Plan, ranks, elements: float, s: int, topo, M: int) -> float:
    """Seconds of the gradient sync over the dp (x cp) group: all-reduce (ZeRO 0), a
    reduce-scatter of the gradients and an all-gather of the updated parameters (ZeRO 1,
    2), and under ZeRO-3 per micro-batch an all-gather of the parameters for its forward
    and one for its backward and a reduce-scatter of its gradients (the parameters stay
    sharded after the step)."""
    if len(ranks) == 1:
        return 0.0
    n = elements * s
    if plan.zero == 0:
        return choose("all_reduce", ranks, n, topo)[1]
    rs = choose("reduce_scatter", ranks, n, topo)[1]
    ag = choose("all_gather", ranks, n / len(ranks), topo)[1]
    return rs + ag if plan.zero < 3 else M * (rs + 2 * ag)


def _memory(cfg: GPTConfig | Architecture, plan: Plan, batch: int, T: int, fmt: str) -> dict:
    """memory/budget.py's estimate for the layout (bf16 mixed precision's bytes); an
    Architecture's, hardware/architecture_memory.py's."""
    mp = budget.MemoryPlan(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp,
                           cp_algo=plan.cp_algo, zero=plan.zero,
                           recompute=cfg.recompute, micro_batches=plan.micro_batches,
                           sp=plan.sequence_parallel,
                           precision="bf16" if BYTES[fmt] == 2 else "fp32",
                           schedule="gpipe" if plan.schedule == "gpipe" else "1f1b")
    est = architecture_memory.estimate(cfg, mp, batch, T) if isinstance(cfg, Architecture) \
        else budget.estimate(replace(cfg, dropout=0.0), mp, batch, T)
    return {**est.categories(), "total": est.total}


def search(cfg: GPTConfig | Architecture, gpus: int, global_batch: int, hw: Hardware, *,
           fmt: str = "bf16", eff: Efficiency = Efficiency(), micro_batches=(1, 2, 4),
           recompute=("none", "selective", "full"), zero=(0, 1)) -> list[tuple]:
    """Every layout of `gpus` GPUs that Plan.validate accepts and memory/budget.py fits on
    `hw`: tp a power of two dividing the heads (and KV heads), at most a node; pp dividing
    the layers; dp the rest (dividing the batch); each micro-batch size, recomputation and
    ZeRO stage given.
    Returns [(Prediction, Plan, micro-batch, recompute)] fastest first."""
    out = []
    shape = architecture.of(cfg)
    tps = [t for t in (1, 2, 4, 8, 16) if t <= hw.gpus_per_node and shape.n_head % t == 0
           and shape.n_kv_head % t == 0 and shape.ffn_hidden % t == 0]
    for tp in tps:
        for pp in (p for p in range(1, cfg.n_layer + 1) if cfg.n_layer % p == 0):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for mb, rc, z in ((m, r, z) for m in micro_batches for r in recompute
                              for z in zero):
                if global_batch % (dp * mb):
                    continue
                plan = Plan(tp=tp, pp=pp, dp=dp, zero=z, micro_batches=global_batch // (dp * mb),
                            check_placements=False)
                try:
                    architecture_layout.validate(replace(cfg, recompute=rc), plan, global_batch,
                                          cfg.block_size)
                    p = predict(replace(cfg, recompute=rc), plan, global_batch, hw, fmt=fmt,
                                eff=eff, check=False)
                except ValueError:
                    continue
                if p.fits:
                    out.append((p, plan, mb, rc))
    return sorted(out, key=lambda row: row[0].step_s)
