"""DiLoCo (parallel/data/diloco.py): with one local step, an SGD inner optimizer and an outer
SGD step of lr 1 it is DDP's SGD step; with H local steps its replicas sync once per H
steps with exactly DDP's bytes for one step (1/H on average), agree right after an outer
step and drift apart between; the Plan refuses the layouts it does not run on."""

import numpy as np
import pytest

from minidist.data import DataConfig, model_config_for
from minidist.runtime.launch import spawn
from minidist.train import Plan, train_on_rank
from tests.helpers import configs

DATA = DataConfig(task="sort", length=4, seed=1)
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)                 # float64


def _run(plan: Plan, steps: int, **kw):
    return spawn(plan.world_size, train_on_rank, TINY, DATA, plan,
                 *configs(steps=steps, global_batch=8, lr=5e-2, seed=0, **kw))


def test_one_local_step_with_sgd_and_an_outer_lr_of_one_is_ddp():
    """theta_0 - (1/W) sum_r lr W g_r = theta_0 - lr sum_r g_r: DDP's SGD step."""
    textbook = dict(algo="ring", buckets=False)
    ddp = _run(Plan(dp=2, **textbook), 3, optimizer="sgd")
    dil = _run(Plan(dp=2, local_steps=1, outer_lr=1.0, outer_momentum=0.0, **textbook), 3,
               optimizer="sgd")
    for name, want in ddp[0].params.items():
        np.testing.assert_allclose(dil[0].params[name], want, rtol=1e-12, atol=1e-14,
                                   err_msg=name)
    np.testing.assert_allclose(dil[0].losses, ddp[0].losses, rtol=1e-12)


def test_h_local_steps_send_ddp_s_bytes_once_per_h_steps():
    H, steps = 3, 6
    textbook = dict(algo="ring", buckets=False)
    ddp = _run(Plan(dp=2, **textbook), steps)
    dil = _run(Plan(dp=2, local_steps=H, **textbook), steps)
    for d, r in zip(dil, ddp):
        sent = [b["dp"] for b in d.bytes_by_axis]
        every = [b["dp"] for b in r.bytes_by_axis]
        loss_sums = sent[0]                        # a step without an outer step: the loss
        assert sent == [loss_sums, loss_sums, every[2]] * 2, (sent, every)
        assert len(set(every)) == 1 and every[0] > loss_sums
        # averaged over H steps, the sync sends 1/H of DDP's gradient bytes
        assert (sum(sent[:H]) - H * loss_sums) * H == H * (every[0] - loss_sums)


def _after(ctx, steps):
    """This rank's parameters after `steps` steps of DiLoCo with H = 2."""
    r = train_on_rank(ctx, TINY, DATA, Plan(dp=2, local_steps=2),
                      *configs(steps=steps, global_batch=8, lr=5e-2, seed=0))
    return r.params["blocks.0.mlp.fc.weight"]


@pytest.mark.parametrize("steps, agree", [(1, False), (2, True)])
def test_the_replicas_agree_after_an_outer_step_and_drift_between(steps, agree):
    a, b = spawn(2, _after, steps)
    assert np.array_equal(a, b) == agree


@pytest.mark.parametrize("fields, says", [
    (dict(dp=2, local_steps=2, zero=1), "not with zero=1"),
    (dict(dp=2, pp=2, local_steps=2), "not with pp=2"),
    (dict(dp=2, local_steps=2, outer_momentum=1.0), "outer_momentum=1.0 in"),
    (dict(dp=2, local_steps=-1), "local_steps=-1 must be an int >= 0"),
])
def test_layouts_diloco_does_not_run_on_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        Plan(**fields)
