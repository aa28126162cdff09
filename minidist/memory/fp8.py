"""FP8 emulation: E4M3 and E5M2 with per-tensor scaling, the scale taken from an amax history.

An FP8 number is one byte: a sign, e exponent bits and m mantissa bits. Two encodings
share the byte (Micikevicius et al. 2022): E4M3 (e = 4, m = 3, largest 448, no infinity)
for what enters the forward GEMMs, activations and weights, which need precision; E5M2
(e = 5, m = 2, largest 57344, IEEE-like) for gradients, which need range. Neither covers a
tensor's values as they come, so each tensor travels with one fp32 scale s: the GEMM reads
q = fp8(x s) and multiplies its fp32 result by 1 / (s_a s_b).

Choosing s. The best s puts the tensor's largest magnitude, amax, just under the format's
largest value. But amax is only known once the tensor is computed, and a real kernel must
know s before it writes q. Delayed scaling (Transformer Engine's recipe) takes s from the
amaxes the SAME tensor had in its last N uses (the same GEMM operand, earlier steps):

    s = 2^(floor(log2(max_fmt / amax_hist)) - margin),   amax_hist = max of the last N amaxes

then pushes the current amax into the history. The first use has no history, so it scales
by its own amax. A power-of-two s makes x s exact in fp32: the only error is the fp8
rounding. A value that grew beyond the history's range saturates at +-max_fmt (counted in
`DelayedScaling.saturated`); NaN stays NaN.

One rank's view (one quantisation of x by its DelayedScaling d):
    1. s = d.scale(): from the history (or from amax(x) on the first use)
    2. q = fp8(clip(x s, -max_fmt, max_fmt)): ml_dtypes rounds to nearest even
    3. d.record(amax(x)); the GEMM reads q, dequantise(q, s) = q / s in fp32.

Error bound (the tests check it): for x with |x s| in the normal range [tiny, max_fmt],
|dequantise(q, s) - x| <= 2^-(m+1) |x|: 2^-4 for E4M3, 2^-3 for E5M2. Below tiny the
format is subnormal and the bound is absolute, 2^-(m+1) tiny / s.

Emulation: the formats are ml_dtypes' float8_e4m3fn and float8_e5m2 (no bit tricks here);
q is stored as an fp8 array (one byte per element, what a GEMM's input would hold), and
the product is computed in fp32 from the dequantised values, as the tensor core
accumulates in fp32. memory/precision.py decides which tensors go through here.

References: Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433,
    Sec. 2 (per-tensor scaling, higher-precision GEMM outputs) and Sec. 3 (the two
    encodings, E4M3 without infinities);
    NVIDIA Transformer Engine, recipe.DelayedScaling (amax_history_len, margin, "max").
Read next: memory/precision.py (where matmul calls this).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 encoding: its ml_dtypes dtype and what ml_dtypes.finfo says of it."""

    name: str
    dtype: type

    @property
    def max(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).max)

    @property
    def tiny(self) -> float:
        """The smallest normal magnitude."""
        return float(ml_dtypes.finfo(self.dtype).smallest_normal)

    @property
    def mantissa_bits(self) -> int:
        return int(ml_dtypes.finfo(self.dtype).nmant)


E4M3 = Fp8Format("e4m3", ml_dtypes.float8_e4m3fn)
E5M2 = Fp8Format("e5m2", ml_dtypes.float8_e5m2)


def amax(x: np.ndarray) -> float:
    """max |x| (0 for an empty array; NaN if x holds a NaN)."""
    return float(np.max(np.abs(x))) if x.size else 0.0


def scale_for(fmt: Fp8Format, amax_value: float, margin: int = 0) -> float:
    """2^(floor(log2(max_fmt / amax)) - margin): the power of two that brings amax just
    under the format's largest value; 1.0 for amax 0 or not finite (nothing to scale by)."""
    if not (amax_value > 0 and math.isfinite(amax_value)):
        return 1.0
    return 2.0 ** (math.floor(math.log2(fmt.max / amax_value)) - margin)


def quantize(x: np.ndarray, fmt: Fp8Format, scale: float) -> np.ndarray:
    """fp8(clip(x * scale, -max, max)) as an fp8 array (x * scale is exact: a power of 2)."""
    y = np.asarray(x, np.float32) * np.float32(scale)
    np.clip(y, -fmt.max, fmt.max, out=y)            # saturate (NaN passes through)
    return y.astype(fmt.dtype)


def dequantize(q: np.ndarray, scale: float) -> np.ndarray:
    """q / scale in fp32: the values the GEMM multiplies."""
    return q.astype(np.float32) * np.float32(1.0 / scale)


class DelayedScaling:
    """The scaling state of ONE tensor (one operand of one GEMM): its last N amaxes.

    quantize(x) -> (q, s) with s from the history (the first use: from amax(x) itself),
    then records amax(x). `saturated` counts the elements clipped at +-max_fmt so far.
    """

    def __init__(self, fmt: Fp8Format, history_len: int = 16, margin: int = 0) -> None:
        if isinstance(history_len, bool) or not isinstance(history_len, int) \
                or history_len < 1 or isinstance(margin, bool) or not isinstance(margin, int):
            raise ValueError(f"DelayedScaling: history_len={history_len!r} must be an int >= 1 "
                             f"and margin={margin!r} an int (a power-of-two safety factor).")
        self.fmt, self.history_len, self.margin = fmt, history_len, margin
        self.history: list[float] = []
        self.saturated = 0

    def scale(self, current_amax: float) -> float:
        """s from max(history), or from current_amax while the history is empty."""
        hist = max(self.history) if self.history else current_amax
        return scale_for(self.fmt, hist, self.margin)

    def record(self, value: float) -> None:
        """Push one amax; keep the last history_len."""
        self.history.append(value)
        del self.history[:-self.history_len]

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, float]:
        """(q, s): x in this tensor's format with its delayed scale; records amax(x)."""
        a = amax(x)
        s = self.scale(a)
        self.saturated += int(np.count_nonzero(np.abs(x) * s > self.fmt.max))
        q = quantize(x, self.fmt, s)
        if math.isfinite(a):                 # a NaN/inf step must not poison later scales
            self.record(a)
        return q, s
