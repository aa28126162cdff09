"""The loss scaler is PyTorch's GradScaler state machine: scripted overflow sequences give
exactly the scales and skips its rules say, and ScaleGrad scales the backward only."""

import numpy as np
import pytest

from minidist.autograd.tensor import Tensor
from minidist.memory.loss_scale import LossScaler, ScaleGrad, ScalerConfig, has_inf_or_nan
from minidist.memory.mixed_precision import found_inf_everywhere


def _run(found: list[bool], **config) -> LossScaler:
    scaler = LossScaler(ScalerConfig(**config))
    for f in found:
        scaler.update(f)
    return scaler


def _expected(found: list[bool], init: float, interval: int) -> list[tuple[float, bool]]:
    """The rules written out step by step, independently: (scale used, stepped) per step."""
    scale, good, out = init, 0, []
    for f in found:
        out.append((scale, not f))
        if f:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == interval:
                scale, good = scale * 2, 0
    return out


def test_defaults_are_pytorchs():
    c = ScalerConfig()
    assert (c.init_scale, c.growth_factor, c.backoff_factor, c.growth_interval) == \
        (65536.0, 2.0, 0.5, 2000)


def test_2000_good_steps_double_the_scale_and_not_one_fewer():
    scaler = _run([False] * 1999)
    assert scaler.scale == 2.0 ** 16 and scaler.good_steps == 1999
    assert scaler.update(False) is True
    assert scaler.scale == 2.0 ** 17 and scaler.good_steps == 0


def test_an_overflow_skips_the_step_halves_the_scale_and_restarts_the_count():
    scaler = _run([False] * 1500)
    assert scaler.update(True) is False                    # skipped
    assert scaler.scale == 2.0 ** 15 and scaler.good_steps == 0
    for _ in range(1999):
        scaler.update(False)
    assert scaler.scale == 2.0 ** 15                       # the 1500 before do not count
    scaler.update(False)
    assert scaler.scale == 2.0 ** 16


@pytest.mark.parametrize("script", [
    "ooxooooxxoooooooooox",           # x: inf/NaN found, o: finite
    "xxxxx",                          # consecutive overflows halve again each time
    "oooooooooooooooooooooooo",       # growth every 4 good steps, repeatedly
    "oooxooooxoooo",
])
def test_scripted_sequences_follow_the_rules(script):
    found = [c == "x" for c in script]
    scaler = _run(found, growth_interval=4)
    assert scaler.history == _expected(found, 65536.0, 4)
    assert scaler.skipped == script.count("x")
    final = _expected(found + [False], 65536.0, 4)[-1][0]   # the scale the next step uses
    assert scaler.scale == final


def test_found_inf_detects_inf_and_nan_anywhere_and_skips_none():
    ok = [np.ones(3, np.float16), None, np.zeros((2, 2), np.float32)]
    assert not has_inf_or_nan(ok)
    assert has_inf_or_nan(ok + [np.array([1.0, np.inf], np.float16)])
    assert has_inf_or_nan([np.array([[np.nan]], np.float32)])
    assert found_inf_everywhere(True) and not found_inf_everywhere(False)   # one process


def test_scale_grad_is_identity_forward_and_times_s_backward():
    x = Tensor(np.array([1.5, -2.0], np.float32), requires_grad=True)
    y = ScaleGrad.apply(x * 3.0, scale=1024.0)
    assert np.array_equal(y.data, np.array([4.5, -6.0], np.float32))
    y.sum().backward()
    assert np.array_equal(x.grad, np.full(2, 3.0 * 1024.0, np.float32))


@pytest.mark.parametrize("bad", [dict(init_scale=0.0), dict(growth_factor=1.0),
                                 dict(backoff_factor=1.0), dict(growth_interval=0),
                                 dict(growth_interval=2.5)])
def test_bad_config_is_refused_with_the_defaults_named(bad):
    with pytest.raises(ValueError, match="65536, 2, 0.5, 2000"):
        ScalerConfig(**bad)
