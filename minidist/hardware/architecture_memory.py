"""Memory per GPU of an Architecture's layout: Korthikanti's activation count, generalised.

memory/budget.py estimates minidist's GPT from the arrays its autograd keeps (checked
against measured steps). A Llama block is not built here, so its activations are counted
the way Korthikanti et al. 2022 (arXiv:2205.05198, Sec. 4) count a Megatron GPT layer:
tensor by tensor, what the backward needs, in the layer's own format (b bytes an element,
2 in bf16), leaving out per-row statistics (a norm's 1/rms, attention's log-sum-exp:
R T numbers against R T C). Here that count is generalised to grouped-query attention and
SwiGLU (and the GELU MLP, where it gives back the paper's numbers). Model states (params,
grads, optimizer, ZeRO's buffers) are memory/budget.py's, from this rank's elements
(architecture_layout.unit_numels): the GPT's rules, bytes per element by precision and ZeRO stage.

One layer, one micro-batch of R rows of T positions, on one of t tensor-parallel ranks
(H heads and G KV heads of D = C / H, F the MLP width; T' = T / t with sequence
parallelism, else T: the positions outside the tensor-parallel regions):

    kept for the backward                  elements          Korthikanti (16-bit, MHA, GELU)
    attention
      norm input (its backward rebuilds    R T' C            LayerNorm input        2sbh
        x / rms(x) from x)
      qkv GEMM input (the norm's output;   R T' C            QKV input              2sbh
        under SP kept sharded and
        all-gathered again in backward)
      q of H/t heads, k and v of G/t       R T (H + 2G) D/t  Q, K                   4sbh/t
        heads, after the rotation (QK^T                      V                      2sbh/t
        needs q and k, P v needs v)
      softmax output P, H/t heads          R (H/t) T^2       softmax                2as^2b/t
      proj GEMM input (the heads' outputs) R T C / t         proj input             2sbh/t
    MLP
      norm input                           R T' C            LayerNorm input        2sbh
      fc GEMM input (gate and up share it) R T' C            fc input               2sbh
      SwiGLU: gate g and up u (the         2 R T F / t       GeLU input (F = 4h)    8sbh/t
        backward of silu(g) u needs both)
      fc2 GEMM input silu(g) u             R T F / t         fc2 input              8sbh/t
      (GELU: its input and output,         2 R T F / t)
    dropout                                none: Llama       2 masks sbh, attention's
                                           trains without    mask as^2b/t, output 2as^2b/t

In bytes, with the SwiGLU MLP (its 3 R T F / t; GELU's 2):
    none        R b [4 T' C + T ((H + 2G) D + C + 3F) / t + (H / t) T^2]
    selective   the same without the softmax term: the attention core (QK^T, softmax,
                P v) is recomputed from the kept q, k, v (Korthikanti's Sec. 5; what a
                FlashAttention kernel does anyway, so "none" with FlashAttention keeps this)
    full        R T' C b: the layer's input alone; its backward first runs the layer again
With G = H, the GELU MLP of F = 4C and 16-bit activations this is sbh (8 + 24/t) +
2as^2b/t without SP (a = H, s = T, b = R, h = C) and sbh 32/t + 2as^2b/t with it: Table 2's
sbh (10 + 24/t) + 5as^2b/t and sbh 34/t + 5as^2b/t less the dropout terms (2sbh, or
2sbh/t with SP, and 3as^2b/t); the tests check the reduction and each term by hand.

Around the layers, per micro-batch: the first stage keeps the token ids (R T int64); the
last the final norm's input and the LM head's (2 R T' C b), the softmax of its vocabulary
shard in fp32 as Megatron's vocab-parallel cross-entropy keeps it (R T V' 4, V' = ceil(V /
t)) and the targets (R T int64). A stage holds as many micro-batches at once as its
schedule does (1F1B: min(P - s, M)), and one layer's backward rebuilds what recomputation
dropped (budget.rebuilt_bytes). Every stage is estimated; the layout's figure is the stage
with the largest total (memory/budget.stage_estimates).

One rank's view (stage s of P): units = my tp shard of stage s's layers -> model states;
R, T, T' -> the terms above x my layers (+ embedding, + head and loss) x k_s; + rebuilt.
Communication: none; these are formulas. Context parallelism has no formula here (refused).
References: Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4 (Table 2) and Sec. 5
    (selective recomputation); Ainslie et al. 2023, arXiv:2305.13245 (grouped-query
    attention); Shazeer 2020, arXiv:2002.05202 (SwiGLU); Rajbhandari et al. 2020,
    arXiv:1910.02054 (model states under ZeRO).
Read next: memory/budget.py, hardware/predict.py.
"""

from __future__ import annotations

from minidist.hardware import architecture_layout
from minidist.hardware.architecture import Architecture
from minidist.hardware.architecture_layout import unit_numels
from minidist.memory import budget
from minidist.memory.budget_models import stage_layers
from minidist.parallel.placement import piece_length

MODES = ("none", "selective", "full")
INT64 = 8                                          # token ids and targets


def layer_terms(a: Architecture, rows: int, T: int, tp: int = 1, sp: bool = False,
                mode: str = "none", itemsize: int = 2) -> dict[str, int]:
    """{term: bytes} one layer keeps for the backward of one micro-batch of `rows` sequences
    of T positions on one of tp ranks, under recomputation `mode` (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"layer_terms: recompute={mode!r} must be one of {MODES}.")
    a.check_tp(tp, "layer_terms")
    if sp and (tp == 1 or T % tp):
        raise ValueError(f"layer_terms: sequence parallelism splits T={T} over tp={tp}; it "
                         "needs tp > 1 dividing T.")
    R, C, b, t = rows, a.n_embd, itemsize, tp
    Tl = T // t if sp else T                      # positions outside the tp regions
    if mode == "full":
        return {"block input": R * Tl * C * b}
    mlp = ("gate, up, silu(gate) * up", 3) if a.mlp == "swiglu" else ("gelu input, output", 2)
    terms = {"norm inputs (x2)": 2 * R * Tl * C * b,
             "qkv and fc inputs": 2 * R * Tl * C * b,
             "q, k, v of my heads": R * T * a.qkv_width // t * b,
             "proj input": R * T * C // t * b,
             mlp[0]: mlp[1] * R * T * a.ffn_hidden // t * b}
    if mode == "none":                            # selective rebuilds the attention core
        terms["softmax of my heads"] = R * (a.n_head // t) * T * T * b
    return terms


def micro_batch_terms(a: Architecture, plan: budget.MemoryPlan, rows: int, T: int,
                      stage: int = 0) -> dict[str, int]:
    """{what: bytes} the graph of one micro-batch keeps on a rank of pipeline stage `stage`:
    its layers' terms, the token ids on the first stage, the head and loss on the last."""
    b, tp, C = budget.PRECISIONS[plan.precision].activation, plan.tp, a.n_embd
    Tl = T // tp if plan.sp else T
    n = len(stage_layers(a, plan.pp, stage))
    out = {f"{n} layer{'s' * (n != 1)} x {k}": n * v for k, v in
           layer_terms(a, rows, T, tp, plan.sp, plan.recompute, b).items()}
    if stage == 0:
        out["embedding: token ids (int64)"] = rows * T * INT64
    if stage == plan.pp - 1:
        out["head: final norm input, LM head input"] = 2 * rows * Tl * C * b
        out["loss: fp32 softmax of my vocabulary shard, targets"] = \
            rows * T * (piece_length(a.vocab_size, tp) * max(b, 4) + INT64)
    return out


def estimate_stages(a: Architecture, plan: budget.MemoryPlan, batch: int,
                    seq_len: int | None = None) -> list[budget.Estimate]:
    """One budget.Estimate per pipeline stage for global batches of `batch` sequences of
    seq_len (default block_size) tokens; ValueError if the layout cannot run the model or
    has no formula here (cp > 1)."""
    T = a.block_size if seq_len is None else seq_len
    if not 1 <= T <= a.block_size:
        raise ValueError(f"memory: seq_len={T} must be in 1..block_size={a.block_size}.")
    if plan.cp > 1:
        raise ValueError(f"memory: context parallelism (cp={plan.cp}) of an Architecture has "
                         "no activation formula here (its ring passes grouped K/V); use cp=1.")
    architecture_layout.validate(a, plan.to_plan(), batch, T)
    rows = batch // (plan.dp * plan.micro_batches)
    b, mode = budget.PRECISIONS[plan.precision].activation, plan.recompute
    none, kept = (layer_terms(a, rows, T, plan.tp, plan.sp, m, b) for m in ("none", mode))
    return budget.stage_estimates(plan, lambda s: unit_numels(a, plan.tp, plan.pp, s),
                                  lambda s: micro_batch_terms(a, plan, rows, T, s),
                                  budget.rebuilt_bytes(none, kept, mode))


def estimate(a: Architecture, plan: budget.MemoryPlan, batch: int,
             seq_len: int | None = None) -> budget.Estimate:
    """The Estimate of the stage with the largest total (the layout's per-GPU need)."""
    return max(estimate_stages(a, plan, batch, seq_len), key=lambda e: e.total)


__all__ = ["layer_terms", "micro_batch_terms", "estimate_stages", "estimate"]
