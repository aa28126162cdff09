"""The alpha-beta cost model: formulas against hand-computed values, the byte and message
counts the runtime actually measured, choose() at the extremes, fit() on timings the model
made itself, and the calibration file (versions 1 and 2, per world size).

The default run fits W=2's constants and counts messages at W=4 (the smallest power of two
past a pair); W=4's fit and W=8's counts are in the slow set."""

import dataclasses
import json
import os

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import api, calibration, cost
from minidist.collectives.ring import SEGMENT_BYTES
from minidist.runtime.launch import spawn

MSG, BYTE, RED = cost.Constants(1, 0, 0), cost.Constants(0, 1, 0), cost.Constants(0, 0, 1)
CALL, BAR, COPY = (cost.Constants(0, 0, 0, **{k: 1}) for k in ("call", "barrier", "copy"))
MiB = 1 << 20
RING_SETUP = cost.Constants(0, 0, 0, call=1, setup=(("all_reduce/ring", 5.0),))
DRAM = cost.Constants(0, 0, 0, dram=1, cache=2000)
SHARED_BYTES, SHARED_MSG = cost.Constants(0, 1, 0, cores=2), cost.Constants(1, 0, 0, cores=2)


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
    ("all_reduce", "direct", 4, 4 * MiB, RED, 3 * MiB), ("all_reduce", "direct", 4, 8, RED, 24),
    # one call overhead per call, whatever it does
    ("all_reduce", "ring", 8, 800, CALL, 1), ("scatter", "tree", 1, 0, CALL, 1),
    # barriers: direct meets twice per round, the small path once; mailboxes never
    ("all_reduce", "direct", 4, 4 * MiB, BAR, 2 * 2), ("all_reduce", "direct", 4, 4096, BAR, 1),
    ("reduce_scatter", "direct", 2, 8, BAR, 2), ("all_reduce", "ring", 4, 4 * MiB, BAR, 0),
    # bytes a rank copies itself: its working copy of x, direct's staging (direct sends
    # nothing through a mailbox), and what it copies out of the slots in an exchange
    ("all_reduce", "direct", 4, 4 * MiB, COPY, (2 * 3 / 4 + 1 / 4) * 4 * MiB),
    ("all_reduce", "direct", 4, 4 * MiB, BYTE, 0), ("reduce_scatter", "direct", 4, 800, COPY, 600),
    ("all_reduce", "ring", 8, 800, COPY, 800 + 700), ("all_reduce", "tree", 8, 800, COPY, 800),
    ("all_reduce", "halving", 8, 800, COPY, 800 + 3 * 800), ("all_gather", "ring", 4, 100,
                                                             COPY, 400),
    ("reduce_scatter", "ring", 4, 800, COPY, 1000), ("gather", "tree", 5, 100, COPY, 600),
    ("all_to_all", "pairwise", 4, 800, COPY, 800),
    # an algorithm's own set-up time replaces the generic per-call one
    ("all_reduce", "ring", 4, 8, RING_SETUP, 5), ("all_reduce", "tree", 4, 8, RING_SETUP, 1),
    # bytes moved beyond the cache: ring, W=2, n=800 sends 800, reduces 400, copies 1200
    ("all_reduce", "ring", 2, 800, DRAM, 2400 - 2000), ("all_reduce", "ring", 2, 400, DRAM, 0),
    # 8 ranks on 2 cores: a ring keeps all 8 copying at once, 4x slower per byte; a
    # binomial tree's 7 hops over 3 levels keep 7/3 busy; latencies are not shared
    ("all_reduce", "ring", 8, 800, SHARED_BYTES, 4 * 2 * 7 / 8 * 800),
    ("all_reduce", "tree", 8, 800, SHARED_BYTES, 7 / 3 / 2 * 2 * 3 * 800),
    ("broadcast", "tree", 4, 800, SHARED_BYTES, 2 * 800), ("all_reduce", "ring", 8, 800,
                                                           SHARED_MSG, 14),
])
def test_formulas_against_hand_computed_values(op, algo, W, n, c, want):
    assert cost.predict(op, algo, W, n, c) == pytest.approx(want, rel=1e-12)


def test_every_api_algorithm_has_a_formula():
    """One tier: cost.py's formulas; the two-level algorithms (across emulated nodes) are
    priced on two tiers by tiers.py."""
    from minidist.collectives import tiers
    two_tier = {op: {"hierarchical"} for op in ("all_reduce", "reduce_scatter", "all_gather")}
    assert {op: set(a) | two_tier.get(op, set()) for op, a in cost.ALGOS.items()} == \
        {op: set(a) for op, a in api._ALGOS.items()}
    for op, algos in cost.ALGOS.items():
        for algo in algos:
            assert cost.predict(op, algo, 6, 1000, cost.DEFAULT) > 0
    topo = tiers.Topology(2, tiers.Link(1e-5, 1e-9), tiers.Link(1e-4, 1e-8))
    for op in two_tier:
        assert tiers.seconds(op, "hierarchical", range(6), 1000, topo) > 0
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


SIZES = [8 * 8 ** k for k in range(8)] + [64 * MiB]                 # the bench's default sweep
KEYS = sorted({cost.setup_key(op, a, n) for op, algos in cost.ALGOS.items() for a in algos
               for n in SIZES})
ALONE = {key: (5 + i) * 1e-6 for i, key in enumerate(KEYS)}         # set-up times at W = 1


def _known(k, cores, **c):
    """Constants whose set-ups are k times ALONE, as fit() returns them."""
    return cost.Constants(**c, call=k * float(np.median(list(ALONE.values()))), cores=cores,
                          setup=tuple(sorted((key, k * v) for key, v in ALONE.items())))


KNOWN = {2: _known(0.8, 2, alpha=9e-6, beta=1.2e-10, gamma=1.9e-10, barrier=3e-6,
                   copy=0.9e-10, dram=0.6e-10, cache=4 * MiB),
         4: _known(1.5, 2, alpha=40e-6, beta=3e-10, gamma=2.5e-10, barrier=60e-6,
                   copy=1.5e-10, dram=1e-10, cache=1 * MiB)}


def _synthetic(W, c):
    """(op, algo, W, nbytes, seconds) of every algorithm over SIZES, timed by the model."""
    return [(op, a, W, n, cost.predict(op, a, W, n, c))
            for op, algos in cost.ALGOS.items() for a in algos for n in SIZES]


def _assert_same(got, want, rel):
    for k in cost.NAMES:
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=rel), k
    assert got.cores == want.cores and [k for k, _ in got.setup] == [k for k, _ in want.setup]
    assert [v for _, v in got.setup] == pytest.approx([v for _, v in want.setup], rel=rel)


@pytest.mark.parametrize("W", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fit_recovers_the_constants_that_made_the_timings(W):
    _assert_same(cost.fit(_synthetic(W, KNOWN[W]), ALONE, cores=2), KNOWN[W], rel=1e-9)
    # without measured set-ups, one per-call constant for every algorithm
    plain = dataclasses.replace(KNOWN[W], setup=())
    _assert_same(cost.fit(_synthetic(W, plain), cores=2), plain, rel=1e-9)


def test_fit_under_noise_keeps_the_predictions():
    """1 % noise (relative, as the fit weighs it) moves the predictions by about as much."""
    rng = np.random.default_rng(0)
    clean = _synthetic(4, KNOWN[4])
    got = cost.fit([(*s[:4], s[4] * (1 + 0.01 * rng.standard_normal())) for s in clean],
                   ALONE, cores=2)
    ratios = [cost.predict(*s[:4], got) / s[4] for s in clean]
    assert max(abs(r - 1) for r in ratios) < 0.03


def test_fit_keeps_constants_non_negative_and_says_what_it_needs():
    # without direct nothing counts barriers: it comes back 0, the rest exactly
    no_direct = [s for s in _synthetic(2, KNOWN[2]) if s[1] != "direct"]
    got = cost.fit(no_direct, ALONE, cores=2)
    assert got.barrier == 0 and got.alpha == pytest.approx(KNOWN[2].alpha, rel=1e-9)
    # timings that want a negative per-call cost get 0 there, not a negative number
    fast_small = [(*s[:4], s[4] - 0.9 * KNOWN[2].call) for s in _synthetic(2, KNOWN[2])]
    assert min(getattr(cost.fit(fast_small, ALONE, 2), k) for k in cost.NAMES) >= 0
    with pytest.raises(ValueError, match="at least 7 samples"):
        cost.fit(_synthetic(2, KNOWN[2])[:6])
    with pytest.raises(ValueError, match="times > 0"):
        cost.fit([(*s[:4], 0.0) for s in _synthetic(2, KNOWN[2])])


def test_nnls_matches_brute_force_over_active_sets():
    """Against an independent solver: try every subset of free variables, keep the best
    feasible least-squares solution."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        A, b = rng.standard_normal((12, 4)), rng.standard_normal(12)
        best = np.zeros(4)
        for mask in range(1, 16):
            cols = [j for j in range(4) if mask >> j & 1]
            x = np.zeros(4)
            x[cols] = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
            if x.min() >= 0 and np.linalg.norm(A @ x - b) < np.linalg.norm(A @ best - b):
                best = x
        np.testing.assert_allclose(cost._nnls(A, b), best, atol=1e-10)


def test_calibration_file(tmp_path, monkeypatch):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("MINIDIST_COST_FILE", str(path))
    monkeypatch.setattr(calibration, "RECHECK_SECONDS", 0.0)    # look at the file on every call
    assert cost.cost_file() == path and cost.constants() == cost.DEFAULT   # no file yet
    assert cost.describe() == f"defaults (no calibration file at {path})"
    mine = cost.Constants(alpha=1.0, beta=2e-9, gamma=3e-9)
    assert cost.save(mine) == path and cost.constants() == mine == cost.constants(4)
    assert cost.describe().endswith(", one set for every W)")
    # absurd constants change the choice: with alpha huge, the fewest messages win
    assert cost.choose("all_reduce", 64 << 20, 8) == "halving"
    for bad in ("{not json", '{"alpha": 1}', '{"alpha": -1, "beta": 1, "gamma": 1}',
                '{"version": 3, "constants": {"any": {}}}', '{"version": 2, "constants": {}}',
                '{"version": 2, "constants": {"2": {"alpha": 1, "beta": 1}}}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match=str(path)):
            cost.load(path)
    monkeypatch.delenv("MINIDIST_COST_FILE")
    assert str(cost.cost_file()).endswith(os.path.join(".cache", "minidist", "cost.json"))


def test_constants_per_world_size_round_trip_through_readable_json(tmp_path, monkeypatch):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("MINIDIST_COST_FILE", str(path))
    monkeypatch.setattr(calibration, "RECHECK_SECONDS", 0.0)
    table = cost.Table(tuple(KNOWN.items()), fitted="2025-01-02 03:04")
    cost.save(table, path, {"2": {"worst_ratio": 1.1}})
    raw = json.loads(path.read_text())
    assert raw["version"] == 2 and raw["fitted"] == "2025-01-02 03:04" and raw["fit"]
    assert raw["constants"]["4"] == {**{k: getattr(KNOWN[4], k) for k in cost.NAMES},
                                     "cores": 2, "setup": dict(KNOWN[4].setup)}
    assert cost.load_table(path) == table
    assert cost.describe() == f"calibrated {path} (2025-01-02 03:04, W = 2, 4 fitted)"
    # each W its own set; others the nearest calibrated one, ties to the larger
    assert [cost.constants(W) for W in (1, 2, 3, 4, 8)] == [KNOWN[2], KNOWN[2], KNOWN[4],
                                                          KNOWN[4], KNOWN[4]]
    assert cost.constants() == KNOWN[2] == cost.load(path, W=2)
    assert cost.predict("all_reduce", "ring", 4, 4096) == \
        cost.predict("all_reduce", "ring", 4, 4096, KNOWN[4]) == \
        cost.predict("all_reduce", "ring", 4, 4096, table)


def test_old_format_files_still_load_as_the_model_they_were_fitted_for(tmp_path, monkeypatch):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("MINIDIST_COST_FILE", str(path))
    monkeypatch.setattr(calibration, "RECHECK_SECONDS", 0.0)
    path.write_text(json.dumps({"alpha": 5e-6, "beta": 1e-10, "gamma": 2e-10}))
    c = cost.constants(4)
    assert c == cost.Constants(5e-6, 1e-10, 2e-10, call=0, barrier=5e-6, copy=0, dram=0)
    assert "old format" in cost.describe() and "--calibrate" in cost.describe()
    # the three-constant formulas of a mailbox algorithm are unchanged: a m + b s + g r
    W, n = 8, 800
    assert cost.predict("all_reduce", "ring", W, n) == pytest.approx(
        5e-6 * 2 * (W - 1) + 1e-10 * 2 * (W - 1) / W * n + 2e-10 * (W - 1) / W * n, rel=1e-12)


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
@pytest.mark.parametrize("W", [4, pytest.param(8, marks=pytest.mark.slow)])
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
