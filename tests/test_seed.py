"""seed.py: a parameter's numbers depend on (seed, full name) only, never on creation order."""

import subprocess
import sys

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.nn import GPT, GPTConfig, Linear, Module
from minidist.nn.module import Parameter


class _AB(Module):
    """Two layers assigned in one order..."""

    def __init__(self):
        self.a = Linear(3, 4)
        self.b = Linear(4, 5)


class _BA(Module):
    """...and the same two layers assigned (and so created and walked) in the other order."""

    def __init__(self):
        self.b = Linear(4, 5)
        self.a = Linear(3, 4)


def test_same_name_same_tensor_regardless_of_construction_order():
    ab, ba = _AB(), _BA()
    seeding.init_parameters(ab, seed=7)
    seeding.init_parameters(ba, seed=7)
    assert [n for n, _ in ab.named_parameters()] != [n for n, _ in ba.named_parameters()]
    sa, sb = ab.state_dict(), ba.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert np.array_equal(sa[name], sb[name]), name
    assert not np.array_equal(sa["a.weight"][:, :4], sa["b.weight"][:3, :4])   # names differ
    assert np.all(sa["a.bias"] == 0)


def test_values_depend_on_seed_and_name_and_follow_init_spec():
    w = seeding.draw(seeding.normal(0.02), (300, 200), seed=0, name="w")
    assert abs(w.std() - 0.02) < 0.02 * 0.02                 # 60000 draws: std within 2 %
    assert not np.array_equal(w, seeding.draw(seeding.normal(0.02), (300, 200), 1, "w"))
    assert not np.array_equal(w, seeding.draw(seeding.normal(0.02), (300, 200), 0, "v"))
    assert np.array_equal(seeding.draw(seeding.ones(), (2, 3), 0, "g"), np.ones((2, 3)))
    w32 = seeding.draw(seeding.normal(0.02), (300, 200), 0, "w", dtype="float32")
    assert w32.dtype == np.float32 and np.array_equal(w32, w.astype(np.float32))


def test_hash_is_stable_across_processes():
    # Python's hash() is salted per process; derive_seed must not be.
    code = "from minidist.seed import derive_seed; print(derive_seed(3, 'blocks.0.attn', 5))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    assert outs == {f"{seeding.derive_seed(3, 'blocks.0.attn', 5)}\n"}


def test_shard_is_exact_slice_of_full_tensor():
    class Sharded(Module):
        def __init__(self, r, w):
            cols = slice(r * 6 // w, (r + 1) * 6 // w)
            self.weight = Parameter((4, 6 // w), seeding.normal(0.02), full_shape=(4, 6),
                                    index=(slice(None), cols))

    full = Linear(4, 6)
    seeding.init_parameters(full, seed=3)
    for w in (1, 2, 3):
        parts = []
        for r in range(w):
            m = Sharded(r, w)
            seeding.init_parameters(m, seed=3)
            parts.append(m.weight.numpy())
        assert np.array_equal(np.concatenate(parts, axis=1), full.weight.numpy())


def test_gpt_parameters_equal_full_draws_and_prefix_init_matches_submodule():
    cfg = GPTConfig(vocab_size=7, block_size=5, n_layer=2, n_head=2, n_embd=8)
    model = GPT(cfg, seed=11)
    for name, p in model.named_parameters():
        want = seeding.draw(p.init, p.shape, 11, name)
        assert np.array_equal(p.numpy(), want), name
    other = GPT(cfg, seed=None)                    # a "pipeline stage" initialising block 1
    seeding.init_parameters(other.blocks[1], seed=11, prefix="blocks.1.")
    for name, p in other.blocks[1].named_parameters():
        assert np.array_equal(p.numpy(), model.state_dict()["blocks.1." + name])


def test_uninitialised_parameter_is_nan_and_bad_slice_raises():
    p = Parameter((2, 2), seeding.zeros())
    assert np.isnan(p.numpy()).all()

    class Bad(Module):
        def __init__(self):
            self.w = Parameter((2, 3), seeding.zeros(), full_shape=(4, 4),
                               index=(slice(0, 2), slice(0, 2)))

    with pytest.raises(ValueError, match="full shape"):
        seeding.init_parameters(Bad(), 0)


def test_streams_are_keyed_and_repeatable():
    a = seeding.stream(0, "dropout", 3, "blocks.0.attn.attn_drop", 17).random(5)
    b = seeding.stream(0, "dropout", 3, "blocks.0.attn.attn_drop", 17).random(5)
    c = seeding.stream(0, "dropout", 4, "blocks.0.attn.attn_drop", 17).random(5)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(ValueError, match="kind"):
        seeding.Init("xavier")


def test_counter_draws_are_per_element_and_uniform():
    c = np.arange(100_000)
    u = seeding.counter_uniform(0, ("k",), c)
    assert np.array_equal(seeding.counter_uniform(0, ("k",), c[777:790]), u[777:790])
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.005
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01       # neighbours uncorrelated
    counts = np.bincount(seeding.counter_integers(0, ("k",), c, 10), minlength=10)
    assert counts.min() > 9_500 and counts.max() < 10_500        # ~10 000 each (sd ~95)
    assert not np.array_equal(seeding.counter_uniform(1, ("k",), c[:10]), u[:10])
