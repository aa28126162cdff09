"""One optimizer code path: AdamW and SGD stepping ZeRO's flat shards (parallel/zero/flat.py's
FlatShard, one per unit and rank) give the very bits they give the whole parameters, and
their sharded state is the whole state cut the same way."""

import numpy as np
import pytest

from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.optim import SGD
from minidist.optim import make_optimizer
from minidist.parallel.zero.flat import FlatShard, split_units

TINY = model_config_for(DataConfig(task="sort", length=4, seed=1), n_layer=2, n_embd=16)
KW = {"adamw": dict(momentum=0.0), "sgd": dict(momentum=0.9)}


@pytest.mark.parametrize("W", [1, 2, 3, 5])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_flat_shards_step_to_the_same_bits_as_whole_parameters(name, W):
    model = GPT(TINY, seed=0)
    params = model.parameters()
    units = split_units(model, W)
    whole = make_optimizer(name, params, 1e-2, 0.1, (0.9, 0.999), **KW[name])
    flats = [u.pack([p.data for p in u.params], np.float64) for u in units]
    grads = [np.zeros(u.padded) for u in units]
    shards = [[FlatShard(u.name, f[slice(*u.shard_range(r))], g[slice(*u.shard_range(r))])
               for u, f, g in zip(units, flats, grads)] for r in range(W)]
    ranks = [make_optimizer(name, shards[r], 1e-2, 0.1, (0.9, 0.999), **KW[name])
             for r in range(W)]
    rng = np.random.default_rng(W)
    for step in range(3):
        for u, g in zip(units, grads):            # the same gradient, whole and flat
            for p, view in zip(u.params, u.views(g)):
                p.grad = rng.standard_normal(p.shape)
                view[...] = p.grad
        whole.step()
        for opt in ranks:
            opt.lr = whole.lr
            opt.step()
        for u, f in zip(units, flats):
            for p, view in zip(u.params, u.views(f)):
                assert np.array_equal(view, p.data), f"step {step}: {name} W={W} {p.shape}"
            assert np.all(f[u.numel:] == 0), "padding must stay zero"
    full_state, checked = whole.state_dict(), {"step"} if name == "adamw" else set()
    for opt in ranks:
        assert opt.state_dict().get("step") == full_state.get("step")
    for prefix in {key.rsplit(".", 1)[0] for key in full_state if key != "step"}:
        for k, u in enumerate(units):          # rank order = flat order of the unit
            flat = np.concatenate([opt.state_dict()[f"{prefix}.{k}"] for opt in ranks])
            for slot, view in zip(u.slots, u.views(flat)):
                key = f"{prefix}.{slot.index}"
                assert np.array_equal(view, full_state[key]), f"{name} W={W}: {key}"
                checked.add(key)
    assert checked == set(full_state)


def test_an_object_without_data_or_grad_is_refused():
    with pytest.raises(ValueError, match="no .data/.grad.*FlatShard"):
        SGD([object()], lr=0.1)
    shard = FlatShard("root", np.zeros(3), np.ones(3))
    SGD([shard], lr=0.5).step()
    assert np.array_equal(shard.data, [-0.5, -0.5, -0.5]) and "3 elements" in repr(shard)
