"""The step schedule: micro-batches address global rows, and a loss divided by a local token
count is caught by name (Megatron-LM #7452, transformers #34191, torchtune #1917)."""

import numpy as np
import pytest

from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.parallel import micro_batching
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

DATA = DataConfig(task="add")                     # answers of one token: easy to count
CFG = model_config_for(DATA, n_layer=1, n_head=2, n_embd=8)


def test_micro_batches_are_the_dp_ranks_global_rows():
    data = SyntheticData(DATA)
    ids = data.global_indices(3, 12)
    for d in range(3):
        batches, n = micro_batching.micro_batches(data, 3, 12, dp=3, dp_rank=d, M=2, seed=0)
        assert n == micro_batching.global_token_count(data.batch(ids)[1])
        assert [mb.dropout_key.sample_ids for mb in batches] == [
            tuple(ids[(2 * d + m) * 2:(2 * d + m + 1) * 2]) for m in range(2)]
        assert all(mb.aux_weight == 2 / 12 for mb in batches)


def _local_count(data, step, B, dp, dp_rank, M, seed, positions=None,
                 real=micro_batching.micro_batches):
    batches, _ = real(data, step, B, dp, dp_rank, M, seed, positions)
    return batches, int(sum((mb.y != -100).sum() for mb in batches))     # the bug


@pytest.mark.multiproc
def test_a_loss_divided_by_a_local_token_count_is_caught(monkeypatch):
    monkeypatch.setattr(micro_batching, "micro_batches", _local_count)
    with pytest.raises(RankFailure, match=r"the loss was divided by n_tokens=4, but the dp "
                                          r"ranks' micro-batches hold 8 counted targets"):
        spawn(2, train_on_rank, CFG, DATA, Plan(dp=2, check_placements=True),
              RunConfig(steps=1, global_batch=8), OptimizerConfig(lr=1e-2))


@pytest.mark.multiproc
def test_without_check_mode_nothing_is_counted_twice():
    # check mode off: no token all-reduce, no digests; bytes are the gradient traffic only
    runs = spawn(2, train_on_rank, CFG, DATA, Plan(dp=2, check_placements=False),
                 RunConfig(steps=1, global_batch=8), OptimizerConfig(lr=1e-2))
    n = sum(p.size for p in runs[0].params.values())
    assert [r.bytes_per_step[0]["sent"] for r in runs] == [8 * n, 8 * n]
    assert np.isfinite(runs[0].losses[0])
