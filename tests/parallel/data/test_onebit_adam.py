"""1-bit Adam (parallel/data/onebit_adam.py): the compression with error feedback loses
nothing over steps (the compressed sum lags the true one by the last error only, which stays
bounded); the warm-up sends DDP's bytes, the compressed steps exactly the formula's (signs
packed 8 to a byte, and scales): at most 1/16 of DDP's gradient bytes (1/64 in float64);
the replicas stay identical; the Plan and the command refuse what it does not run with."""

import math

import numpy as np
import pytest

from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel.data.onebit_adam import compress, decompress
from minidist.runtime.launch import spawn
from minidist.train import Plan, train_on_rank
from tests.helpers import configs

DATA = DataConfig(task="sort", length=4, seed=1)
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)                 # float64


def test_error_feedback_makes_the_compressed_sum_lag_by_the_last_error_only():
    rng = np.random.default_rng(0)
    error, sent, true = np.zeros(1000), np.zeros(1000), np.zeros(1000)
    for t in range(200):
        x = rng.standard_normal(1000) * (1 + t % 7)
        before = x + error
        signs, scale, error = compress(x, error)
        assert scale == pytest.approx(np.linalg.norm(before) / math.sqrt(1000), rel=1e-12)
        assert np.linalg.norm(error) <= np.linalg.norm(before) * (1 + 1e-12)
        sent += decompress(signs, scale)
        true += x
    np.testing.assert_allclose(sent, true - error, rtol=0, atol=1e-9)


def _run(plan: Plan, steps: int, **kw):
    return spawn(plan.world_size, train_on_rank, TINY, DATA, plan,
                 *configs(steps=steps, global_batch=8, lr=1e-2, seed=0, **kw))


def test_the_warm_up_sends_ddp_s_bytes_and_the_compressed_steps_one_bit_per_element():
    textbook = dict(algo="ring", buckets=False)
    warm, steps = 2, 4
    ddp = _run(Plan(dp=2, **textbook), steps)
    onebit = _run(Plan(dp=2, onebit_warmup=warm, **textbook), steps)
    loss_only = _run(Plan(dp=2, local_steps=100, **textbook), 1)[0].bytes_by_axis[0]["dp"]
    n = sum(p.data.size for p in GPT(TINY, 0).parameters())
    k = -(-n // 16) * 8                                  # a server's chunk (W = 2)
    ddp_sync = ddp[0].bytes_by_axis[0]["dp"] - loss_only
    assert ddp_sync == 8 * n                             # W = 2 ring: n numbers of 8 B
    for r in onebit:
        sent = [b["dp"] - loss_only for b in r.bytes_by_axis]
        assert sent[:warm] == [ddp_sync] * warm
        # all_to_all and all_gather of k/8 bytes of signs each, 2 all_gathers of a scale
        assert sent[warm:] == [2 * (k // 8) + 2 * 8] * (steps - warm)
        assert sent[warm] * 16 <= ddp_sync + 16 * 16 and sent[warm] * 60 < ddp_sync
    assert all(np.array_equal(onebit[0].params[k_], onebit[1].params[k_])
               for k_ in onebit[0].params)                # one momentum for every replica
    assert onebit[0].losses[-1] < onebit[0].losses[0]


@pytest.mark.parametrize("fields, says", [
    (dict(dp=2, onebit_warmup=2, zero=1), "not with zero=1"),
    (dict(dp=2, onebit_warmup=2, local_steps=2), "not with local_steps=2"),
    (dict(dp=2, onebit_warmup=-1), "onebit_warmup=-1 must be an int >= 0"),
])
def test_layouts_it_does_not_run_on_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        Plan(**fields)
