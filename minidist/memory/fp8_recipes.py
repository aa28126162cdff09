"""FP8 recipes: five ways large runs quantise a GEMM's operands to FP8, as named policies.

A GEMM y = a @ b (a (M, K), b (K, N), summed over K) runs on FP8 tensor cores only when both
operands are FP8 codes q with fp32 scales s, x ~ q / s, and the products are accumulated in
fp32. A recipe decides three things: the FP8 format of each tensor role (activation, weight,
gradient); how many elements share one scale (the granularity, always cut along K, so that
a scale factors out of the dot products it touches); and where s comes from (an amax
history, or the tensor itself). memory/fp8.py holds the formats and per-tensor delayed
scaling; this module builds the five recipes on them (m: mantissa bits, max: largest value):

    recipe      one scale per ...                           s                       act/w/grad
    delayed     tensor                                      2^(floor(log2(max /     E4M3/E4M3/E5M2
                                                              amax_hist)) - margin)
    tensorwise  tensor                                      fp32(max / amax)        E4M3/E4M3/E5M2
    rowwise     row of a, column of b (all of K)            2^floor(log2(max/amax)) E4M3 x 3
    blockwise   1 x 128 tile of a along K; 128 x 128 block  fp32(max / amax)        E4M3 x 3
                of a weight b; 128 x 1 tile of a gradient b
    mxfp8       1 x 32 block along K (32 x 1 in b)          1 / X, X = 2^(floor(    E4M3 x 3
                                                              log2 amax) - emax)    (grad E5M2 opt.)

Each GEMM kind names its operands' roles (a linear layer y = x @ w, x (B*T, C_in)):
    fprop  y  = x @ w       a = activation x (..., C_in)   b = weight w (C_in, C_out)
    dgrad  dx = dy @ w^T    a = gradient dy (..., C_out)   b = weight^T (C_out, C_in)
    wgrad  dw = x^T @ dy    a = activation^T (C_in, B*T)   b = gradient dy (B*T, C_out)
Every GEMM quantises its two operands afresh along ITS reduction axis, so a 1-D tile runs
along a different axis in the backward than in the forward (rowwise: x's rows in fprop, its
columns in wgrad), as torchao's axiswise casts, Transformer Engine's columnwise copies and
DeepSeek-V3's 1x128 -> 128x1 tiles do. For per-tensor recipes this gives the codes that
reusing the forward's would.

Where the scale varies along K (blockwise, mxfp8), y[m, n] = sum over K-chunks c of
(q_a[m, c] . q_b[c, n]) / (s_a[m, c] s_b[c, n]): the kernel applies the scales per chunk.
Here every recipe but blockwise computes deq(a) @ deq(b) with np.matmul in fp32, the same
numbers up to fp32 rounding. Blockwise also emulates the Hopper accumulator (DeepSeek-V3,
"increasing accumulation precision"): the H800's FP8 tensor core keeps about 14 bits (for
K = 4096 without promotion they measured a maximum relative error near 2%), so every
N_c = 128 elements of K the partial sum is promoted to fp32 on the CUDA cores, scaled and
added. For each chunk c of `interval` elements of K:
    P_c = q_a[:, c] @ q_b[c, :]     exact (float64: E4M3 products are multiples of 2^-18 below
                                    2^18, so up to 2^17 of them sum within 53 bits)
    R_c = P_c rounded to nearest even to `accum_bits` mantissa bits (the tensor core)
    y  += fp32(R_c) / (s_a s_b)     in fp32, chunk after chunk (the CUDA-core promotion)
    |y - deq(a) @ deq(b)| <= (2^-(accum_bits+1) + (n_c + 4) 2^-24) (|deq a| @ |deq b|),
    n_c = ceil(K / interval); accum_bits = 23 is the plain fp32 chunked sum.
Not emulated: inside a WGMMA the hardware aligns each product to the largest exponent and
truncates, so its error is relative to the largest addend rather than to the partial sum (a
cancelling chunk loses more there than here), and truncation is biased where rounding is
not; nor the order of additions within a chunk, nor the output's rounding to bf16.

Error bound of quantize/dequantize, per element (quantization_error measures it; the tests
check every line):
    normal, in range (tiny <= |x s| <= max): |deq - x| <= eps |x|, eps = 2^-(m+1) (2^-4 E4M3,
        2^-3 E5M2) for power-of-two s (x s and q / s exact); 2^-(m+1) + 2^-22 for an fp32 s
        (x s and q / s each round once more in fp32)
    subnormal (|x s| < tiny): |deq - x| <= 2^-(m+1) tiny / s (half a subnormal step; times
        1 + 2^-16 for an fp32 s)
    saturated (|x s| > max): only where s is not the tile's own amax: delayed (the history
        was too small: unbounded, counted in `saturated`) and mxfp8's spec rounding, where
        amax / X < 2^(emax+1) may exceed max and clips with relative error below
        1 - max / 2^(emax+1) = 1/8 (448/512 and 57344/65536); scale_rounding="ceil" avoids it
    non-finite: a tile (tensor, row, block) holding NaN or +-inf gets scale NaN and
        dequantises to NaN throughout (torchao's amax_to_scale, the MX spec's NaN scale);
        delayed keeps its history's scale and maps inf to NaN (E4M3 has none) or +-inf
        (E5M2). Either way every output that reads it is non-finite. An all-zero tile
        keeps a finite scale and codes 0: exact.

One rank's view (one GEMM call site under Autocast):
    1. site = recipe.new_site() once (delayed: six amax histories, one per operand of
       fprop, dgrad and wgrad, created on first use of the site; the others: None)
    2. forward  y  = recipe.gemm(x, w, "fprop", site)
    3. backward dx = recipe.gemm(dy, w.T, "dgrad", site); dw = recipe.gemm(x.T, dy, "wgrad",
       site). gemm quantises a along its last axis and b along its first, multiplies.
Shapes: a (..., K) (leading axes run as one (M, K) GEMM, M = their product), b (K, N),
y (..., N) float32. Quantized.scales has x's shape with each axis divided (rounded up) by
its tile length: (1, 1) per tensor, (M, 1) rowwise a, (M, ceil(K/128)) blockwise a,
(ceil(K/128), ceil(N/128)) blockwise weight, (ceil(K/32), N) mxfp8 b. Communication: none.

Emulation: codes are ml_dtypes fp8 arrays (round to nearest even after a saturating clip),
scales float32. Inputs are taken as float32.

References:
    NVIDIA Transformer Engine, recipe.DelayedScaling (margin 0, fp8_format HYBRID: E4M3
        forward, E5M2 backward; amax_history_len 1024; amax_compute_algo "max" or
        "most_recent"); its docs give s = FP8_MAX / amax, not rounded to a power of two
        (fp8.py rounds it, and scales a first use by its own amax where TE's history
        starts at zero). TE's Float8BlockScaling and MXFP8BlockScaling default to E4M3 for
        all tensors.
    torchao Float8LinearConfig.from_recipe_name, used by torchtitan's float8 converter:
        "tensorwise" (dynamic per-tensor, E4M3 input and weight, E5M2 grad_output,
        round_scales_to_power_of_2 False, s = fp32(max / max(amax, 1e-12))) and "rowwise"
        (axiswise along each GEMM's reduction axis, E4M3 for all, scales floored to powers
        of two). torchtitan now offers "rowwise" and "rowwise_with_gw_hp"; "tensorwise"
        was its default before.
    DeepSeek-AI 2024, DeepSeek-V3 Technical Report, arXiv:2412.19437, Sec. 3.3 (fine-grained
        1x128 / 128x128 quantisation, E4M3 on all tensors, promotion every N_c = 128).
    OCP Microscaling Formats (MX) Specification v1.0, 2023: Sec. 5.4.1 (E8M0: bias 127,
        2^-127 .. 2^127, 0xFF NaN), Sec. 6.3 (X = 2^(floor(log2 max|V_i|) - emax_elem),
        elements clamped to the largest normal). Mishra et al. 2025, "Recipes for
        Pre-training LLMs with MXFP8", arXiv:2506.08027 (E4M3 for all tensors, scale
        exponent rounded up).
Read next: memory/precision.py (Autocast, which calls a recipe's gemm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from minidist.memory import fp8

RECIPES = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
KINDS = ("fprop", "dgrad", "wgrad")
ROLES = ("activation", "weight", "gradient")
OPERANDS = {"fprop": ("activation", "weight"),      # kind -> (role of a, role of b)
            "dgrad": ("gradient", "weight"),
            "wgrad": ("activation", "gradient")}
AMAX_FLOOR = 1e-12          # torchao's EPS: amax below it scales as if it were 1e-12
E8M0_MIN, E8M0_MAX = -127, 127      # the exponents an E8M0 scale encodes
FORMATS = {"e4m3": fp8.E4M3, "e5m2": fp8.E5M2}


@dataclass(frozen=True)
class Quantized:
    """x as FP8: x ~ codes / scales, each scale repeated over its tile.

    codes: x's shape, fmt's ml_dtypes dtype. scales: float32, x's shape with axis i divided
    (rounded up) by tile[i]; scales[i, j] belongs to x[i*t0:(i+1)*t0, j*t1:(j+1)*t1].
    axis: the reduction axis K of the GEMM this was quantised for (non-negative)."""

    codes: np.ndarray
    scales: np.ndarray
    fmt: fp8.Fp8Format
    tile: tuple[int, ...]
    role: str
    axis: int


def tile_amax(x: np.ndarray, tile: tuple[int, ...]) -> np.ndarray:
    """max |x| over each tile (NaN if the tile holds a NaN, inf if an inf), shape
    ceil(x.shape / tile). The last tile of an axis may be short: padded with zeros."""
    a = np.abs(x)
    pads = [(0, -n % t) for n, t in zip(x.shape, tile)]
    if any(p for _, p in pads):
        a = np.pad(a, pads)
    split = [v for n, t in zip(a.shape, tile) for v in (n // t, t)]   # (n0/t0, t0, n1/t1, ..)
    return a.reshape(split).max(axis=tuple(range(1, 2 * a.ndim, 2)))


def expand(scales: np.ndarray, tile: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """Each scale repeated over its tile: an array that broadcasts against `shape`."""
    out = scales
    for ax, (t, n) in enumerate(zip(tile, shape)):
        if out.shape[ax] > 1:
            out = np.repeat(out, t, axis=ax)[(slice(None),) * ax + (slice(0, n),)]
    return out


def dequantize(q: Quantized) -> np.ndarray:
    """codes / scales in fp32: the values the GEMM multiplies (NaN where the scale is NaN)."""
    with np.errstate(invalid="ignore"):
        return q.codes.astype(np.float32) / expand(q.scales, q.tile, q.codes.shape)


def round_to_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """x (float64) rounded to nearest even with `bits` mantissa bits (bits + 1 significant);
    0, inf and NaN unchanged. x = f 2^e with 0.5 <= |f| < 1: keep f to bits + 1 bits."""
    f, e = np.frexp(x)
    return np.ldexp(np.rint(np.ldexp(f, bits + 1)), e - bits - 1)


def pow2_floor(s: np.ndarray) -> np.ndarray:
    """2^floor(log2 s) for positive finite s, exactly (frexp, not a rounded log2); NaN
    stays NaN."""
    _, e = np.frexp(s)
    return np.where(np.isnan(s), s, np.ldexp(np.ones_like(s), e - 1)).astype(np.float32)


def emax(fmt: fp8.Fp8Format) -> int:
    """The exponent of the format's largest power of two: 8 for E4M3, 15 for E5M2."""
    return math.frexp(fmt.max)[1] - 1


def _encode(x: np.ndarray, fmt: fp8.Fp8Format, scales: np.ndarray, tile: tuple[int, ...],
            role: str, axis: int) -> Quantized:
    """codes = fp8(clip(x s, -max, max)); an infinite x stays infinite where the format
    has infinities (E5M2) and becomes NaN where it has none (E4M3)."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = x * expand(scales, tile, x.shape)
    np.clip(y, -fmt.max, fmt.max, out=y)                  # saturate; NaN passes through
    inf = np.isinf(x)
    if inf.any():
        has_inf = bool(np.isinf(np.float32(np.inf).astype(fmt.dtype)))
        y[inf] = np.copysign(np.inf, x[inf]) if has_inf else np.nan
    return Quantized(y.astype(fmt.dtype), scales, fmt, tile, role, axis)


def _check_int(owner: str, name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{owner}: {name}={value!r} must be an int {span}.")


def _check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name}={value!r} must be one of {choices}.")


@dataclass(frozen=True)
class Recipe:
    """How one recipe quantises a GEMM's operands. The base is per-tensor with torchao's
    dynamic scale; subclasses change the formats, the tiles or the scales, and gemm and
    quantize are written once here."""

    name: ClassVar[str] = ""

    def formats(self) -> dict[str, fp8.Fp8Format]:
        """The FP8 format of each role."""
        return dict.fromkeys(ROLES, fp8.E4M3)

    def format(self, role: str) -> fp8.Fp8Format:
        _check_choice(self.name, "role", role, ROLES)
        return self.formats()[role]

    @property
    def pow2(self) -> bool:
        """True if the scales are powers of two (then x s and q / s are exact in fp32)."""
        return getattr(self, "pow2_scales", True)

    def tile(self, role: str, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        """Tile length per axis of a tensor of `shape` quantised along `axis`: here one
        tile covering the whole tensor."""
        return tuple(max(n, 1) for n in shape)

    def scales(self, fmt: fp8.Fp8Format, amax: np.ndarray) -> np.ndarray:
        """s per tile from the tile's current amax: torchao's amax_to_scale,
        fp32(max / max(amax, 1e-12)), floored to a power of two if self.pow2; NaN for a
        tile holding NaN or inf."""
        a = np.asarray(amax, np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            s = (fmt.max / np.maximum(a, AMAX_FLOOR)).astype(np.float32)
        s = np.where(np.isfinite(a), s, np.float32(np.nan))
        return pow2_floor(s) if self.pow2 else s

    def new_site(self) -> Any:
        """The state one GEMM call site keeps across steps: None for dynamic recipes."""
        return None

    def rel_bound(self, fmt: fp8.Fp8Format) -> float:
        """Relative error bound of a normal, in-range element."""
        return 2.0 ** -(fmt.mantissa_bits + 1) + (0.0 if self.pow2 else 2.0 ** -22)

    def saturation_bound(self, fmt: fp8.Fp8Format) -> float:
        """Relative error bound of a saturated element; 0: this recipe never saturates."""
        return 0.0

    def quantize(self, x: Any, role: str, axis: int = -1, state: Any = None) -> Quantized:
        """x quantised for a GEMM that sums over `axis`, with role's format and tiles."""
        x, axis = _prepare(x, axis, self.name)
        fmt, tile = self.format(role), self.tile(role, x.shape, axis)
        return _encode(x, fmt, self.scales(fmt, tile_amax(x, tile)), tile, role, axis)

    def dequantize(self, q: Quantized) -> np.ndarray:
        return dequantize(q)

    def _state(self, state: Any, kind: str, operand: str) -> Any:
        """The state quantize needs for operand 'a' or 'b' of a `kind` GEMM at this site."""
        return None

    def gemm(self, a: Any, b: Any, kind: str, state: Any = None) -> np.ndarray:
        """a @ b (a (..., K), b (K, N)) -> (..., N) float32, with a quantised along its last
        axis and b along its first, in the roles `kind` gives them; one (M, K) @ (K, N)."""
        a, b = _operands(a, b, kind, self.name)
        role_a, role_b = OPERANDS[kind]
        qa = self.quantize(a, role_a, -1, self._state(state, kind, "a"))
        qb = self.quantize(b, role_b, 0, self._state(state, kind, "b"))
        y = self._product(qa, qb)                                         # (M, N)
        return y.reshape(a.shape[:-1] + (b.shape[1],))

    def _product(self, qa: Quantized, qb: Quantized) -> np.ndarray:
        """deq(a) @ deq(b) in fp32: the tensor core's fp32 accumulation."""
        da = dequantize(qa)
        with np.errstate(invalid="ignore", over="ignore"):
            return da.reshape(_rows(da), da.shape[-1]) @ dequantize(qb)   # (M, K) @ (K, N)


def _rows(x: np.ndarray) -> int:
    """M: the product of x's leading axes (x (..., K) runs as one (M, K) GEMM)."""
    return math.prod(x.shape[:-1])


def _prepare(x: Any, axis: int, owner: str) -> tuple[np.ndarray, int]:
    x = np.asarray(x, np.float32)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{owner}: axis={axis} is out of range for an array of shape "
                         f"{x.shape}; give the GEMM's reduction axis K.")
    return x, axis % x.ndim


def _operands(a: Any, b: Any, kind: str, owner: str) -> tuple[np.ndarray, np.ndarray]:
    _check_choice(owner, "kind", kind, KINDS)
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"{owner}: gemm needs a (..., K) and b (K, N); got a {a.shape} and "
                         f"b {b.shape}. Transpose the operand whose K is not in place.")
    return a, b


@dataclass(frozen=True)
class Delayed(Recipe):
    """Per-tensor scale from the tensor's amax history (memory/fp8.py's DelayedScaling):
    s = 2^(floor(log2(max / amax_hist)) - margin), amax_hist = max of the last history_len
    amaxes ("max") or the last one ("most_recent"); the first use scales by its own amax;
    s is capped at 2^127 (fp32's range). history_len 16 is Policy.fp8_history's default (TE's
    is 1024). fp8_format "hybrid": E4M3 activations and weights, E5M2 gradients; "e4m3":
    E4M3 for all."""

    name: ClassVar[str] = "delayed"
    history_len: int = 16
    algo: str = "max"
    margin: int = 0
    fp8_format: str = "hybrid"

    def __post_init__(self) -> None:
        _check_int(self.name, "history_len", self.history_len, 1)
        _check_choice(self.name, "algo", self.algo, ("max", "most_recent"))
        _check_int(self.name, "margin", self.margin, -64, 64)
        _check_choice(self.name, "fp8_format", self.fp8_format, ("hybrid", "e4m3"))

    def formats(self) -> dict[str, fp8.Fp8Format]:
        grad = fp8.E5M2 if self.fp8_format == "hybrid" else fp8.E4M3
        return {"activation": fp8.E4M3, "weight": fp8.E4M3, "gradient": grad}

    def saturation_bound(self, fmt: fp8.Fp8Format) -> float:
        return math.inf                 # a value beyond the history's range: counted, unbounded

    def new_site(self) -> DelayedSite:
        return DelayedSite(self)

    def _state(self, state: Any, kind: str, operand: str) -> fp8.DelayedScaling:
        if not isinstance(state, DelayedSite):
            raise ValueError(f"delayed: gemm needs the call site's state (recipe.new_site()), "
                             f"got {type(state).__name__}: the scales come from its history.")
        return state.history(kind, operand)

    def quantize(self, x: Any, role: str, axis: int = -1, state: Any = None) -> Quantized:
        """x with the scale of `state`, this tensor's fp8.DelayedScaling (one operand of one
        site: site.history(kind, 'a' or 'b')); counts saturated elements, records amax(x)
        unless x holds NaN or inf (a bad step must not set later scales)."""
        x, axis = _prepare(x, axis, self.name)
        fmt = self.format(role)
        if not isinstance(state, fp8.DelayedScaling) or state.fmt != fmt:
            raise ValueError(f"delayed: quantize needs the tensor's history, an "
                             f"fp8.DelayedScaling in {fmt.name} (site.history(kind, operand)); "
                             f"got {state!r}.")
        finite = np.isfinite(x)
        current = float(np.max(np.abs(x), where=finite, initial=0.0))
        hist = state.history
        amax = current if not hist else (max(hist) if self.algo == "max" else hist[-1])
        # fp8.scale_for can exceed fp32's range (2^128) for amax below ~2^-119: cap it
        s = min(fp8.scale_for(fmt, amax, state.margin), 2.0 ** 127)
        state.saturated += int(np.count_nonzero(np.abs(x[finite]) > fmt.max / s))
        if finite.all():
            state.record(current)
        tile = self.tile(role, x.shape, axis)
        return _encode(x, fmt, np.full((1,) * x.ndim, s, np.float32), tile, role, axis)


class DelayedSite:
    """The amax histories of one GEMM call site: one fp8.DelayedScaling per operand of each
    kind, made on first use. The weight's fprop and dgrad histories see the same amaxes, as
    do the gradient's dgrad and wgrad ones, so they give the scales shared histories would."""

    def __init__(self, recipe: Delayed) -> None:
        self.recipe = recipe
        self.histories: dict[tuple[str, str], fp8.DelayedScaling] = {}

    def history(self, kind: str, operand: str) -> fp8.DelayedScaling:
        _check_choice("delayed", "kind", kind, KINDS)
        _check_choice("delayed", "operand", operand, ("a", "b"))
        if (kind, operand) not in self.histories:
            role = OPERANDS[kind][operand == "b"]
            r = self.recipe
            self.histories[kind, operand] = fp8.DelayedScaling(r.format(role), r.history_len,
                                                               r.margin)
        return self.histories[kind, operand]

    @property
    def saturated(self) -> int:
        """Elements clipped at +-max so far, over every operand of this site."""
        return sum(d.saturated for d in self.histories.values())


@dataclass(frozen=True)
class Tensorwise(Recipe):
    """One scale per tensor from its current amax (torchao "tensorwise"): E4M3 activations
    and weights, E5M2 gradients; s = fp32(max / amax), a power of two only if pow2_scales."""

    name: ClassVar[str] = "tensorwise"
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        _check_choice(self.name, "pow2_scales", self.pow2_scales, (False, True))

    def formats(self) -> dict[str, fp8.Fp8Format]:
        return {"activation": fp8.E4M3, "weight": fp8.E4M3, "gradient": fp8.E5M2}


@dataclass(frozen=True)
class Rowwise(Recipe):
    """One scale per slice along K (torchao "rowwise"): a row of a, a column of b, from its
    current amax, floored to a power of two (pow2_scales); E4M3 for every role."""

    name: ClassVar[str] = "rowwise"
    pow2_scales: bool = True

    def __post_init__(self) -> None:
        _check_choice(self.name, "pow2_scales", self.pow2_scales, (False, True))

    def tile(self, role: str, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        return tuple(max(n, 1) if ax == axis else 1 for ax, n in enumerate(shape))


@dataclass(frozen=True)
class Blockwise(Recipe):
    """DeepSeek-V3's fine-grained recipe: activations and gradients in 1 x tile_len tiles
    along K, weights in tile_len x tile_len blocks, E4M3 for all, s = fp32(max / amax) (a
    power of two if pow2_scales); the product promoted to fp32 every `interval` elements
    of K, each chunk's partial sum first rounded to `accum_bits` mantissa bits (module
    docstring). pow2_scales=True is Transformer Engine's Float8BlockScaling default."""

    name: ClassVar[str] = "blockwise"
    tile_len: int = 128
    interval: int = 128
    accum_bits: int = 14
    pow2_scales: bool = False

    def __post_init__(self) -> None:
        _check_int(self.name, "tile_len", self.tile_len, 1)
        _check_int(self.name, "interval", self.interval, 1, 2 ** 17)
        _check_int(self.name, "accum_bits", self.accum_bits, 1, 23)
        _check_choice(self.name, "pow2_scales", self.pow2_scales, (False, True))
        if self.tile_len % self.interval:
            raise ValueError(f"blockwise: interval={self.interval} must divide tile_len="
                             f"{self.tile_len}: the scales are applied at each promotion, so "
                             "a chunk cannot span two scale tiles.")

    def tile(self, role: str, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        t = self.tile_len
        if role == "weight":
            if len(shape) != 2:
                raise ValueError(f"blockwise: a weight is quantised in {t} x {t} blocks and "
                                 f"must be 2-D; got shape {shape}.")
            return (t, t)
        return tuple(t if ax == axis else 1 for ax in range(len(shape)))

    def accumulation_bound(self, abs_a: np.ndarray, abs_b: np.ndarray) -> np.ndarray:
        """The bound on |gemm - deq(a) @ deq(b)| given |deq a| (M, K) and |deq b| (K, N)."""
        n_c = -(-abs_a.shape[-1] // self.interval)
        eps = 2.0 ** -(self.accum_bits + 1) + (n_c + 4) * 2.0 ** -24
        return eps * (abs_a.astype(np.float64) @ abs_b.astype(np.float64))

    def _product(self, qa: Quantized, qb: Quantized) -> np.ndarray:
        """sum over K-chunks of fp32(round(q_a[:, c] @ q_b[c, :])) / (s_a s_b), in fp32."""
        M, K = _rows(qa.codes), qa.codes.shape[-1]
        ca = qa.codes.astype(np.float64).reshape(M, K)
        cb = qb.codes.astype(np.float64)                                    # (K, N)
        sa = qa.scales.reshape(M, qa.scales.shape[-1])                      # (M, K/t)
        sb = expand(qb.scales, (1, qb.tile[1]), (qb.scales.shape[0], cb.shape[1]))  # (K/t, N)
        y = np.zeros((M, cb.shape[1]), np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            for c0 in range(0, K, self.interval):
                c1, j = min(c0 + self.interval, K), c0 // self.tile_len
                partial = ca[:, c0:c1] @ cb[c0:c1]                          # exact, (M, N)
                r = round_to_bits(partial, self.accum_bits).astype(np.float32)
                y += r / (sa[:, j:j + 1] * sb[j])                           # promotion
        return y


@dataclass(frozen=True)
class Mxfp8(Recipe):
    """OCP MX: blocks of `block` consecutive elements along K share X = 2^(floor(log2 amax)
    - emax) (scale_rounding "floor", the spec) or 2^ceil(log2(amax / max)) ("ceil", NVIDIA's
    recipe), clamped to E8M0's 2^-127 .. 2^127; s = 1 / X. E4M3 elements; gradients in
    grad_format (E4M3 by default, as TE and Mishra et al. do)."""

    name: ClassVar[str] = "mxfp8"
    block: int = 32
    scale_rounding: str = "floor"
    grad_format: str = "e4m3"

    def __post_init__(self) -> None:
        _check_int(self.name, "block", self.block, 1)
        _check_choice(self.name, "scale_rounding", self.scale_rounding, ("floor", "ceil"))
        _check_choice(self.name, "grad_format", self.grad_format, tuple(FORMATS))

    def formats(self) -> dict[str, fp8.Fp8Format]:
        return {"activation": fp8.E4M3, "weight": fp8.E4M3,
                "gradient": FORMATS[self.grad_format]}

    def tile(self, role: str, shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
        return tuple(self.block if ax == axis else 1 for ax in range(len(shape)))

    def saturation_bound(self, fmt: fp8.Fp8Format) -> float:
        if self.scale_rounding == "ceil":
            return 0.0
        return 1.0 - fmt.max / 2.0 ** (emax(fmt) + 1)          # 1/8 for E4M3 and E5M2

    def scales(self, fmt: fp8.Fp8Format, amax: np.ndarray) -> np.ndarray:
        a = np.asarray(amax, np.float64)
        ok = np.isfinite(a) & (a > 0)
        if self.scale_rounding == "floor":
            _, e = np.frexp(np.where(ok, a, 1.0))               # a = f 2^e, f in [0.5, 1)
            x_exp = e - 1 - emax(fmt)                           # floor(log2 a) - emax
        else:
            f, e = np.frexp(np.where(ok, a, 1.0) / fmt.max)
            x_exp = e - (f == 0.5)                              # ceil(log2(a / max))
        x_exp = np.where(a > 0, x_exp, E8M0_MIN)                # amax 0: log2 0 = -inf
        x_exp = np.clip(x_exp, E8M0_MIN, E8M0_MAX)
        s = np.ldexp(np.ones(x_exp.shape, np.float32), (-x_exp).astype(np.int32))
        return np.where(np.isnan(a) | np.isinf(a), np.float32(np.nan), s)


def to_e8m0(q: Quantized) -> np.ndarray:
    """An mxfp8 tensor's shared scales X = 1 / s as the E8M0 bytes the hardware stores
    (ml_dtypes float8_e8m0fnu: biased exponent 127 + log2 X, 0xFF for NaN). Exact: X is a
    power of two in 2^-127 .. 2^127."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.float32(1.0) / q.scales).astype(ml_dtypes.float8_e8m0fnu)


_CLASSES: dict[str, type[Recipe]] = {c.name: c for c in (Delayed, Tensorwise, Rowwise,
                                                         Blockwise, Mxfp8)}


def make_recipe(name: str, **options: Any) -> Recipe:
    """The recipe `name` (one of RECIPES) with its options (each class's fields)."""
    if name not in _CLASSES:
        raise ValueError(f"fp8 recipe {name!r} is not one of {RECIPES}.")
    cls = _CLASSES[name]
    allowed = tuple(f.name for f in fields(cls))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; this recipe takes "
                         f"{allowed or 'no options'}.")
    return cls(**options)


@dataclass(frozen=True)
class QuantError:
    """Measured quantisation error of one tensor against the recipe's bounds.

    n_normal / n_subnormal / n_saturated: finite elements with tiny <= |x s| <= max, below
    tiny, above max. max_rel: over normal ones, against rel_bound. max_floor_ratio: over
    subnormal ones, |error| / (2^-(m+1) tiny / s), at most 1. max_rel_saturated against
    saturation_bound. n_poisoned: finite elements of tiles holding NaN or inf (must come
    back NaN); nonfinite_kept: every NaN/inf input and every poisoned element came back
    non-finite."""

    recipe: str
    role: str
    fmt: str
    n_normal: int
    n_subnormal: int
    n_saturated: int
    n_poisoned: int
    max_rel: float
    rel_bound: float
    max_floor_ratio: float
    max_rel_saturated: float
    saturation_bound: float
    nonfinite_kept: bool

    @property
    def within_bound(self) -> bool:
        return (self.max_rel <= self.rel_bound and self.max_floor_ratio <= 1.0
                and self.max_rel_saturated <= self.saturation_bound and self.nonfinite_kept)


def quantization_error(x: Any, recipe: Recipe, role: str, axis: int = -1,
                       state: Any = None) -> QuantError:
    """Quantise x (delayed: with `state`, or a fresh history, i.e. its own amax) and measure
    the error of every element against the bound of its class (module docstring)."""
    x = np.asarray(x, np.float32)
    if isinstance(recipe, Delayed) and state is None:
        state = fp8.DelayedScaling(recipe.format(role), recipe.history_len, recipe.margin)
    q = recipe.quantize(x, role, axis, state)
    fmt, xs = q.fmt, x.astype(np.float64)
    back = dequantize(q).astype(np.float64)
    s = np.broadcast_to(expand(q.scales, q.tile, x.shape), x.shape).astype(np.float64)
    finite, good = np.isfinite(xs), np.isfinite(s)
    with np.errstate(invalid="ignore", over="ignore"):
        t, err = np.abs(xs) * s, np.abs(back - xs)
        top = fmt.max * (1 + 2.0 ** -22)
        normal = finite & good & (t >= fmt.tiny) & (t <= top)
        sub, sat = finite & good & (t < fmt.tiny), finite & good & (t > top)
        floor = 2.0 ** -(fmt.mantissa_bits + 1) * fmt.tiny / s * (1 + 2.0 ** -16)
        poisoned = finite & ~good

        def worst(v: np.ndarray) -> float:
            return float(v.max()) if v.size else 0.0

        return QuantError(
            recipe.name, role, fmt.name, int(normal.sum()), int(sub.sum()), int(sat.sum()),
            int(poisoned.sum()), worst(err[normal] / np.abs(xs[normal])),
            recipe.rel_bound(fmt), worst(err[sub] / floor[sub]),
            worst(err[sat] / np.abs(xs[sat])), recipe.saturation_bound(fmt),
            bool(np.all(~np.isfinite(back[~finite | poisoned]))))
