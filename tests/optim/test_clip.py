"""Global gradient norm and clipping against numbers worked out by hand."""

import math

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.optim import clip_grad_norm, global_grad_norm
from tests.helpers import assert_close


def _params(*grads):
    ps = []
    for g in grads:
        p = Tensor(np.zeros(np.shape(g)), requires_grad=True)
        p.grad = None if g is None else np.array(g, dtype=float)
        ps.append(p)
    return ps


def test_global_norm_is_the_norm_of_all_gradients_as_one_vector():
    # [3, 4] and [[12]]: sqrt(9 + 16 + 144) = 13
    assert global_grad_norm([np.array([3.0, 4.0]), np.array([[12.0]]), None]) == 13.0
    assert global_grad_norm([]) == 0.0
    g = np.random.default_rng(0).standard_normal((3, 5))
    assert math.isclose(global_grad_norm([g[:1], g[1:]]), np.linalg.norm(g), rel_tol=1e-14)


def test_clip_scales_every_gradient_by_the_same_factor():
    ps = _params([3.0, 4.0], [[12.0]], None)
    norm = clip_grad_norm(ps, max_norm=6.5)
    scale = 6.5 / (13.0 + 1e-6)                                  # max_norm / (norm + 1e-6)
    assert norm == 13.0
    assert_close(ps[0].grad, [3.0 * scale, 4.0 * scale], atol=1e-15, what="first")
    assert_close(ps[1].grad, [[12.0 * scale]], atol=1e-15, what="second")
    assert ps[2].grad is None
    assert math.isclose(global_grad_norm([p.grad for p in ps]), 6.5, rel_tol=1e-6)


def test_no_clipping_below_the_threshold_and_bad_max_norm():
    ps = _params([3.0, 4.0])
    assert clip_grad_norm(ps, max_norm=5.0) == 5.0
    assert_close(ps[0].grad, [3.0, 4.0], atol=0, what="untouched at norm == max_norm")
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(ps, max_norm=0.0)


def test_float32_gradients_stay_float32():
    p = Tensor(np.zeros(4, np.float32), requires_grad=True)
    p.grad = np.full(4, 10.0, dtype=np.float32)
    assert math.isclose(clip_grad_norm([p], 1.0), 20.0, rel_tol=1e-7)
    assert p.grad.dtype == np.float32
