"""lr_at against its closed form at the warmup, peak and end points."""

import math

import pytest

from minidist.optim import lr_at

LR, MIN_LR, W, S = 6e-4, 6e-5, 10, 110


def _lr(step):
    return lr_at(step, lr=LR, warmup_steps=W, total_steps=S, min_lr=MIN_LR)


def test_warmup_is_linear_from_zero():
    assert _lr(0) == 0.0
    assert math.isclose(_lr(1), LR / 10, rel_tol=1e-15)
    assert math.isclose(_lr(5), LR / 2, rel_tol=1e-15)
    assert math.isclose(_lr(9), LR * 0.9, rel_tol=1e-15)


def test_cosine_from_peak_to_floor():
    assert _lr(W) == LR                                           # q = 0: the peak
    assert math.isclose(_lr(60), (LR + MIN_LR) / 2, rel_tol=1e-15)  # q = 1/2: cos = 0
    # q = 1/4: min_lr + (lr - min_lr) (1 + cos(pi/4)) / 2
    assert math.isclose(_lr(35), MIN_LR + (LR - MIN_LR) * (1 + math.sqrt(0.5)) / 2,
                        rel_tol=1e-14)
    assert _lr(S) == MIN_LR and _lr(S + 1000) == MIN_LR
    steps = [_lr(s) for s in range(W, S + 1)]
    assert all(a >= b for a, b in zip(steps, steps[1:]))         # never increases


def test_edge_cases_and_errors():
    assert lr_at(0, lr=1.0, warmup_steps=0, total_steps=10) == 1.0   # no warmup
    assert lr_at(3, lr=1.0, warmup_steps=3, total_steps=3) == 0.0    # no decay phase
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_at(0, lr=1.0, warmup_steps=5, total_steps=4)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, lr=1.0, warmup_steps=0, total_steps=4)
    with pytest.raises(ValueError, match="min_lr"):
        lr_at(0, lr=1.0, warmup_steps=0, total_steps=4, min_lr=2.0)
