"""Sequence parallelism: the all-gather / reduce-scatter pair along T is each other's adjoint,
and a LayerNorm whose gradient is not summed over tp is caught by name. (W = 3: `-m slow`.)"""

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.data import DataConfig, model_config_for
from minidist.parallel import placement as pl
from minidist.parallel.tensor import sequence as sp
from minidist.parallel.tensor.tensor_parallel import TensorParallel
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import dist_gradcheck

X = np.random.default_rng(3).standard_normal((2, 6, 3))             # (B, T, C), T = 6


def _region_ops(ctx):
    pl.set_checking(True)
    tp = TensorParallel(ctx.world, True, algo="direct")
    r, W = ctx.rank, ctx.world_size
    T_tp = 6 // W
    mine = X[:, r * T_tp:(r + 1) * T_tp]
    full = sp.gather_from_sequence_region(pl.tag(Tensor(mine), "tp", pl.Shard(1)), tp)
    assert np.array_equal(full.data, X) and pl.placement_tag(full, "tp") == pl.Replicate()
    part = sp.reduce_scatter_to_sequence_region(
        pl.tag(Tensor(X * (r + 1)), "tp", pl.Partial()), tp)
    assert np.allclose(part.data, mine * W * (W + 1) / 2, atol=1e-12)
    # gather: positions in, feeding a column-parallel layer (a partial objective)
    dist_gradcheck(lambda x: sp.gather_from_sequence_region(pl.tag(x, "tp", pl.Shard(1)), tp),
                   mine, ctx.world, x_placement="shard", loss_placement="partial",
                   what="all-gather along T")
    dist_gradcheck(lambda x: sp.reduce_scatter_to_sequence_region(
        pl.tag(x, "tp", pl.Partial()), tp), X * (r + 1), ctx.world, x_placement="shard",
        loss_placement="partial", what="reduce-scatter along T")
    return True


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sequence_region_collectives_match_finite_differences(W):
    assert spawn(W, _region_ops) == [True] * W


def _odd_length(ctx):
    sp.reduce_scatter_sequence(np.zeros((1, 5, 2)), TensorParallel(ctx.world, True))


@pytest.mark.multiproc
def test_a_sequence_that_does_not_split_is_a_clear_error():
    with pytest.raises(RankFailure, match=r"T=5 positions do not split over tp=2"):
        spawn(2, _odd_length)


DATA = DataConfig(task="sort", length=4)
CFG = model_config_for(DATA, n_layer=1, n_head=2, n_embd=8)


def _ln_without_sum(self, x):                          # the planted bug: no f on the gain
    from minidist.autograd import functional as F
    return F.layer_norm(x, self.weight, self.bias, eps=self.eps)


@pytest.mark.multiproc
def test_layernorm_gradients_not_summed_over_tp_are_caught(monkeypatch):
    monkeypatch.setattr(sp.SequenceParallelLayerNorm, "forward", _ln_without_sum)
    with pytest.raises(RankFailure, match=r"the gradient of '(blocks\.0\.ln_\d|ln_f)\.(weight|"
                                          r"bias)' differs between tp ranks \[0, 1\]"):
        spawn(2, train_on_rank, CFG, DATA,
              Plan(tp=2, sequence_parallel=True,
                                                 check_placements=True),
              RunConfig(steps=1, global_batch=2), OptimizerConfig(lr=1e-2))
