"""PowerSGD (parallel/data/powersgd.py): at full rank the estimate is the exact sum over the
ranks; error feedback makes the estimates' sum lag the gradients' by the last error only;
each step all-reduces exactly r (n + m) numbers per compressible matrix and the rest whole;
the Plan refuses what it does not run with."""

import numpy as np
import pytest

from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel.data.powersgd import PowerSGD, compressed_elements
from minidist.runtime.launch import spawn
from minidist.train import Plan, train_on_rank
from tests.helpers import configs

DATA = DataConfig(task="sort", length=4, seed=1)
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)                 # float64


def _local(rank: int, t: int) -> np.ndarray:
    return np.random.default_rng(100 * rank + t).standard_normal((48, 16))


def _full_rank(ctx):
    """A 48 x 16 gradient at rank 16 (the factors are not fewer numbers, but the algebra
    holds): the estimate equals the sum of the ranks' gradients."""
    e = PowerSGD(GPT(TINY, 0), ctx.world, rank=1, optimizer="sgd")
    e.q[0] = np.random.default_rng(7).standard_normal((16, 16))    # invertible, all ranks
    e.error[0] = np.zeros((48, 16))
    return e.estimate(0, _local(ctx.rank, 0))


def test_at_full_rank_the_estimate_is_the_sum_over_the_ranks():
    got = spawn(2, _full_rank)
    want = _local(0, 0) + _local(1, 0)
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-10)


def _feedback(ctx):
    e = PowerSGD(GPT(TINY, 0), ctx.world, rank=2, optimizer="sgd")
    e.q[0], e.error[0] = np.random.default_rng(7).standard_normal((16, 2)), np.zeros((48, 16))
    sent, true = np.zeros((48, 16)), np.zeros((48, 16))
    for t in range(30):
        sent += e.estimate(0, _local(ctx.rank, t)) / ctx.world_size
        true += _local(ctx.rank, t)
    return sent, true, e.error[0]


def test_error_feedback_makes_the_estimates_lag_by_the_last_error_only():
    for sent, true, error in spawn(2, _feedback):
        np.testing.assert_allclose(sent, true - error, rtol=0, atol=1e-9)
        assert np.linalg.norm(error) > 0                      # rank 2 of 16 does lose some


def test_each_step_all_reduces_r_n_plus_m_numbers_per_matrix():
    textbook = dict(algo="ring", buckets=False)
    psgd = spawn(2, train_on_rank, TINY, DATA, Plan(dp=2, powersgd_rank=2, **textbook),
                 *configs(steps=2, global_batch=8, lr=1e-2, seed=0))
    quiet = spawn(2, train_on_rank, TINY, DATA, Plan(dp=2, local_steps=100, **textbook),
                  *configs(steps=1, global_batch=8, lr=1e-2, seed=0))
    loss_only = quiet[0].bytes_by_axis[0]["dp"]
    shapes = [tuple(p.shape) for p in GPT(TINY, 0).parameters()]
    want = 8 * compressed_elements(shapes, 2)              # W = 2 ring: each number once
    assert all(b["dp"] - loss_only == want for r in psgd for b in r.bytes_by_axis)
    assert want < 8 * sum(int(np.prod(s)) for s in shapes) / 2
    assert np.array_equal(psgd[0].params["wte.weight"], psgd[1].params["wte.weight"])


@pytest.mark.parametrize("fields, says", [
    (dict(dp=2, powersgd_rank=2, zero=1), "not with zero=1"),
    (dict(dp=2, powersgd_rank=2, onebit_warmup=3), "not with .*onebit_warmup=3"),
    (dict(dp=2, powersgd_rank=-2), "powersgd_rank=-2 must be an int >= 0"),
])
def test_layouts_it_does_not_run_on_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        Plan(**fields)
