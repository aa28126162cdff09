"""collectives/tiers.py: collective costs on a two-level topology, against hand-computed
formulas (cost.py's terms on each link), where a group lies, and the algorithm chooser."""

import math

import pytest

from minidist.collectives.tiers import ALGOS, Link, Topology, choose, on_link, seconds

INTRA, INTER = Link(alpha=3e-6, beta=1 / 300e9, gamma=1e-13), Link(alpha=1e-5, beta=1 / 25e9)
TOPO = Topology(per_node=8, intra=INTRA, inter=INTER)


def test_a_ring_all_reduce_on_one_link_is_thakurs_formula():
    p, n = 4, 1e6
    want = 2 * (p - 1) * INTRA.alpha + 2 * (p - 1) / p * n * INTRA.beta \
        + (p - 1) / p * n * INTRA.gamma
    assert on_link("all_reduce", "ring", p, n, INTRA) == pytest.approx(want, rel=1e-15)
    assert on_link("all_reduce", "ring", 1, n, INTRA) == 0.0


def test_where_a_group_lies():
    assert TOPO.span(range(8)) == (1, 8)                 # tp inside a node
    assert TOPO.span([0, 8, 16, 24]) == (4, 1)           # dp across nodes
    assert TOPO.span([0, 1, 8, 9]) == (2, 2)
    with pytest.raises(ValueError, match="at least one rank"):
        TOPO.span([])


def test_a_group_on_one_node_uses_the_intra_link_only():
    n = 1 << 20
    assert seconds("all_reduce", "ring", range(8), n, TOPO) == \
        on_link("all_reduce", "ring", 8, n, INTRA)
    assert seconds("all_reduce", "hierarchical", range(8), n, TOPO) == \
        seconds("all_reduce", "ring", range(8), n, TOPO)


def test_a_flat_ring_across_nodes_pays_the_network_for_every_byte():
    ranks, n = range(16), 1 << 30
    assert seconds("all_reduce", "ring", ranks, n, TOPO) == \
        on_link("all_reduce", "ring", 16, n, INTER)


def test_the_hierarchical_forms_are_their_three_or_two_phases():
    ranks, n, L, N = range(32), 1 << 28, 8, 4                    # 4 nodes of 8
    ar = (on_link("reduce_scatter", "ring", L, n, INTRA)
          + on_link("all_reduce", "ring", N, n / L, INTER)
          + on_link("all_gather", "ring", L, n / L, INTRA))
    assert seconds("all_reduce", "hierarchical", ranks, n, TOPO) == pytest.approx(ar)
    rs = on_link("reduce_scatter", "ring", L, n, INTRA) + \
        on_link("reduce_scatter", "ring", N, n / L, INTER)
    assert seconds("reduce_scatter", "hierarchical", ranks, n, TOPO) == pytest.approx(rs)
    ag = on_link("all_gather", "ring", N, n, INTER) + \
        on_link("all_gather", "ring", L, N * n, INTRA)
    assert seconds("all_gather", "hierarchical", ranks, n, TOPO) == pytest.approx(ag)
    # by hand for the all-reduce's bandwidth part: 2 (L-1)/L n / 300 GB/s inside, twice,
    # and 2 (N-1)/N (n / L) / 25 GB/s across
    bw = 2 * (7 / 8) * n / 300e9 + 2 * (3 / 4) * (n / 8) / 25e9 + (7 / 8) * n * 1e-13
    assert ar - (7 + 6 + 7) * 0 - (14 * 3e-6 + 6 * 1e-5) == pytest.approx(bw, rel=1e-12)


def test_all_to_all_is_the_slower_of_its_two_kinds_of_link():
    ranks, n = range(16), 1 << 24
    inside = 7 * (INTRA.alpha + n / 16 * INTRA.beta)
    across = 8 * (INTER.alpha + n / 16 * INTER.beta)
    assert seconds("all_to_all", "pairwise", ranks, n, TOPO) == max(inside, across) == across


def test_choose_takes_a_log_depth_form_for_tiny_messages_and_the_hierarchy_for_large_ones():
    ranks = range(32)                                             # 4 nodes of 8
    # 8 bytes: recursive doubling's log2(32) = 5 network messages beat the tree's 2 x 5,
    # the ring's 62 and the hierarchy's 7 + 6 + 7
    assert choose("all_reduce", ranks, 8, TOPO)[0] == "halving"
    algo, t = choose("all_reduce", ranks, 1 << 30, TOPO)
    assert algo == "hierarchical" and t < seconds("all_reduce", "ring", ranks, 1 << 30, TOPO) / 5
    assert choose("all_reduce", range(8), 1 << 30, TOPO)[0] == "ring"   # one node
    for op in ALGOS:
        algo, t = choose(op, [0, 8, 16, 24], 1 << 20, TOPO)
        assert algo in ALGOS[op] and t > 0 and math.isfinite(t)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="beta"):
        Link(alpha=1e-6, beta=0.0)
    with pytest.raises(ValueError, match="per_node"):
        Topology(0, INTRA, INTER)
    with pytest.raises(ValueError, match="takes one of"):
        seconds("all_reduce", "pairwise", range(4), 8, TOPO)
    with pytest.raises(ValueError, match="same ranks on every node"):
        seconds("all_reduce", "hierarchical", [0, 1, 8], 1 << 20, TOPO)
    with pytest.raises(ValueError, match="no algorithms"):
        choose("gather", range(4), 8, TOPO)
