"""FP8 emulation: the formats are ml_dtypes' (checked against the paper's numbers), the
quantisation error of normal values is within half an ulp of the format, and delayed
scaling takes the scale from the amax history as its docstring says."""

import math

import ml_dtypes
import numpy as np
import pytest

from minidist.memory import fp8


def test_formats_match_the_paper_and_ml_dtypes():
    # Micikevicius et al. 2022, Sec. 3: E4M3 max 448 (no inf), E5M2 max 57344
    assert (fp8.E4M3.mantissa_bits, fp8.E4M3.max) == (3, 448.0)
    assert (fp8.E5M2.mantissa_bits, fp8.E5M2.max) == (2, 57344.0)
    assert (fp8.E4M3.tiny, fp8.E5M2.tiny) == (2.0 ** -6, 2.0 ** -14)
    for f in (fp8.E4M3, fp8.E5M2):
        info = ml_dtypes.finfo(f.dtype)
        assert f.max == float(info.max) and f.mantissa_bits == info.nmant
        assert np.dtype(f.dtype).itemsize == 1


def test_scale_is_the_power_of_two_that_brings_amax_under_the_max():
    assert fp8.scale_for(fp8.E4M3, 1.0) == 256.0             # 448 / 1 -> 2^8 = 256
    assert fp8.scale_for(fp8.E4M3, 448.0) == 1.0
    assert fp8.scale_for(fp8.E4M3, 449.0) == 0.5
    assert fp8.scale_for(fp8.E5M2, 1e-3, margin=1) == 2.0 ** 24   # 57344/1e-3 ~ 2^25.8: 25-1
    assert fp8.scale_for(fp8.E4M3, 0.0) == 1.0 == fp8.scale_for(fp8.E4M3, math.inf)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e4])
def test_quantisation_error_within_half_an_ulp_for_normal_values(fmt, spread):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * spread * np.exp(rng.uniform(-3, 3, 20000))).astype(
        np.float32)
    s = fp8.scale_for(fmt, fp8.amax(x))
    q = fp8.quantize(x, fmt, s)
    assert q.dtype == np.dtype(fmt.dtype)
    back = fp8.dequantize(q, s).astype(np.float64)
    normal = np.abs(x.astype(np.float64) * s) >= fmt.tiny
    assert normal.sum() > 15000                               # the test sees normal values
    rel = np.abs(back - x)[normal] / np.abs(x[normal])
    bound = 2.0 ** -(fmt.mantissa_bits + 1)                   # 2^-4 (E4M3), 2^-3 (E5M2)
    assert rel.max() <= bound, f"{fmt.name}: max relative error {rel.max()} > {bound}"
    assert rel.max() > bound / 2                              # and the bound is nearly met
    sub = ~normal                                             # subnormals: absolute bound
    assert np.all(np.abs(back - x)[sub] <= bound * fmt.tiny / s)


def test_values_beyond_the_range_saturate_and_nan_stays_nan():
    q = fp8.quantize(np.array([1000.0, -1e6, np.nan], np.float32), fp8.E4M3, 1.0)
    out = q.astype(np.float32)
    assert out[0] == 448.0 and out[1] == -448.0 and np.isnan(out[2])


def test_delayed_scaling_uses_the_max_of_the_last_n_amaxes():
    d = fp8.DelayedScaling(fp8.E4M3, history_len=3)
    _, s0 = d.quantize(np.array([2.0], np.float32))          # first use: its own amax
    assert s0 == fp8.scale_for(fp8.E4M3, 2.0) == 128.0
    _, s1 = d.quantize(np.array([0.25], np.float32))         # history [2]: still 128
    assert s1 == 128.0
    q, s2 = d.quantize(np.array([50.0], np.float32))         # history [2, .25]: 128, so 50
    assert s2 == 128.0 and d.saturated == 1                  # saturates (50 * 128 > 448)
    assert q.astype(np.float32)[0] == 448.0
    assert d.history == [2.0, 0.25, 50.0]
    _, s3 = d.quantize(np.array([1.0], np.float32))          # history now max 50
    assert s3 == fp8.scale_for(fp8.E4M3, 50.0) == 8.0
    d.quantize(np.array([1.0], np.float32))
    d.quantize(np.array([1.0], np.float32))                  # 50 falls out of the window
    _, s6 = d.quantize(np.array([1.0], np.float32))
    assert d.history == [1.0, 1.0, 1.0] and s6 == 256.0


def test_a_nan_step_does_not_poison_the_history():
    d = fp8.DelayedScaling(fp8.E5M2, history_len=4)
    d.quantize(np.array([1.0, np.nan], np.float32))
    assert d.history == []


def test_bad_history_is_refused():
    with pytest.raises(ValueError, match="history_len"):
        fp8.DelayedScaling(fp8.E4M3, history_len=0)
