"""SGD against steps worked out by hand from the formula in optim/sgd.py."""

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.optim import SGD, sgd_step
from tests.helpers import assert_close


def _param(values, grad):
    p = Tensor(np.array(values), requires_grad=True)
    p.grad = np.array(grad)
    return p


def test_two_steps_with_momentum_and_weight_decay_by_hand():
    # lr 0.1, momentum 0.9, wd 0.01, p0 = [1, -2], g = [0.5, 0.25] at both steps.
    # step 1: d = g + wd p = [0.51, 0.23];  buf = d;            p = p - lr buf = [0.949, -2.023]
    # step 2: d = [0.5 + 0.00949, 0.25 - 0.02023] = [0.50949, 0.22977]
    #         buf = 0.9 [0.51, 0.23] + d = [0.96849, 0.43677];   p = [0.852151, -2.066677]
    p = _param([1.0, -2.0], [0.5, 0.25])
    opt = SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    opt.step()
    assert_close(p.data, [0.949, -2.023], atol=1e-12, what="step 1")
    opt.step()
    assert_close(p.data, [0.852151, -2.066677], atol=1e-12, what="step 2")
    assert_close(opt.buffers[0], [0.96849, 0.43677], atol=1e-12, what="momentum buffer")
    assert_close(p.grad, [0.5, 0.25], atol=0, what="the gradient is not modified")


def test_plain_sgd_needs_no_buffer():
    p, g = np.array([1.0, 2.0]), np.array([10.0, -10.0])
    sgd_step(p, g, None, lr=0.01, momentum=0.0, weight_decay=0.0)
    assert_close(p, [0.9, 2.1], atol=1e-15, what="p - lr g")
    with pytest.raises(ValueError, match="buffer"):
        sgd_step(p, g, None, lr=0.01, momentum=0.9, weight_decay=0.0)


def test_lr_is_settable_params_without_grad_are_skipped_and_zero_grad():
    a, b = _param([1.0], [1.0]), Tensor(np.array([5.0]), requires_grad=True)
    opt = SGD([a, b], lr=0.1)
    opt.lr = 0.5
    opt.step()
    assert_close(a.data, [0.5], atol=0, what="lr set per step")
    assert b.data[0] == 5.0
    opt.zero_grad()
    assert a.grad is None and b.grad is None


def test_state_dict_round_trip_continues_identically():
    p1 = _param([1.0, -2.0, 3.0], [0.3, -0.2, 0.1])
    opt1 = SGD([p1], lr=0.05, momentum=0.8)
    opt1.step()
    state, saved_p = opt1.state_dict(), p1.data.copy()
    opt1.step()
    p2 = _param(saved_p, [0.3, -0.2, 0.1])
    opt2 = SGD([p2], lr=0.05, momentum=0.8)
    opt2.load_state_dict(state)
    opt2.step()
    assert np.array_equal(p1.data, p2.data)
    with pytest.raises(ValueError, match="shape"):
        opt2.load_state_dict({"momentum_buffer.0": np.zeros(2)})


def test_float32_stays_float32_and_bad_arguments():
    p = _param(np.ones(3, np.float32), np.ones(3, np.float32))
    SGD([p], lr=0.1, momentum=0.9, weight_decay=0.1).step()
    assert p.data.dtype == np.float32
    with pytest.raises(ValueError, match="lr"):
        SGD([p], lr=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        SGD([p], lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="data"):
        SGD([np.ones(3)], lr=0.1)
