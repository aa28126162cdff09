"""The alpha-beta cost model: formulas against hand-computed values, the byte and message
counts the runtime actually measured, choose() at the extremes, fit() and the calibration file."""

import json
import os

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import api, cost
from minidist.collectives.ring import SEGMENT_BYTES
from minidist.runtime.launch import spawn

MSG, BYTE, RED = cost.Constants(1, 0, 0), cost.Constants(0, 1, 0), cost.Constants(0, 0, 1)


@pytest.mark.parametrize("op, algo, W, n, c, want", [
    # messages on the critical path (alpha = 1, beta = gamma = 0)
    ("all_reduce", "ring", 8, 800, MSG, 14), ("all_reduce", "tree", 8, 800, MSG, 6),
    ("all_reduce", "tree", 5, 800, MSG, 6), ("all_reduce", "halving", 8, 800, MSG, 3),
    ("all_reduce", "halving", 5, 800, MSG, 4), ("all_reduce", "ring", 1, 800, MSG, 0),
    ("reduce_scatter", "ring", 5, 800, MSG, 4), ("reduce_scatter", "halving", 6, 800, MSG, 4),
    ("broadcast", "ring", 8, 0, MSG, 7), ("broadcast", "tree", 8, 800, MSG, 3),
    ("scatter", "tree", 5, 800, MSG, 6), ("all_to_all", "pairwise", 5, 800, MSG, 4),
    # bytes sent (beta = 1)
    ("all_reduce", "ring", 8, 800, BYTE, 2 * 7 / 8 * 800),
    ("all_gather", "ring", 4, 100, BYTE, 300),
    ("reduce_scatter", "halving", 8, 800, BYTE, 700),
    ("reduce_scatter", "halving", 6, 800, BYTE, 3 / 4 * 800 + 800 + 800 / 6),
    ("broadcast", "ring", 4, 4 * SEGMENT_BYTES, BYTE, (2 + 4) * SEGMENT_BYTES),
    ("gather", "tree", 5, 100, BYTE, 400),
    # bytes reduced (gamma = 1)
    ("all_reduce", "tree", 8, 800, RED, 2400), ("all_reduce", "ring", 8, 800, RED, 700),
    ("all_reduce", "halving", 6, 800, RED, 3 * 800), ("reduce", "tree", 3, 800, RED, 1600),
])
def test_formulas_against_hand_computed_values(op, algo, W, n, c, want):
    assert cost.predict(op, algo, W, n, c) == pytest.approx(want, rel=1e-12)


def test_every_api_algorithm_has_a_formula():
    assert {op: set(a) for op, a in cost.ALGOS.items()} == \
        {op: set(a) for op, a in api._ALGOS.items()}
    for op, algos in cost.ALGOS.items():
        for algo in algos:
            assert cost.predict(op, algo, 6, 1000, cost.DEFAULT) > 0
    with pytest.raises(ValueError, match="no formula"):
        cost.predict("all_gather", "tree", 4, 10, cost.DEFAULT)
    with pytest.raises(ValueError, match="unknown collective"):
        cost.choose("allreduce", 10, 4)


def test_choose_latency_bound_small_bandwidth_bound_large():
    tiny, large = 8, 64 << 20
    assert cost.choose("all_reduce", tiny, 8, cost.DEFAULT) == "halving"
    assert cost.choose("broadcast", tiny, 8, cost.DEFAULT) == "tree"
    assert cost.choose("reduce", tiny, 8, cost.DEFAULT) == "tree"
    for op in ("all_reduce", "broadcast", "reduce"):
        assert cost.choose(op, large, 8, cost.DEFAULT) == "ring", op
    # off a power of two the fold makes halving lose to ring for large messages
    for op in ("reduce_scatter", "all_gather"):
        assert cost.choose(op, large, 5, cost.DEFAULT) == "ring", op
    assert "direct" not in {cost.choose("all_reduce", n, W, cost.DEFAULT)
                            for n in (8, 1 << 30) for W in (2, 3, 8)}


def test_fit_recovers_alpha_and_beta():
    n = np.array([8, 64, 512, 4096, 32768, 262144, 2097152, 8388608], np.float64)
    alpha, beta = 7e-6, 3e-10
    a, b = cost.fit(n, alpha + beta * n)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    noisy = alpha + beta * n + np.random.default_rng(0).normal(0, 2e-8, n.size)
    a, b = cost.fit(n, noisy)
    assert a == pytest.approx(alpha, rel=0.02) and b == pytest.approx(beta, rel=0.02)
    assert cost.fit_gamma(n, 2e-10 * n) == pytest.approx(2e-10, rel=1e-12)
    c = cost.calibrate(n, alpha + beta * n, n, 2e-10 * n)
    assert (c.alpha, c.beta, c.gamma) == pytest.approx((alpha, beta, 2e-10), rel=1e-9)
    with pytest.raises(ValueError, match="2 distinct sizes"):
        cost.fit([8, 8, 8], [1e-6, 1e-6, 1e-6])
    with pytest.raises(ValueError, match="must be > 0"):
        cost.calibrate(n, 1e-3 - 1e-10 * n, n, 2e-10 * n)


def test_calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("MINIDIST_COST_FILE", str(path))
    monkeypatch.setattr(cost, "RECHECK_SECONDS", 0.0)    # look at the file on every call
    assert cost.cost_file() == path and cost.constants() == cost.DEFAULT   # no file yet
    mine = cost.Constants(alpha=1.0, beta=2e-9, gamma=3e-9)
    assert cost.save(mine) == path and cost.constants() == mine
    # absurd constants change the choice: with alpha huge, the fewest messages win
    assert cost.choose("all_reduce", 64 << 20, 8) == "halving"
    path.write_text(json.dumps({"alpha": 5e-6, "beta": 1e-10, "gamma": 1e-10}))
    os.utime(path, ns=(1, 1))                         # a different mtime: re-read
    assert cost.constants() == cost.Constants(5e-6, 1e-10, 1e-10)
    for bad in ("{not json", '{"alpha": 1}', '{"alpha": -1, "beta": 1, "gamma": 1}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match=str(path)):
            cost.load(path)
    monkeypatch.delenv("MINIDIST_COST_FILE")
    assert str(cost.cost_file()).endswith(os.path.join(".cache", "minidist", "cost.json"))


def _counts_on_rank(ctx):
    """Messages and bytes this rank sent in each call (runtime counters, per call)."""
    g, out = ctx.world, {}
    x = np.ones(4000)
    calls = {"ring all_reduce": lambda: C.all_reduce(x, group=g, algo="ring"),
             "halving all_reduce": lambda: C.all_reduce(x, group=g, algo="halving"),
             "ring all_gather": lambda: C.all_gather(x, group=g, algo="ring"),
             "tree broadcast": lambda: C.broadcast(x, root=0, group=g, algo="tree"),
             "pairwise all_to_all": lambda: C.all_to_all(np.ones((4 * g.size, 2)), group=g)}
    for name, call in calls.items():
        m0, b0 = g.stats["messages_sent"], g.stats["bytes_sent"]
        call()
        out[name] = (g.stats["messages_sent"] - m0, g.stats["bytes_sent"] - b0)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [4, 8])
def test_message_and_byte_counts_match_the_model(W):
    n = 4000 * 8
    per_rank = spawn(W, _counts_on_rank)
    lg = W.bit_length() - 1
    for r, counts in enumerate(per_rank):
        assert counts["ring all_reduce"] == (2 * (W - 1), 2 * (W - 1) * n // W), r
        assert counts["halving all_reduce"] == (lg, lg * n), r
        assert counts["ring all_gather"] == (W - 1, (W - 1) * n), r
        assert counts["pairwise all_to_all"] == (W - 1, (W - 1) * 4 * 2 * 8), r
    # a binomial broadcast sends W-1 messages in total, the root ceil(log2 W) of them
    assert sum(c["tree broadcast"][0] for c in per_rank) == W - 1
    assert sum(c["tree broadcast"][1] for c in per_rank) == (W - 1) * n
    assert per_rank[0]["tree broadcast"][0] == lg


def test_auto_uses_direct_for_large_reductions_on_shared_memory():
    big, small = cost.SHM_DIRECT_MIN_BYTES, 8
    assert cost.choose("all_reduce", big, 4, shared_memory=True) == "direct"
    assert cost.choose("reduce_scatter", big, 2, shared_memory=True) == "direct"
    assert cost.choose("all_reduce", big, 4, shared_memory=False) != "direct"   # e.g. MPI
    assert cost.choose("all_reduce", small, 4, shared_memory=True) == "direct"   # one wait
    assert cost.choose("all_reduce", 64 << 10, 4, shared_memory=True) != "direct"
    assert cost.choose("all_reduce", small, 4, shared_memory=False) != "direct"
    assert cost.choose("reduce_scatter", small, 4, shared_memory=True) != "direct"
    assert cost.choose("all_gather", big, 4, shared_memory=True) != "direct"    # no direct
    assert cost.choose("all_reduce", big, 1, shared_memory=True) != "direct"


def test_small_threshold_matches_the_small_path():
    from minidist.collectives import direct_small
    assert cost.SMALL_BYTES == direct_small.SMALL_BYTES
