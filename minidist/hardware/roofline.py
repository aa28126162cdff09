"""Arithmetic intensity: every op of the GPT, placed under a machine's compute and memory roofs.

A kernel needs time for its arithmetic and time for its memory traffic, and cannot take
less than either: with F FLOPs, Q bytes, a peak of P FLOP/s and a bandwidth of W B/s,
    time >= max(F / P, Q / W).
The ratio I = F / Q (FLOPs per byte, the arithmetic intensity) decides which term wins:
below the ridge point I* = P / W the op is memory-bound (a faster ALU would not help),
above it compute-bound. On an H200, I* = 66.9e12 / 4.8e12 = 14 FLOP/B for FP32 and 206
FLOP/B for BF16 GEMMs on the tensor cores: a LayerNorm (about 1 FLOP/B) sits deep in the
memory-bound region, a large GEMM (hundreds of FLOP/B) under the compute roof.

Q is the op's traffic as hardware/op_costs.py counts it, for the op fused into one kernel
(the compulsory bytes) and for its unfused passes; the gap between the two bounds is what
fusion buys on a memory-bound op, and nothing on a compute-bound one.

One training step's view (`gpt_ops`, then a Roof):
    1. list the step's ops in the order they run, each with how often it runs:
       forward   embedding; per block 2 LayerNorms, the qkv, proj, fc and fc2 GEMMs,
                 attention, bias + GELU, 2 residual adds; ln_f; LM head; cross-entropy
                 (a Llama block, hardware/architecture.py: RMSNorms, rotary positions
                 on q and k, grouped-query attention, SwiGLU instead of GELU)
       backward  the same in reverse (cross-entropy's fused kernel already wrote dz)
       optimizer the global gradient norm and AdamW over every parameter;
    2. an op's kernels run one after another: its bound is the sum over them of
       max(matmul / P_mm, other / P_vec, bytes / W) (P_mm: tensor cores on the GPU; on a
       CPU, whose vector units do both kinds, the two compute terms add up);
    3. memory-bound when the bytes terms outweigh the compute terms.
The roofs: the H200's data sheet (`h200`), or this CPU's measured rates (roofline_cli.py:
NumPy's matmul FLOP/s, via observe/peak.py, and the best of copy, read and write B/s).
On a GPU each launch also costs a few microseconds of overhead, outside the roofline: the
launch counts show where that matters (every op of the tiny demo GPT).

Shapes: R = B*T rows of width C, F = mlp_ratio*C, H heads of D = C/H (G KV heads), V
vocabulary, L layers; bytes per element s = 8, 4, 4 (TF32), 2 (BF16) by precision; AdamW
and the norm keep float32 state under TF32/BF16 (mixed precision's master weights),
float64 else.
No communication: a rank of a parallel layout runs these ops on its shards.

References: Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance
    model for multicore architectures", CACM 52(4); NVIDIA H200 data sheet (dense rates,
    no sparsity); Micikevicius et al. 2018, arXiv:1710.03740 (float32 master weights).
Read next: hardware/roofline_cli.py (this CPU's roofs, the table), gpu/kernels/.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.hardware import architecture
from minidist.hardware import op_costs as oc
from minidist.hardware.architecture import Architecture, parameter_sizes
from minidist.hardware.op_costs import Kernel, Kernels
from minidist.nn import GPTConfig

PRECISIONS = {"float64": 8, "float32": 4, "tf32": 4, "bf16": 2}   # bytes per element
VARIANTS = ("fused", "unfused")
PHASES = ("forward", "backward", "optimizer")

# H200 SXM, dense: FP64 33.5 (its tensor cores 66.9), FP32 66.9, TF32 494.7, BF16 989.4
# TFLOP/s; HBM3e 4.8 TB/s. Elementwise math on TF32/BF16 data runs in FP32 (CUDA cores).
H200_BANDWIDTH = 4.8e12
H200_MATMUL = {"float64": 66.9e12, "float32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12}
H200_VECTOR = {"float64": 33.5e12, "float32": 66.9e12, "tf32": 66.9e12, "bf16": 66.9e12}


@dataclass(frozen=True)
class Op:
    """An op of the step, `times` per step, as one fused kernel list and one unfused."""

    name: str
    phase: str               # "forward", "backward" or "optimizer"
    times: int
    fused: Kernels
    unfused: Kernels

    def kernels(self, variant: str) -> Kernels:
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: use 'fused' or 'unfused'.")
        return self.fused if variant == "fused" else self.unfused

    def flops(self, variant: str = "fused") -> int:
        return self.times * sum(k.flops for k in self.kernels(variant))

    def matmul_flops(self, variant: str = "fused") -> int:
        return self.times * sum(k.matmul for k in self.kernels(variant))

    def bytes(self, variant: str = "fused") -> int:
        return self.times * sum(k.bytes for k in self.kernels(variant))

    def launches(self, variant: str = "fused") -> int:
        return self.times * len(self.kernels(variant))

    def intensity(self, variant: str = "fused") -> float:
        """FLOPs per byte (0 for an op with no traffic)."""
        q = self.bytes(variant)
        return self.flops(variant) / q if q else 0.0


@dataclass(frozen=True)
class Roof:
    """A machine's roofs: matmul and vector FLOP/s, and memory bandwidth in B/s."""

    name: str
    matmul: float
    vector: float
    bandwidth: float
    overlap: bool = True     # matmul and vector units run at once (GPU tensor + CUDA cores)

    def compute_seconds(self, k: Kernel) -> float:
        """matmul/P_mm and other/P_vec: the larger where the two kinds of units overlap,
        their sum where the same units do both (a CPU's vector units)."""
        mm, other = k.matmul / self.matmul, k.other / self.vector
        return max(mm, other) if self.overlap else mm + other

    def kernel_seconds(self, k: Kernel) -> float:
        """The least time kernel k can take here: max(compute time, bytes / W)."""
        return max(self.compute_seconds(k), k.bytes / self.bandwidth)

    def seconds(self, op: Op, variant: str = "fused") -> float:
        """The op's bound per step: its kernels run one after another."""
        return op.times * sum(self.kernel_seconds(k) for k in op.kernels(variant))

    def limit(self, op: Op, variant: str = "fused") -> str:
        """"memory" if the bytes terms are at least the compute terms, summed over the
        kernels; "compute" otherwise; "-" when the op runs no kernel."""
        ks = op.kernels(variant)
        if not ks:
            return "-"                       # nothing runs (done in another op's kernel)
        memory = sum(k.bytes for k in ks) / self.bandwidth
        compute = sum(self.compute_seconds(k) for k in ks)
        return "memory" if memory >= compute else "compute"

    def ridge(self, matmul: bool = True) -> float:
        """I* = peak / bandwidth in FLOP/B: the intensity where the two roofs meet."""
        return (self.matmul if matmul else self.vector) / self.bandwidth


def h200(precision: str = "float32") -> Roof:
    """The H200's data-sheet roofs for `precision` (PRECISIONS)."""
    _check_precision(precision)
    return Roof(f"H200 {precision}", H200_MATMUL[precision], H200_VECTOR[precision],
                H200_BANDWIDTH)


def _check_precision(precision: str) -> int:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is unknown; use one of "
                         f"{', '.join(PRECISIONS)}.")
    return PRECISIONS[precision]


def gpt_ops(cfg: GPTConfig | Architecture, batch: int, T: int | None = None,
            precision: str = "float32", weight_decay: float = 0.0, tp: int = 1) -> list[Op]:
    """The ops of one training step of the model on `batch` sequences of T tokens (default
    block_size), in the order they run, with AdamW; see the module docstring. cfg: a
    GPTConfig, or any Architecture (hardware/architecture.py: a Llama block's RMSNorm,
    rotary positions on q and k, grouped-query attention, SwiGLU MLP, untied head). tp: the
    ops of one rank of tensor parallelism (Megatron's split: its H / tp heads and G / tp KV
    heads, F / tp hidden columns, ceil(V / tp) vocabulary columns, the projections' K / tp
    rows; norms, residuals and the embedding whole; its 1/tp of the split parameters in the
    optimizer)."""
    s = _check_precision(precision)
    if isinstance(cfg, GPTConfig) and cfg.moe_every:
        raise ValueError(f"gpt_ops: moe_every={cfg.moe_every}; the roofline models a dense "
                         "GPT (expert routing is data-dependent). Use moe_every=0.")
    a = architecture.of(cfg)
    T = a.block_size if T is None else T
    if batch < 1 or not 1 <= T <= a.block_size:
        raise ValueError(f"gpt_ops: batch={batch} must be >= 1 and T={T} between 1 and "
                         f"block_size={a.block_size}.")
    a.check_tp(tp, "gpt_ops")
    B, C, L, bias, D = batch, a.n_embd, a.n_layer, a.bias, a.head_dim
    H, G, F, R = a.n_head // tp, a.n_kv_head // tp, a.ffn_hidden // tp, B * T
    V = -(-a.vocab_size // tp)
    sizes = [n // tp for n in parameter_sizes(a)] if tp > 1 else parameter_sizes(a)
    s_opt = 8 if precision == "float64" else 4
    Dq, rope = H * D, a.positions == "rotary"                 # my heads' width: C / tp
    norm, centered = a.norm, a.norm == "layernorm"
    mlp_f, mlp_b = _mlp_ops(a, R, C, F, s)
    rotary = [("rotary", L, oc.rotary(B, T, H + G, D, s))] if rope else []
    fwd = [("embedding", 1, oc.embedding(B, T, C, s, positions=not rope)),
           (norm, 2 * L + 1, oc.layernorm(R, C, s, bias, centered)),
           ("qkv matmul", L, oc.gemm(R, C, (H + 2 * G) * D, s, bias)), *rotary,
           ("attention", L, oc.attention(B, H, T, D, s, G)),
           ("attn proj matmul", L, oc.gemm(R, Dq, C, s, bias)),
           ("residual add", 2 * L, oc.residual(R * C, s)),
           *mlp_f,
           ("lm head matmul", 1, oc.gemm(R, C, V, s)),
           ("cross-entropy", 1, oc.cross_entropy(R, V, s))]
    bwd = [("cross-entropy", 1, oc.cross_entropy_backward(R, V, s)),
           ("lm head matmul", 1, oc.gemm_backward(R, C, V, s)),
           (norm, 2 * L + 1, oc.layernorm_backward(R, C, s, bias, centered)),
           *mlp_b,
           ("attn proj matmul", L, oc.gemm_backward(R, Dq, C, s, bias)),
           ("attention", L, oc.attention_backward(B, H, T, D, s, G)), *rotary,
           ("qkv matmul", L, oc.gemm_backward(R, C, (H + 2 * G) * D, s, bias)),
           ("residual grad add", 2 * L, oc.residual(R * C, s)),
           ("embedding", 1, oc.embedding_backward(B, T, C, V, s, positions=not rope))]
    opt = [("grad norm", 1, oc.grad_norm(sizes, s_opt)),
           ("adamw", 1, oc.adamw(sizes, s_opt, weight_decay))]
    return [Op(name, phase, times, *kernels)
            for phase, rows in zip(PHASES, (fwd, bwd, opt)) for name, times, kernels in rows]


def _mlp_ops(a: Architecture, R: int, C: int, F: int, s: int) -> tuple[list, list]:
    """The MLP's (forward, backward) rows on my F = F / tp columns. GELU: fc (C x F, its bias
    added in the GELU kernel), bias + GELU, fc2 (F x C). SwiGLU: fc = gate and up in one
    C x 2F GEMM (Megatron's linear_fc1), silu(gate) * up, fc2 = down (F x C)."""
    L, bias = a.n_layer, a.bias
    if a.mlp == "gelu":
        act = "bias + gelu" if bias else "gelu"
        fc, fc_b = oc.gemm(R, C, F, s), oc.gemm_backward(R, C, F, s)
        act_f, act_b = oc.bias_gelu(R, F, s, bias), oc.bias_gelu_backward(R, F, s, bias)
    else:
        act = "swiglu"
        fc, fc_b = oc.gemm(R, C, 2 * F, s, bias), oc.gemm_backward(R, C, 2 * F, s, bias)
        act_f, act_b = oc.swiglu(R, F, s), oc.swiglu_backward(R, F, s)
    fc2, fc2_b = oc.gemm(R, F, C, s, bias), oc.gemm_backward(R, F, C, s, bias)
    return ([("fc matmul", L, fc), (act, L, act_f), ("fc2 matmul", L, fc2)],
            [("fc2 matmul", L, fc2_b), (act, L, act_b), ("fc matmul", L, fc_b)])


def totals(ops: list[Op], variant: str = "fused") -> dict[str, int]:
    """{"flops", "matmul_flops", "bytes", "launches"} summed over ops."""
    return {"flops": sum(o.flops(variant) for o in ops),
            "matmul_flops": sum(o.matmul_flops(variant) for o in ops),
            "bytes": sum(o.bytes(variant) for o in ops),
            "launches": sum(o.launches(variant) for o in ops)}


def step_seconds(ops: list[Op], roof: Roof, variant: str = "fused") -> float:
    """The step's bound on `roof`: the sum of its ops' bounds."""
    return sum(roof.seconds(o, variant) for o in ops)
