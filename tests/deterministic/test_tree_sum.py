"""The aligned tree sum (deterministic/tree_sum.py): the tree's value does not depend on
who summed which grains. The values are chosen so that the order of additions shows in the
bits (magnitudes from 1e-8 to 1e8), so an equality here is a real one."""

import gc
import weakref

import numpy as np
import pytest

from minidist.deterministic.tree_sum import TreeSum, combine, is_aligned


def _grains(count, seed=0, shape=(5,)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 9, shape)
            for _ in range(count)]


def _sum_by(values, cuts):
    """Every rank r pushes grains [cuts[r], cuts[r+1]); then the nodes are combined."""
    nodes = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        t = TreeSum()
        for i in range(a, b):
            t.push(i, values[i])
        nodes += t.nodes()
    return combine(nodes, len(values))


def _reference(values):
    """The tree over [0, G) as the definition says: pad to a power of two, empty = none."""
    G = len(values)
    size = 1 << (G - 1).bit_length()

    def node(lo, n):
        if n == 1:
            return values[lo]
        left = node(lo, n // 2)
        return left if lo + n // 2 >= G else left + node(lo + n // 2, n // 2)
    return node(0, size)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6, 8, 13, 16, 20, 31])
def test_every_partition_into_ranges_gives_the_same_bits(count):
    values = _grains(count, seed=count)
    want = _reference(values)
    rng = np.random.default_rng(count)
    partitions = [[0, count]] + [sorted({0, count, *rng.integers(1, count, k)})
                                 for k in (1, 2, 3, 5) if count > 1]
    for cuts in partitions:
        assert np.array_equal(_sum_by(values, cuts), want), cuts
    flat = np.sum(values, axis=0)                   # a plain sum is another order
    if count >= 8:
        assert not np.array_equal(flat, want)       # ... which the values do show


def test_push_merges_siblings_only_and_keeps_order():
    t = TreeSum()
    for i in range(5, 12):                           # a rank holding grains 5..11
        t.push(i, np.float64(i))
    assert [(lo, hi) for lo, hi, _ in t.nodes()] == [(5, 6), (6, 8), (8, 12)]
    assert all(is_aligned(lo, hi) for lo, hi, _ in t.nodes())
    with pytest.raises(ValueError, match="increasing order"):
        t.push(3, np.float64(0))


def test_combine_names_a_missing_grain_and_a_foreign_range():
    with pytest.raises(ValueError, match="grain 2 of 4 is in no node"):
        combine([(0, 2, 1.0), (3, 4, 1.0)], 4)
    with pytest.raises(ValueError, match=r"\[1, 3\) is not a node"):
        combine([(0, 1, 1.0), (1, 3, 1.0), (3, 4, 1.0)], 4)
    with pytest.raises(ValueError, match="at least one grain"):
        combine([], 0)
    assert combine([(0, 1, 7.0)], 1) == 7.0


# float64 by default (7 single-process runs each); float32 under -m slow
@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_the_deterministic_baseline_does_not_depend_on_the_micro_batch_count(dtype):
    """One sample per micro-batch, gradients summed in the tree: grad_accum 1, 2, 4 and 8
    give the same bits (the plain accumulation does not), dropout and MoE on."""
    from minidist.baseline import train_single_process
    from minidist.data import DataConfig
    from minidist.nn import GPTConfig
    data = DataConfig("sort", length=4)
    cfg = GPTConfig(vocab_size=11, block_size=9, n_layer=2, n_head=2, n_embd=16,
                    dropout=0.1, moe_every=2, dtype=dtype)
    runs = [train_single_process(cfg, data, steps=3, global_batch=8, lr=1e-2, grad_accum=m,
                                 clip_grad=1.0, deterministic=True) for m in (1, 2, 4, 8)]
    for run in runs[1:]:
        assert run.losses == runs[0].losses and run.grad_norms == runs[0].grad_norms
        assert all(np.array_equal(run.params[k], v) for k, v in runs[0].params.items())
    # a MoE model routes per micro-batch, so compare with the plain run of one sample per
    # micro-batch: the same numbers, only added in another order
    plain = [train_single_process(cfg, data, steps=3, global_batch=8, lr=1e-2, grad_accum=8,
                                  clip_grad=1.0, deterministic=False)]
    for k, v in plain[0].params.items():
        np.testing.assert_allclose(runs[0].params[k], v, rtol=0,
                                   atol=1e-5 if dtype == "float32" else 1e-13)
    dense = GPTConfig(vocab_size=11, block_size=9, n_layer=2, n_head=2, n_embd=16, dtype=dtype)
    a, b = (train_single_process(dense, data, steps=3, global_batch=8, lr=1e-2, grad_accum=m)
            for m in (1, 8))                              # plain accumulation: not bitwise
    assert not all(np.array_equal(a.params[k], v) for k, v in b.params.items())


def test_combine_keeps_no_node_alive_once_it_returns():
    """A node's array is freed when the caller drops it, without waiting for the garbage
    collector (a recursive closure in combine once kept every node of every sum of a step
    alive until the next collection: ~20 MB a step on the bench model, and slow steps)."""
    values = [np.full(4, float(i)) for i in range(5)]
    alive = [weakref.ref(v) for v in values]
    enabled = gc.isenabled()
    gc.disable()
    try:
        total = combine([(i, i + 1, v) for i, v in enumerate(values)], 5)
        del values
        assert [r() for r in alive] == [None] * 5
    finally:
        if enabled:
            gc.enable()
    assert total.tolist() == [10.0] * 4
