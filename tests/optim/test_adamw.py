"""AdamW against steps worked out by hand from Algorithm 2 of Loshchilov & Hutter (2019)."""

import math

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.optim import AdamW, adamw_step
from tests.helpers import assert_close

LR, B1, B2, EPS, WD = 0.1, 0.9, 0.999, 1e-8, 0.01


def _param(values, grad):
    p = Tensor(np.array(values), requires_grad=True)
    p.grad = np.array(grad)
    return p


def test_two_steps_by_hand():
    p = _param([1.0, -2.0], [0.5, -0.1])
    opt = AdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    opt.step()
    # t = 1: m = 0.1 g, v = 0.001 g^2, so m_hat = g and v_hat = g^2: the step is lr*sign(g)
    # (slightly less, because of eps), plus the decay lr * wd * p.
    step1 = [1.0 - LR * (0.5 / (0.5 + EPS) + WD * 1.0),            # ~ 0.899000002
             -2.0 - LR * (-0.1 / (0.1 + EPS) + WD * -2.0)]         # ~ -1.89800001
    assert_close(p.data, step1, atol=1e-15, what="step 1")
    p.grad = np.array([-0.3, 0.2])
    opt.step()
    # t = 2: m = 0.9 [0.05, -0.01] + 0.1 [-0.3, 0.2] = [0.015, 0.011]
    #        v = 0.999 [0.00025, 0.00001] + 0.001 [0.09, 0.04] = [0.00033975, 0.00004999]
    #        m_hat = m / (1 - 0.9^2) = m / 0.19,  v_hat = v / (1 - 0.999^2) = v / 0.001999
    m_hat = np.array([0.015, 0.011]) / 0.19
    v_hat = np.array([0.00033975, 0.00004999]) / 0.001999
    step2 = [step1[i] - LR * (m_hat[i] / (math.sqrt(v_hat[i]) + EPS) + WD * step1[i])
             for i in range(2)]
    assert_close(p.data, step2, atol=1e-12, what="step 2")
    assert_close(opt.m[0], [0.015, 0.011], atol=1e-15, what="m after 2 steps")
    assert_close(opt.v[0], [0.00033975, 0.00004999], atol=1e-15, what="v after 2 steps")


def test_weight_decay_is_decoupled_from_the_gradient_scale():
    # Zero gradient: Adam's term is 0, so the step is exactly p - lr * wd * p.
    p, g = np.array([3.0, -4.0]), np.zeros(2)
    m, v = np.zeros(2), np.zeros(2)
    adamw_step(p, g, m, v, lr=0.5, b1=B1, b2=B2, eps=EPS, wd=0.2, t=1)
    assert_close(p, [3.0 * 0.9, -4.0 * 0.9], atol=1e-15, what="pure decay")
    with pytest.raises(ValueError, match="t counts from 1"):
        adamw_step(p, g, m, v, lr=0.5, b1=B1, b2=B2, eps=EPS, wd=0.2, t=0)


@pytest.mark.slow                       # importing torch alone takes seconds
def test_matches_torch_adamw_over_several_steps():
    torch = pytest.importorskip("torch")    # an independent implementation, when installed
    rng = np.random.default_rng(0)
    p0, grads = rng.standard_normal(7), rng.standard_normal((5, 7))
    p = _param(p0.copy(), grads[0])
    opt = AdamW([p], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    tp = torch.tensor(p0.copy(), requires_grad=True)
    topt = torch.optim.AdamW([tp], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for g in grads:
        p.grad = g.copy()
        opt.step()
        tp.grad = torch.tensor(g)
        topt.step()
    # torch applies the decay first (p *= 1 - lr wd): the same math, other rounding.
    assert_close(p.data, tp.detach().numpy(), atol=1e-14, what="5 steps vs torch.optim.AdamW")


def test_state_dict_round_trip_and_float32():
    rng = np.random.default_rng(1)
    p1 = _param(rng.standard_normal(4), rng.standard_normal(4))
    opt1 = AdamW([p1], lr=0.01, weight_decay=0.1)
    opt1.step()
    state, saved_p = opt1.state_dict(), p1.data.copy()
    assert state["step"] == 1 and set(state) == {"step", "m.0", "v.0"}
    opt1.step()
    p2 = _param(saved_p, p1.grad.copy())
    opt2 = AdamW([p2], lr=0.01, weight_decay=0.1)
    opt2.load_state_dict(state)
    opt2.step()
    assert np.array_equal(p1.data, p2.data) and opt2.t == 2

    p32 = _param(saved_p.astype(np.float32), p1.grad.astype(np.float32))
    opt32 = AdamW([p32], lr=0.01, weight_decay=0.1)
    opt32.load_state_dict({k: (v.astype(np.float32) if k != "step" else v)
                           for k, v in state.items()})
    opt32.step()
    assert p32.data.dtype == np.float32 and opt32.m[0].dtype == np.float32
    assert_close(p32.data, p2.data, atol=1e-6, what="float32 step vs float64 step")


def test_bad_hyperparameters():
    p = _param([1.0], [1.0])
    with pytest.raises(ValueError, match="betas"):
        AdamW([p], lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="missing"):
        AdamW([p], lr=0.1).load_state_dict({"step": 1})
