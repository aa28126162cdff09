"""nn/module.py: names, state dicts, train/eval and parameter discovery."""

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.nn import MLP, Dropout, LayerNorm, Linear, Module, ModuleList, Parameter


class _Net(Module):
    def __init__(self):
        self.first = Linear(3, 4)
        self.layers = ModuleList([MLP(4, 8), LayerNorm(4)])
        self.shared = self.first.weight                  # same Parameter twice: listed once
        self.scale = Parameter((1,), seeding.ones())


def test_named_parameters_dotted_names_in_attribute_order():
    names = [n for n, _ in _Net().named_parameters()]
    assert names == ["first.weight", "first.bias",
                     "layers.0.fc.weight", "layers.0.fc.bias", "layers.0.proj.weight",
                     "layers.0.proj.bias", "layers.1.weight", "layers.1.bias", "scale"]
    net = _Net()
    assert net.num_parameters() == 12 + 4 + 32 + 8 + 32 + 4 + 4 + 4 + 1
    assert all(p.requires_grad for p in net.parameters())
    assert [n for n, _ in net.named_modules()][:4] == ["", "first", "layers", "layers.0"]
    assert len(net.layers) == 2 and net.layers[-1] is net.layers[1]


def test_state_dict_round_trip_and_copy_semantics():
    a, b = _Net(), _Net()
    seeding.init_parameters(a, seed=1)
    seeding.init_parameters(b, seed=2)
    state = a.state_dict()
    state["first.weight"][0, 0] = 123.0                  # a copy: the model is untouched
    assert a.first.weight.data[0, 0] != 123.0
    b.load_state_dict(a.state_dict())
    for name, value in a.state_dict().items():
        assert np.array_equal(b.state_dict()[name], value)


def test_load_state_dict_rejects_mismatches():
    net, state = _Net(), _Net().state_dict()
    with pytest.raises(ValueError, match="missing \\['scale'\\]"):
        net.load_state_dict({k: v for k, v in state.items() if k != "scale"})
    with pytest.raises(ValueError, match="unexpected \\['extra'\\]"):
        net.load_state_dict({**state, "extra": np.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        net.load_state_dict({**state, "scale": np.zeros(2)})


def test_train_eval_propagates_and_zero_grad_clears():
    net = _Net()
    net.layers[0].drop = Dropout(0.5)
    net.eval()
    assert not net.training and not net.layers[0].drop.training
    net.train()
    assert net.layers[0].drop.training
    for p in net.parameters():
        p.grad = np.ones(p.shape)
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_module_list_indexes_and_slices_like_a_list():
    mods = [Linear(2, 2), LayerNorm(2), Linear(2, 3)]
    ml = ModuleList(mods)
    assert ml[0] is mods[0] and ml[-1] is mods[2]
    assert ml[1:] == mods[1:] and ml[::2] == mods[::2] and ml[5:] == []
