"""Tiled matmuls (deterministic/matmul.py): x @ W over fixed tiles equals x @ W to rounding,
its gradients are right, and a rank holding some column tiles or some row tiles computes,
with the exchange over its group, the single process's bits exactly."""

import functools

import numpy as np
import pytest

from minidist import collectives as C
from minidist.autograd import Tensor
from minidist.deterministic.matmul import Tiles, Tokens, fold, tiled_matmul, tree_over_tiles
from minidist.deterministic.tree_sum import TreeSum, combine, stacked_nodes
from minidist.runtime import spawn

K, N, k, n = 24, 32, 6, 4            # 4 x 8 tiles


def _data(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 5, K)).astype(dtype)
    w = rng.standard_normal((K, N)).astype(dtype)
    g = rng.standard_normal((2, 5, N)).astype(dtype)
    return x, w, g


def _run(x, w, g, tiles):
    X, W = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    y = tiled_matmul(X, W, tiles)
    y.backward(g)
    return y.data, X.grad, W.grad


@pytest.mark.parametrize("count", [1, 2, 5, 8, 13])
def test_stacked_nodes_are_treesum_nodes_for_any_runs(count):
    v = np.random.default_rng(count).standard_normal((count, 3))
    tree = TreeSum()
    for i in range(count):
        tree.push(i, v[i])
    ref = combine(tree.nodes(), count)
    for cut in range(count + 1):
        parts = stacked_nodes(v[:cut], list(range(cut))) + \
            stacked_nodes(v[cut:], list(range(cut, count)))
        assert np.array_equal(combine(parts, count), ref)
    odd = [i for i in range(count) if i % 3 == 1]
    rest = [i for i in range(count) if i % 3 != 1]
    assert np.array_equal(combine(stacked_nodes(v[odd], odd) + stacked_nodes(v[rest], rest),
                                  count), ref)


def test_a_leaf_of_token_runs_is_one_run_of_every_row_and_join_undoes_split():
    """Tokens(per_sequence=4) over T = 8 (runs of 2) on a rank holding positions 0-1 and
    6-7 (zig-zag, cp=2): 2 leaves, runs 0 and 3, each both rows' 2 positions, row-major,
    at places 0 and 1 of the tree (fold: one node); one token per leaf (no
    per_sequence): a leaf per (row, position), index b T + t."""
    x = np.arange(2 * 4 * 3).reshape(2, 4, 3)                    # (B, rows, C)
    runs = Tokens(positions=lambda rows: (np.array([0, 1, 6, 7]), 8), per_sequence=4)
    assert runs.leaves(x.shape) == ((0, 1), 4)
    assert [fold(j, 8) for j in range(8)] == [0, 2, 4, 6, 7, 5, 3, 1]
    assert sorted(fold(j, 5) for j in range(5)) == list(range(5))
    parts = runs.split(x)                                         # (2 leaves, 4, C)
    assert np.array_equal(parts[1], np.concatenate([x[0, 2:], x[1, 2:]]))
    assert np.array_equal(runs.join(parts, 2), x)
    single = Tokens(positions=lambda rows: (np.array([0, 1, 6, 7]), 8))
    assert single.leaves(x.shape) == ((0, 1, 6, 7, 8, 9, 14, 15), 16)
    assert np.array_equal(single.join(single.split(x), 2), x)


def test_tiled_matmul_and_its_gradients_equal_the_plain_ones_to_rounding():
    x, w, g = _data(np.float64)
    y, dx, dw = _run(x, w, g, Tiles.whole(K, N, k, n))
    np.testing.assert_allclose(y, x @ w, rtol=0, atol=1e-13)
    np.testing.assert_allclose(dx, g @ w.T, rtol=0, atol=1e-13)
    np.testing.assert_allclose(dw, x.reshape(-1, K).T @ g.reshape(-1, N), rtol=0, atol=1e-13)


def test_a_padding_tile_is_left_out_of_the_sum_over_n():
    parts = np.arange(12.0).reshape(4, 3)
    assert np.array_equal(tree_over_tiles(parts, (0, 1, 2, 3), 4, None, valid=3),
                          (parts[0] + parts[1]) + parts[2])


def test_tiles_that_do_not_cut_the_weight_are_refused():
    with pytest.raises(ValueError, match="whole 5 x 4 tiles"):
        Tiles.whole(K, N, 5, 4)
    with pytest.raises(ValueError, match="does not match"):
        tiled_matmul(Tensor(np.zeros((2, K))), Tensor(np.zeros((K, N + 1))),
                     Tiles.whole(K, N, k, n))


def _shard(ctx, dtype, split):
    """Rank r of 2 holds N-tiles (split "n": tiles {0, 1, 2, 5} / {3, 4, 6, 7}, columns) or
    K-tiles ("k": tiles {0, 2} / {1, 3}, rows) of W: two runs each, equally many."""
    x, w, g = _data(dtype)
    r, exchange = ctx.rank, functools.partial(C.all_gather, group=ctx.world)
    if split == "n":
        index = (0, 1, 2, 5) if r == 0 else (3, 4, 6, 7)
        cols = np.concatenate([np.arange(j * n, (j + 1) * n) for j in index])
        tiles = Tiles(k, n, K // k, N // n, tuple(range(K // k)), index, exchange)
        y, dx, dw = _run(x, np.ascontiguousarray(w[:, cols]), np.ascontiguousarray(g[..., cols]),
                         tiles)
        return cols, y, dx, dw
    index = (0, 2) if r == 0 else (1, 3)
    rows = np.concatenate([np.arange(i * k, (i + 1) * k) for i in index])
    tiles = Tiles(k, n, K // k, N // n, index, tuple(range(N // n)), exchange)
    y, dx, dw = _run(np.ascontiguousarray(x[..., rows]), np.ascontiguousarray(w[rows]), g, tiles)
    return rows, y, dx, dw


@pytest.mark.multiproc
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("split", ["n", "k"])
def test_a_rank_with_some_tiles_computes_the_single_process_bits(dtype, split):
    """Columns: y is my columns of the single process's y, dx (exchanged) all of its dx.
    Rows: y (exchanged) is all of its y, dx my rows of its dx. dW: my part, bitwise."""
    x, w, g = _data(dtype)
    y, dx, dw = _run(x, w, g, Tiles.whole(K, N, k, n))
    for idx, y_r, dx_r, dw_r in spawn(2, _shard, dtype, split):
        if split == "n":
            assert np.array_equal(y_r, y[..., idx]) and np.array_equal(dx_r, dx)
            assert np.array_equal(dw_r, dw[:, idx])
        else:
            assert np.array_equal(y_r, y) and np.array_equal(dx_r, dx[..., idx])
            assert np.array_equal(dw_r, dw[idx])
