"""Nodes on one machine and the two-level collectives: every op equals the simulated oracle for
W in {4, 6, 8} on 2-4 nodes (and groups laid across the nodes in any order), every rank
sends exactly the formula's bytes on each tier, a group across nodes offers no shared
memory, "auto" takes the algorithm the two-tier cost model prices cheapest, and the
emulated link really is slower (a message across nodes takes at least alpha + n beta).

One spawn per (W, ranks per node): every rank walks the cases and returns its results and
per-tier byte counts; the tests compare them (the default set runs W = 4 on 2 nodes, the
rest is slow)."""

import time

import numpy as np
import pytest

from minidist import collectives as C
from minidist.collectives import hierarchical, simulated
from minidist.runtime.launch import spawn
from minidist.runtime.nodes import Nodes
from tests.helpers import assert_close

pytestmark = pytest.mark.multiproc

OPS = ("all_reduce", "reduce_scatter", "all_gather")
LENGTHS = (0, 5, 4099)                       # empty chunks, uneven chunks, a few pages
LAYOUTS = [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)]   # (W, ranks per node): 2-4 nodes
DEFAULT = (4, 2)
FAST = Nodes(2, alpha=0.0, beta=0.0)        # tiers without delays: results and bytes only


def _input(rank: int, n: int, dtype: str) -> np.ndarray:
    return np.random.default_rng(1000 * rank + n).standard_normal(n).astype(dtype)


def _walk(ctx, groups):
    """Every op x length x dtype on the world and on each extra group (given as global
    ranks; None where this rank is not in it): (results, bytes per call and tier)."""
    made = [ctx.world] + [ctx.new_group(g, name=f"g{k}") for k, g in enumerate(groups)]
    out = {}
    for gi, g in enumerate(made):
        if g is None:
            continue
        for op in OPS:
            for n in LENGTHS:
                for dtype in ("float64", "float32"):
                    x = _input(g.rank, n, dtype)
                    before = dict(g.stats)
                    y = getattr(C, op)(x, group=g, algo="hierarchical")
                    sent = {k: g.stats[k] - before[k] for k in ("bytes_sent", "bytes_sent_inter")}
                    out[gi, op, n, dtype] = (y, sent)
    return out


def _oracle(op, xs):
    return getattr(simulated, op)(xs)


def _check_layout(W, per):
    # the world, and a group that takes every rank's neighbour order reversed inside its
    # node (group order is not node order): the results must not care
    reversed_order = [n * per + per - 1 - j for n in range(W // per) for j in range(per)]
    runs = spawn(W, _walk, [reversed_order], nodes=Nodes(per, alpha=0.0, beta=0.0))
    for (gi, op, n, dtype), _ in runs[0].items():
        ranks = list(range(W)) if gi == 0 else reversed_order
        xs = [_input(r, n, dtype) for r in range(W)]
        want = _oracle(op, xs)
        tol = 1e-12 if dtype == "float64" else 1e-5
        for grank, g in enumerate(ranks):
            y, sent = runs[g][gi, op, n, dtype]
            assert_close(y, want[grank], atol=tol, rtol=tol,
                         what=f"W={W} per={per} group {gi} {op} n={n} {dtype} rank {grank}")
            N, L, isz = W // per, per, np.dtype(dtype).itemsize
            chunk = [len(c) for c in np.array_split(np.empty(n), W)]
            assert sent == _bytes(op, n, isz, N, L, chunk, ranks, grank, per), \
                (W, per, gi, op, n, dtype, grank, sent)


def _bytes(op, n, isz, N, L, chunk, ranks, grank, per):
    """The formula: bytes this rank sends in total and across nodes, from the grid."""
    nodes = {}
    for r, g in enumerate(ranks):
        nodes.setdefault(g // per, []).append(r)
    grid = list(nodes.values())
    column = [sum(chunk[grid[i][j]] for i in range(N)) for j in range(L)]
    i = next(k for k, row in enumerate(grid) if grank in row)
    j = grid[i].index(grank)
    # a ring over k parts sends every part but the one it ends with (reduce-scatter) or
    # every part but the one it starts with (all-gather): (k - 1) parts, which ones below
    def ring_rs(parts, me):       # rank me sends parts me-1, me-2, ... (not its own)
        return sum(parts) - parts[me]

    def ring_ag(parts, me):       # rank me sends all parts but the one it receives last
        return sum(parts) - parts[(me + 1) % len(parts)]

    rail = [chunk[grid[k][j]] for k in range(N)]
    if op == "reduce_scatter":
        intra, inter = ring_rs(column, j), ring_rs(rail, i)
    elif op == "all_reduce":
        intra = ring_rs(column, j) + ring_ag(column, j)
        inter = ring_rs(rail, i) + ring_ag(rail, i)
    else:                                            # all_gather: pieces of n elements each
        inter = (N - 1) * n
        intra = (L - 1) * N * n
    return {"bytes_sent": (intra + inter) * isz, "bytes_sent_inter": inter * isz * (N > 1)}


@pytest.mark.parametrize("W, per", [pytest.param(*lay, marks=() if lay == DEFAULT
                                                 else pytest.mark.slow) for lay in LAYOUTS])
def test_two_level_collectives_equal_the_oracle_and_send_the_formula_bytes(W, per):
    _check_layout(W, per)


def _shared_and_auto(ctx):
    g = ctx.world
    node = ctx.new_group([0, 1], name="node0")
    small = C.all_reduce(np.ones(4), group=g)               # a tree or ring: few bytes
    picks = {n: C.api._algo("all_reduce", "auto", n, g) for n in (64, 16 << 20)}
    try:
        g.shared("x", 64)
        shared = True
    except NotImplementedError as e:
        shared = str(e)
    return (g.supports_shared, None if node is None else node.supports_shared, shared,
            float(small[0]), picks)


def test_a_group_across_nodes_shares_no_memory_and_auto_prices_the_tiers():
    runs = spawn(4, _shared_and_auto, nodes=Nodes(2, alpha=100e-6, beta=4e-9))
    across, inside, shared, small, picks = runs[0]
    assert across is False and inside is True and small == 4.0
    assert "spans 2 emulated nodes, which share no memory" in shared
    # 16 MiB on 2 nodes of 2 with a 10x slower network: the two-level form sends 1/2 of
    # it across; 64 B: the fewest messages win
    assert picks[16 << 20] == "hierarchical" and picks[64] != "hierarchical", picks
    assert runs[2][1] is None and runs[1][1] is True


def _timed(ctx, n):
    x = np.ones(n // 8)
    C.all_reduce(x, group=ctx.world, algo="ring")            # warm the mailboxes
    t = time.perf_counter()
    ctx.world.sendrecv(x, dst=(ctx.rank + 1) % 2, src=(ctx.rank + 1) % 2)
    return time.perf_counter() - t


def test_a_message_across_nodes_takes_at_least_alpha_plus_n_beta():
    """A lower bound, never an upper one (no wall-clock ceiling in a test)."""
    nodes = Nodes(1, alpha=20e-3, beta=1e-8)                 # 20 ms + 10 ms per MB
    took = spawn(2, _timed, 1 << 20, nodes=nodes)
    assert min(took) >= nodes.delay(1 << 20) * 0.99, took


def test_nodes_are_checked():
    with pytest.raises(ValueError, match="do not fill nodes of 4"):
        spawn(6, _timed, 8, nodes=Nodes(4))
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        Nodes(0)
    with pytest.raises(ValueError, match="beta=-1"):
        Nodes(2, beta=-1)


def test_grid_needs_as_many_ranks_on_every_node():
    class G:
        name, size, rank, nodes = "g", 3, 0, Nodes(2)
        ranks = (0, 1, 2)
    with pytest.raises(ValueError, match=r"has \[2, 1\] ranks on its nodes"):
        hierarchical.grid(G())


@pytest.mark.parametrize("layout", [
    ["--tp", "2", "--pp", "2", "--dp", "2"],              # the loss's sum over pp crosses
    pytest.param(["--dp", "4", "--zero", "1"], marks=pytest.mark.slow),
    pytest.param(["--cp", "2", "--dp", "2"], marks=pytest.mark.slow),
    pytest.param(["--moe-every", "1", "--ep", "2", "--dp", "4"], marks=pytest.mark.slow),
    pytest.param(["--tp", "4", "--sp"], marks=pytest.mark.slow),
], ids=" ".join)
def test_training_on_emulated_nodes_equals_the_single_process(layout, capsys):
    """Nodes of 2 ranks: the groups that cross them (dp, pp, cp, ep or tp) take the
    algorithms without shared memory, and the run still equals one process."""
    from minidist import train_cli
    assert train_cli.main(layout + ["--ranks-per-node", "2", "--check", "--steps", "4",
                                    "--run-dir", "none"]) == 0
    out = capsys.readouterr().out
    assert "across them 100 us + n / 0.25 GB/s (emulated)" in out
    assert "\nOK: " in out, out
