"""Hybrid sharding (HSDP): ZeRO over a shard group inside a node, replicated across nodes.
It must be invisible in the numbers (equal to the single process, for ZeRO 1-3, with tp, on
emulated nodes), put its groups where the slow tier is crossed least (shards inside a node,
replicas across), and send over the replicas exactly one ring all-reduce of each shard per
step. The default run takes ZeRO-3 on 2 nodes once; the other stages and tp are slow."""

import numpy as np
import pytest

from minidist import train_cli
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel.zero.flat import split_units
from minidist.runtime.launch import spawn
from minidist.runtime.nodes import Nodes
from minidist.train import Plan, train_on_rank
from tests.helpers import configs

DATA = DataConfig(task="sort", length=4, seed=1)
TINY = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)                 # float64


def test_the_shards_lie_inside_a_node_and_the_replicas_across():
    plan = Plan(dp=4, zero=1, hsdp=2)
    assert plan.mesh_axes() == (("replicate", "shard", "cp", "tp"), (2, 2, 1, 1))
    g = plan.group_ranks(1)
    assert (g["shard"], g["replicate"], g["dp"], g["grad"]) == ((0, 1), (1, 3), (0, 1, 2, 3),
                                                                (0, 1, 2, 3))
    with_tp = Plan(dp=4, tp=2, zero=3, hsdp=2).group_ranks(0)
    assert (with_tp["shard"], with_tp["replicate"], with_tp["tp"]) == ((0, 2), (0, 4), (0, 1))
    assert Plan(dp=4, zero=1, hsdp=2).describe() == \
        "dp=4 (HSDP: shard 2 x replicate 2) x tp=1"


@pytest.mark.parametrize("fields, says", [
    (dict(dp=4, hsdp=2), "zero=0 shards nothing"),
    (dict(dp=4, zero=1, hsdp=3), "use hsdp=2 or hsdp=4"),
    (dict(dp=4, zero=1, hsdp=2, cp=2), "with cp > 1 is not built"),
    (dict(dp=4, zero=1, hsdp=-1), "hsdp=-1 must be an int >= 0"),
])
def test_layouts_hsdp_cannot_run_are_refused(fields, says):
    with pytest.raises(ValueError, match=says):
        Plan(**fields)


@pytest.mark.parametrize("argv", [
    ["--dp", "4", "--zero", "3", "--hsdp", "2", "--ranks-per-node", "2"],
    pytest.param(["--dp", "4", "--zero", "1", "--hsdp", "2", "--ranks-per-node", "2"],
                 marks=pytest.mark.slow),
    pytest.param(["--dp", "4", "--zero", "2", "--hsdp", "2", "--ranks-per-node", "2"],
                 marks=pytest.mark.slow),
    pytest.param(["--dp", "4", "--tp", "2", "--zero", "3", "--hsdp", "2",
                  "--ranks-per-node", "4"], marks=pytest.mark.slow),
    pytest.param(["--dp", "4", "--zero", "1", "--hsdp", "2", "--deterministic",
                  "--batch", "32"], marks=pytest.mark.slow),
], ids=lambda argv: " ".join(argv))
def test_hsdp_trains_as_the_single_process(argv, capsys):
    assert train_cli.main(argv + ["--check", "--steps", "5", "--run-dir", "none"]) == 0
    out = capsys.readouterr().out
    assert "(HSDP: shard 2 x replicate 2)" in out and "\nOK: " in out, out


def test_the_replicas_all_reduce_each_shard_once_a_step():
    """Ring on 2 replicas: each rank sends the chunk it does not finish, then the one it
    did: its whole shard, S_u elements per unit, once per step (float64)."""
    plan = Plan(dp=4, zero=2, hsdp=2, algo="ring")
    steps = 2
    runs = spawn(4, train_on_rank, TINY, DATA, plan,
                 *configs(steps=steps, global_batch=8, lr=1e-2, seed=0),
                 nodes=Nodes(2, alpha=0.0, beta=0.0))
    shard = sum(u.shard for u in split_units(GPT(TINY, 0), 2))
    for r in runs:
        assert [b["replicate"] for b in r.bytes_by_axis] == [8 * shard] * steps
        assert all(b["shard"] > 0 for b in r.bytes_by_axis)
    assert np.array_equal(runs[0].params["wte.weight"], runs[2].params["wte.weight"])
