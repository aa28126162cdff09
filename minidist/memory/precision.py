"""Mixed precision: the numbers of a training step in bf16, fp16 or fp8, the update in fp32.

A 16-bit number halves the bytes of every parameter, gradient and saved activation, and
on a GPU runs the GEMMs several times faster. What it cannot do is the update: a step
lr * m / sqrt(v) is often below half an ulp of the weight it is added to, and in 16 bits
it would vanish. So the weights live twice (Micikevicius et al. 2018, Sec. 3.1): an fp32
MASTER copy, which the optimizer updates (its m and v are fp32 too), and the model's
low-precision copy, rounded from the master after each step, which the forward and
backward use. Formats (ml_dtypes.finfo): bf16 has fp32's 8 exponent bits and 7 mantissa
bits; fp16 5 and 10 (max 65504, so gradients need loss scaling: memory/loss_scale.py);
fp8 is used for the GEMM inputs only, on top of bf16, by a recipe (Policy.fp8_recipe):
"delayed" (memory/fp8.py's per-tensor scales from an amax history, the default) or one of
memory/fp8_recipes.py's (tensorwise, rowwise, blockwise, mxfp8).

The policy (`Policy`, one per run):
    parameters      the model's copy in the format (bf16; fp16; bf16 under fp8)
    GEMMs           inputs rounded to the format (fp8: the recipe's formats and scales;
                    delayed: E4M3 forward, E5M2 gradients, each tensor with its own
                    delayed scale), product accumulated in fp32, output rounded to the
                    format (bf16 under fp8). The functions that run their own GEMM (the
                    sequence-parallel all-gather matmul) call autograd's gemm/gemm_grads,
                    which round the same way (`Autocast.gemm`, `Rounded`).
    kept in fp32    FP32_OPS: softmax, log_softmax, layer_norm, cross_entropy (their inputs
                    are upcast; exp, sums and divisions overflow or lose too much in 16
                    bits; Sec. 3.3), and the loss
    other ops       NumPy on the stored dtypes: format op format -> format (each element
                    computed in fp32 and rounded: what an elementwise kernel does);
                    format op fp32 -> fp32
    master, m, v    fp32 (memory/master_weights.py)
    grad_reduce     "low": gradients are stored and summed over dp in the format (2 bytes
                    per element on the wire); "fp32": stored and summed in fp32 (4 bytes),
                    and then the engine's parameter arrays are fp32 arrays holding
                    format-rounded values (minidist's engines keep one dtype for both).

What is emulated, exactly. NumPy has no fast bf16 or fp8 GEMM, so
`Autocast.matmul_forward` rounds with ml_dtypes (round to nearest even) and multiplies the
rounded values in fp32. Arrays stored in the format (ml_dtypes / float16 arrays): what
matmul saves for the backward (bf16/fp16, or fp8 with its scale), the activations between
the GEMMs, and under grad_reduce "low" the parameters and their gradients. Gradients in
flight through the backward are fp32 arrays; the backward GEMMs round their inputs and
outputs to the format, the elementwise backward rules do not round (a real kernel would:
a small optimism). LayerNorm saves its fp32 upcast input (a fused kernel would save the
16-bit one). Nothing here is faster than fp32; it is there to show what the formats do to
the numbers and the bytes.

Every layout runs under the policy (the single process too: baseline.py's `precision`):
the model's pieces hold the rounded copy, MixedPrecision wraps any engine, and a pipeline
stage turns autocast on itself (engine.begin_step). The deterministic mode's tiled layers
round as the GEMMs here do (deterministic/matmul.Operands).

One rank's view of a step (MixedPrecision in mixed_precision.py drives it):
    1. Autocast on (until step()): the autograd's MatMul and FP32_OPS consult it in the
       forward and in whatever the backward recomputes
    2. (fp16) backward of S * loss; gradients summed over dp in grad_reduce's dtype
    3. found inf/NaN anywhere (fp16): skip; else g / S -> fp32, update the master
    4. model copy = round(master), in place.

References: Micikevicius et al. 2018, "Mixed Precision Training", arXiv:1710.03740,
    Sec. 3.1-3.3; Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning
    Training", arXiv:1905.12322; Micikevicius et al. 2022, arXiv:2209.05433 (fp8);
    memory/fp8_recipes.py for the recipes' references.
Read next: memory/loss_scale.py, memory/fp8.py, memory/fp8_recipes.py,
    memory/master_weights.py, memory/mixed_precision.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from minidist.autograd import tensor as core
from minidist.autograd.tensor import Context, Function, Tensor, matmul_grads, mm, unbroadcast
from minidist.memory import fp8
from minidist.memory.fp8_recipes import RECIPES, make_recipe

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
GRAD_REDUCE = ("fp32", "low")
FP32_OPS = ("softmax", "log_softmax", "layer_norm", "cross_entropy")
LOW_DTYPES = tuple(np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16,
                                         ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))


@dataclass(frozen=True)
class Policy:
    """What a run computes in: name in PRECISIONS, grad_reduce in GRAD_REDUCE; fp8's recipe
    (memory/fp8_recipes.RECIPES; "delayed": memory/fp8.py's per-tensor delayed scaling),
    its amax history length and margin."""

    name: str = "fp32"
    grad_reduce: str = "fp32"
    fp8_history: int = 16
    fp8_margin: int = 0
    fp8_recipe: str = "delayed"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS or self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"precision={self.name!r} must be one of {PRECISIONS} and "
                             f"grad_reduce={self.grad_reduce!r} one of {GRAD_REDUCE}.")
        fp8.DelayedScaling(fp8.E4M3, self.fp8_history, self.fp8_margin)   # validates them
        if self.fp8_recipe not in RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} must be one of {RECIPES} "
                             "(memory/fp8_recipes.py).")

    @property
    def low(self) -> bool:
        """False for fp32: nothing changes (the run is bitwise the plain one)."""
        return self.name != "fp32"

    @property
    def dtype(self) -> np.dtype:
        """The 16-bit format of parameters and activations (float32 for fp32)."""
        return np.dtype({"fp32": np.float32, "fp16": np.float16}.get(self.name,
                                                                     ml_dtypes.bfloat16))

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of the engine's parameter and gradient arrays."""
        return self.dtype if self.grad_reduce == "low" else np.dtype(np.float32)

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling: fp16 only (bf16 and fp8's bf16 have fp32's range)."""
        return self.name == "fp16"


def is_low(dtype: Any) -> bool:
    """True for the 16- and 8-bit float dtypes (bf16, float16, the two fp8)."""
    return np.dtype(dtype) in LOW_DTYPES


def round_to(x: Any, dtype: np.dtype) -> np.ndarray:
    """x rounded to nearest-even in `dtype` (no copy if it is already there); fp16 values
    beyond 65504 become inf, as the hardware's would (loss scaling looks for them)."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(dtype, copy=False)


def cast_parameters(model: Any, policy: Policy) -> None:
    """Make the model's parameters the low-precision copy: each p.data rounded to the
    format and stored in policy.storage_dtype. Call it BEFORE an engine is built on the
    model (the engine's buffers take the parameters' dtype). The master copies are then
    made from these values (master_weights.py), as Apex and DeepSpeed do after
    model.half(). A MoE layer's experts run by their plain loop (grouped = False): its
    matmuls are MatMul nodes, whose GEMMs Autocast rounds, where the grouped node's
    (nn/grouped_experts.py) would not be."""
    for p in model.parameters():
        p.data = round_to(p.data, policy.dtype).astype(policy.storage_dtype, copy=False)
    for _, m in model.named_modules():
        if hasattr(m, "grouped"):
            m.grouped = False


class Cast(Function):
    """y = x as fp32 (exact). dx = g, left in fp32: gradients travel in fp32 arrays."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        return x.astype(np.float32)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return (g,)


class Autocast:
    """The mode the operations consult (`with autocast:`, or start() ... stop()): while it
    runs it is autograd/tensor.py's `autocast`.

    MatMul calls matmul_forward / matmul_backward; FP32_OPS call upcast on
    their inputs. Under fp8 each GEMM call site (the k-th matmul since start()) keeps three
    DelayedScaling states: its two inputs (E4M3) and its output gradient (E5M2) (recipe
    "delayed"); another recipe (memory/fp8_recipes.py) quantises each operand of each GEMM
    along its reduction axis, with the recipe's formats, tiles and scales: `recipe`.
    """

    def __init__(self, policy: Policy) -> None:
        if not policy.low:
            raise ValueError("Autocast: the fp32 policy changes nothing; run without it.")
        self.policy, self.dtype = policy, policy.dtype
        self.recipe = make_recipe(policy.fp8_recipe) \
            if policy.name == "fp8" and policy.fp8_recipe != "delayed" else None
        self.sites: list[tuple[fp8.DelayedScaling, ...]] = []
        self._next, self._previous = 0, None

    def start(self) -> None:
        """Make this the active context (if it is not yet); the next matmul is site 0."""
        if core.autocast is not self:
            self._previous, core.autocast = core.autocast, self
        self._next = 0

    def stop(self) -> None:
        """Give back the context that was active before start() (if this one is active)."""
        if core.autocast is self:
            core.autocast, self._previous = self._previous, None

    def __enter__(self) -> "Autocast":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def upcast(self, x: Any) -> Any:
        """x as fp32 if it is stored in a low-precision dtype (a Tensor stays differentiable)."""
        data = x.data if isinstance(x, Tensor) else x
        if data is None or not hasattr(data, "dtype") or not is_low(data.dtype):
            return x
        return Cast.apply(x) if isinstance(x, Tensor) else data.astype(np.float32)

    def _site(self) -> tuple[fp8.DelayedScaling, ...]:
        if self._next == len(self.sites):
            h, m = self.policy.fp8_history, self.policy.fp8_margin
            self.sites.append((fp8.DelayedScaling(fp8.E4M3, h, m),
                               fp8.DelayedScaling(fp8.E4M3, h, m),
                               fp8.DelayedScaling(fp8.E5M2, h, m)))
        self._next += 1
        return self.sites[self._next - 1]

    def matmul_forward(self, ctx: Context, a: Any, b: Any) -> np.ndarray:
        """round(deq(q_a) @ deq(q_b)): inputs in the format (fp8: scaled E4M3), saved as
        stored; the product in fp32; the output rounded to the 16-bit format."""
        ctx.autocast = self
        if self.recipe is not None:                  # another fp8 recipe: fp8_recipes.py
            ctx.save_for_backward(a, b)
            return round_to(recipe_product(self.recipe, a, b), self.dtype)
        if self.policy.name == "fp8":
            ctx.site = self._site()
            (qa, sa), (qb, sb) = ctx.site[0].quantize(a), ctx.site[1].quantize(b)
            ctx.save_for_backward(qa, qb)
            ctx.scales = (sa, sb)
            y = mm(fp8.dequantize(qa, sa), fp8.dequantize(qb, sb))
        else:
            ra, rb = round_to(a, self.dtype), round_to(b, self.dtype)
            ctx.save_for_backward(ra, rb)
            y = mm(ra.astype(np.float32), rb.astype(np.float32))
        return round_to(y, self.dtype)

    def matmul_backward(self, ctx: Context, g: Any) -> tuple:
        """(da, db) of the GEMMs g @ b^T and a^T @ g on rounded inputs (g: E5M2 under fp8),
        accumulated in fp32, rounded to the format and handed back as fp32 arrays."""
        qa, qb = ctx.saved_tensors
        if self.recipe is not None:
            return self.rounded(recipe_grads(self.recipe, qa, qb, g, *ctx.needs_input_grad))
        if self.policy.name == "fp8":
            a, b = fp8.dequantize(qa, ctx.scales[0]), fp8.dequantize(qb, ctx.scales[1])
        else:
            a, b = qa.astype(np.float32), qb.astype(np.float32)
        return self._grads(a, b, g, getattr(ctx, "site", None), *ctx.needs_input_grad)

    def _grads(self, a: Any, b: Any, g: Any, site, need_a: bool, need_b: bool) -> tuple:
        """The backward GEMMs on the rounded operands a, b (fp32 arrays): g rounded (E5M2
        with site's gradient scale under fp8), products in fp32, rounded to the format."""
        if site is not None:
            gq, gs = site[2].quantize(g)
            g = fp8.dequantize(gq, gs)
        else:
            g = round_to(g, self.dtype).astype(np.float32)
        return self.rounded(matmul_grads(a, b, g, need_a, need_b))

    def rounded(self, grads: tuple) -> tuple:
        """Backward GEMM results rounded to the format, handed on as fp32 arrays (None kept)."""
        return tuple(None if d is None else round_to(d, self.dtype).astype(np.float32)
                     for d in grads)

    def gemm(self, a: Any, b: Any) -> tuple:
        """(the rounded GEMM's output, a `Rounded`): matmul_forward's numbers for a Function
        that keeps its operands itself (autograd/tensor.gemm: the sequence-parallel
        all-gather matmul, which gathers x again in the backward instead of saving it)."""
        fp8_site = self.policy.name == "fp8" and self.recipe is None
        how = Rounded(self, self._site() if fp8_site else None)
        if self.recipe is not None:
            return round_to(recipe_product(self.recipe, a, b), self.dtype), how
        ra, rb = how.operands(a, b)
        return round_to(mm(ra, rb), self.dtype), how


def recipe_product(recipe, a: Any, b: Any) -> np.ndarray:
    """a @ b under an fp8 recipe, fp32: a linear layer's (b a weight, 2-D) through
    recipe.gemm ("fprop"); two activations (attention's q k^T, p v: batched b) quantised
    along their reduction axes and multiplied in fp32 (np.matmul broadcasting)."""
    if np.ndim(b) == 2 and np.ndim(a) >= 2:
        return recipe.gemm(a, b, "fprop")
    qa = recipe.dequantize(recipe.quantize(a, "activation", -1))
    qb = recipe.dequantize(recipe.quantize(b, "activation", -2))
    return np.matmul(qa, qb)


def recipe_grads(recipe, a: Any, b: Any, g: Any, need_a: bool, need_b: bool) -> tuple:
    """(da, db) of recipe_product(a, b) for the output gradient g, each GEMM quantising its
    operands along its own reduction axis: da = g b^T ("dgrad": over N), db = a^T g
    ("wgrad": over the rows M)."""
    da = db = None
    if np.ndim(b) == 2 and np.ndim(a) >= 2:
        K, N = b.shape
        if need_a:
            da = recipe.gemm(g, np.ascontiguousarray(b.T), "dgrad").reshape(np.shape(a))
        if need_b:
            db = recipe.gemm(np.ascontiguousarray(np.reshape(a, (-1, K)).T),
                             np.reshape(g, (-1, N)), "wgrad")
        return da, db
    q = recipe.quantize
    if need_a:
        gq = recipe.dequantize(q(g, "gradient", -1))
        bq = recipe.dequantize(q(b, "activation", -1))
        da = unbroadcast(np.matmul(gq, bq.swapaxes(-1, -2)), np.shape(a))
    if need_b:
        aq = recipe.dequantize(q(a, "activation", -2))
        gq = recipe.dequantize(q(g, "gradient", -2))
        db = unbroadcast(np.matmul(aq.swapaxes(-1, -2), gq), np.shape(b))
    return da, db


class Rounded:
    """How one GEMM's operands were rounded (fp8: the site and the two scales used), so that
    the backward rounds the same operands, gathered again, to the same values."""

    def __init__(self, autocast: Autocast, site) -> None:
        self.autocast, self.site, self.scales = autocast, site, None

    def operands(self, a: Any, b: Any) -> tuple:
        """a and b rounded to the format (fp8: quantised; the scales chosen on the first
        call and reused after), as fp32 arrays."""
        if self.site is None:
            dtype = self.autocast.dtype
            return round_to(a, dtype).astype(np.float32), round_to(b, dtype).astype(np.float32)
        if self.scales is None:
            (qa, sa), (qb, sb) = self.site[0].quantize(a), self.site[1].quantize(b)
            self.scales = (sa, sb)
        else:
            sa, sb = self.scales
            qa, qb = fp8.quantize(a, fp8.E4M3, sa), fp8.quantize(b, fp8.E4M3, sb)
        return fp8.dequantize(qa, sa), fp8.dequantize(qb, sb)

    def grads(self, a: Any, b: Any, g: Any, need_a: bool, need_b: bool) -> tuple:
        """(da, db) as MatMul's backward under autocast gives them, from the same a, b."""
        ac = self.autocast
        if ac.recipe is not None:
            return ac.rounded(recipe_grads(ac.recipe, a, b, g, need_a, need_b))
        ra, rb = self.operands(a, b)
        return ac._grads(ra, rb, g, self.site, need_a, need_b)


def plan_policy(plan) -> Policy:
    """The Policy of a Plan that asks for mixed precision (parallel/compose.Plan.policy)."""
    policy = Policy(plan.precision, plan.grad_reduce, fp8_recipe=plan.fp8_recipe)
    if not policy.low:
        raise ValueError("Plan: grad_reduce='low' sums gradients in the low-precision "
                         "format, and precision='fp32' has none; choose precision bf16, "
                         "fp16 or fp8, or grad_reduce='fp32'.")
    return policy


def check_plan(plan, cfg) -> None:
    """ValueError unless mixed precision is built for this Plan and model: any layout of a
    float32 model (its fp32 master weights) without recomputation, but async TP (its chunked
    GEMMs would each take their own fp8 scale)."""
    if cfg.dtype != "float32" or cfg.recompute != "none" or plan.async_tp:
        raise ValueError(
            f"Plan: precision={plan.precision!r} is built for a float32 model (its fp32 "
            f"master weights) without recomputation or async TP; this job has dtype="
            f"{cfg.dtype!r}, recompute={cfg.recompute!r}, async_tp={plan.async_tp}. Use "
            "dtype float32, recompute none and no async TP, or precision fp32.")
