"""ZeRO's formulas: the paper's worked example, minidist's exact counts, and the flat layout
they rest on (closed forms; no processes)."""

import math

import numpy as np
import pytest

from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel.zero import memory as zm
from minidist.parallel.zero.flat import ownership_map, split_units

TINY = model_config_for(DataConfig(task="sort", length=4, seed=1), n_layer=2, n_embd=16)


def test_paper_worked_example():
    """Rajbhandari et al. 2020, Fig. 1: 7.5B params, 64 GPUs, K = 12."""
    gb = zm.paper_example()
    assert [round(gb[s], 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert gb == {0: 120.0, 1: 31.40625, 2: 16.640625, 3: 1.875}     # the unrounded values


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_formulas_in_closed_form(stage):
    psi, n = 1000.0, 8
    k_paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n,
               3: 16 * psi / n}
    assert zm.formula_bytes(stage, psi, n)["total"] == pytest.approx(k_paper[stage], rel=1e-15)
    b = 8                                                            # float64, K = 2b
    mine = {0: 4 * b * psi, 1: 2 * b * psi + 2 * b * psi / n, 2: b * psi + 3 * b * psi / n,
            3: 4 * b * psi / n}
    got = zm.formula_bytes(stage, psi, n, param_bytes=b, grad_bytes=b, k=2 * b)["total"]
    assert got == pytest.approx(mine[stage], rel=1e-15)


@pytest.mark.parametrize("W", [1, 3, 4])
def test_exact_bytes_tend_to_the_smooth_formula(W):
    """With every unit divisible by W the padded counts are the paper's formulas in b."""
    numels = [12 * W, 100 * W, 100 * W]
    psi = sum(numels)
    for s in range(4):
        exact = zm.exact_bytes(s, numels, W, 4)
        smooth = zm.formula_bytes(s, psi, W, param_bytes=4, grad_bytes=4, k=8)
        for key in ("params", "grads", "optimizer"):
            assert exact[key] == smooth[key], (s, key)


def test_exact_bytes_pad_each_unit():
    numels, W = [5, 7, 1], 4                     # shards 2, 2, 1 -> S = 5, Ψ_pad = 20
    assert zm.shard_sizes(numels, W) == [2, 2, 1]
    e1 = zm.exact_bytes(1, numels, W, 8)
    assert e1 == {"params": 160, "grads": 160, "optimizer": 80}
    e3 = zm.exact_bytes(3, numels, W, 8)
    assert e3["params"] == e3["grads"] == 40
    assert e3["peak_gathered_params"] == 8 * 4 * (2 + 2 + 1)
    assert e3["peak_unsharded_grads"] == 8 * 4 * (2 + 2)
    assert zm.comm_elements(2, numels, W) == 3 * (2 * 5 + 1)
    assert zm.comm_elements(3, numels, W, micro_batches=2) == 3 * (5 * 5 + 1)
    with pytest.raises(ValueError, match="stage=5"):
        zm.exact_bytes(5, numels, W, 8)


@pytest.mark.parametrize("W", [1, 2, 3, 5, 8])
def test_flat_units_cover_every_element_once(W):
    model = GPT(TINY, seed=0)
    units = split_units(model, W)
    names = [s.name for u in units for s in u.slots]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert [u.name for u in units] == ["root", "blocks.0", "blocks.1"]
    for u in units:
        assert u.shard == max(1, math.ceil(u.numel / W)) and 0 <= u.padded - u.numel < W
        flat = u.pack([p.data for p in u.params], np.float64)
        assert np.all(flat[u.numel:] == 0)                         # padding is zero
        for view, p in zip(u.views(flat), u.params):
            assert np.array_equal(view, p.data)
        for s in u.slots:
            owned = np.zeros(s.numel, int)
            for r, lo, hi in u.owners(s):
                owned[lo:hi] += 1
                a, b = u.shard_range(r)
                assert a <= s.offset + lo and s.offset + hi <= b
            assert np.all(owned == 1), f"{s.name}: some element owned {owned.max()} times"
    assert ownership_map(units)[0].startswith(f"unit root: N = {units[0].numel}")
