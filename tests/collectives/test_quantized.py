"""Quantised collectives (ZeRO++'s qwZ and qgZ): the codes and scales keep every number within
half a step of its block's scale, on random and adversarial inputs (outliers, all-zero
blocks, subnormals, inf and NaN); a message has exactly packed_nbytes bytes; the quantised
all-gather gives every rank the same dequantised rows; the two-hop reduce-scatter equals its
one-process oracle bit for bit, stays within the error bound of the exact sum, and sends
exactly the formula's bytes inside and across (emulated) nodes."""

import numpy as np
import pytest

from minidist.collectives import quantized as Q
from minidist.runtime.launch import spawn
from minidist.runtime.nodes import Nodes


def _adversarial(n: int, rng) -> dict[str, np.ndarray]:
    x = rng.standard_normal(n)
    outlier = x.copy()
    outlier[::97] *= 1e6                                   # one huge value per block or so
    zeros = x.copy()
    zeros[:2 * Q.BLOCK] = 0.0                              # whole blocks of zeros
    tiny = x * 1e-310                                      # subnormal float64
    return {"normal": x, "outliers": outlier, "zero blocks": zeros, "subnormal": tiny,
            "float32": x.astype(np.float32), "all zero": np.zeros(n)}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [256, 32, 7])
def test_each_number_is_within_half_a_step_of_its_block_scale(bits, block):
    rng = np.random.default_rng(bits * 100 + block)
    for name, x in _adversarial(1000, rng).items():
        codes, scales = Q.quantize(x, bits, block)
        assert codes.dtype == np.int8 and scales.dtype == np.float32
        assert np.all(np.abs(codes) <= Q.levels(bits)), name
        back = Q.dequantize(codes, scales, block, x.dtype)
        step = np.repeat(scales.astype(np.float64), block)[:x.size]
        err = np.abs(back.astype(np.float64) - x.astype(np.float64))
        # half a step, plus the rounding of the scale to float32 and of x~ to x's dtype
        slack = 1e-6 * np.abs(x) + (np.finfo(x.dtype).tiny if name == "subnormal" else 0)
        assert np.all(err <= step / 2 * (1 + 1e-6) + slack + 1e-300), (name, err.max())
        if name in ("all zero", "zero blocks"):
            z = x == 0
            assert np.all(back[z] == 0), name                # zeros stay exact
        assert np.array_equal(Q.roundtrip(x, bits, block), back.reshape(x.shape)), name


@pytest.mark.parametrize("block", [256, 7])
def test_fp8_codes_keep_each_number_within_two_to_the_minus_4_of_itself(block):
    """E4M3 codes after a power-of-two scale per block: relative error <= 2^-4 for the
    numbers the scale puts in E4M3's normal range (>= 2^-6), half a subnormal step below;
    zeros exact; scales exact powers of two; one byte a number."""
    rng = np.random.default_rng(block)
    for name, x in _adversarial(1000, rng).items():
        codes, scales = Q.quantize(x, "e4m3", block)
        assert codes.dtype.itemsize == 1 and scales.dtype == np.float32
        finite = scales[np.isfinite(scales)]
        assert np.all(np.frexp(finite)[0] == 0.5), name             # powers of two
        back = Q.roundtrip(x, "e4m3", block).astype(np.float64)
        step = np.repeat(scales.astype(np.float64), block)[:x.size]   # 1 / m of x's block
        xs = np.abs(x.astype(np.float64)) / step                       # |x m|
        err = np.abs(back - x.astype(np.float64))
        normal = xs >= 2.0 ** -6
        assert np.all(err[normal] <= 2.0 ** -4 * np.abs(x[normal]) * (1 + 1e-6)), name
        assert np.all(err[~normal] <= 2.0 ** -10 * step[~normal] * (1 + 1e-6)), name
        assert np.all(back[x == 0] == 0), name
    x = np.linspace(-1, 1, 3 * block)
    x[block + 1] = np.inf
    assert np.all(np.isnan(Q.roundtrip(x, "e4m3", block)[block:2 * block]))
    assert Q.packed_nbytes(1000, "e4m3", 256) == 1000 + 4 * 4


def test_a_block_with_inf_or_nan_comes_back_nan_and_the_others_are_untouched():
    x = np.linspace(-1, 1, 3 * Q.BLOCK)
    x[Q.BLOCK + 5] = np.inf
    x[2 * Q.BLOCK + 1] = np.nan
    back = Q.roundtrip(x, 8)
    assert np.all(np.isnan(back[Q.BLOCK:]))
    assert np.all(np.isfinite(back[:Q.BLOCK]))
    assert np.max(np.abs(back[:Q.BLOCK] - x[:Q.BLOCK])) <= 1 / 254 * (1 + 1e-6)


def test_blocks_restart_at_each_cut():
    assert list(Q.block_starts(10, 4)) == [0, 4, 8]
    assert list(Q.block_starts(10, 4, cuts=[0, 3, 10, 12])) == [0, 3, 7]
    assert list(Q.block_starts(0, 4)) == []
    assert Q.piece_cuts([5, 12], [(0, 8), (10, 14)]) == [0, 5, 8, 10]
    x = np.concatenate([np.full(3, 1e-3), np.full(5, 1e3)])         # small, then large
    np.testing.assert_allclose(Q.roundtrip(x, 8, block=8, cuts=[3]), x, rtol=1e-7)
    assert np.all(Q.roundtrip(x, 8, block=8)[:3] == 0)             # one scale: 1e-3 -> 0


@pytest.mark.parametrize("n", [0, 1, 2, 31, 255, 256, 257, 1001])
@pytest.mark.parametrize("bits", Q.BITS)
def test_a_message_has_exactly_packed_nbytes(n, bits):
    x = np.random.default_rng(n).standard_normal(n)
    for block in (256, 32):
        msg = Q.pack(x, bits, block)
        assert msg.dtype == np.uint8 and msg.size == Q.packed_nbytes(n, bits, block)
        assert np.array_equal(Q.unpack(msg, n, bits, block),
                              Q.dequantize(*Q.quantize(x, bits, block), block))
    assert Q.packed_nbytes(1000, 8, 256) == 1000 + 4 * 4
    assert Q.packed_nbytes(1000, 4, 32) == 500 + 4 * 32


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="use 8 \\(int8\\), 4 \\(int4\\) or 'e4m3'"):
        Q.pack(np.ones(3), 2)
    with pytest.raises(ValueError, match="block=0"):
        Q.pack(np.ones(3), 8, 0)


# --- over ranks -----------------------------------------------------------------------------

def _x(rank: int, n: int) -> np.ndarray:
    x = np.random.default_rng(7 + rank).standard_normal(n)
    x[rank::53] *= 50.0                                     # some outliers
    return x


def _cuts(total: int) -> list[int]:
    """Parameter edges in a flat vector of `total` numbers (blocks restart there)."""
    return [0, 37, 411, total // 2 + 3, total - 5]


def _collectives(ctx, L: int, n_gather: int, S: int):
    """On W = N L ranks as N nodes of L: the quantised all-gather of my _x, the quantised
    reduce-scatter of my _x(W S) over (node, rail) groups, and the bytes each sent, by tier."""
    W, r = ctx.world_size, ctx.rank
    N = W // L
    node = rail = None
    for i in range(N):                                          # every rank makes every group
        g = ctx.new_group([i * L + j for j in range(L)], name=f"node{i}")
        node = g if g is not None else node
    for j in range(L):
        g = ctx.new_group([i * L + j for i in range(N)], name=f"rail{j}")
        rail = g if g is not None else rail
    world = ctx.world
    out = {}
    before = dict(world.stats)
    cuts = _cuts(W * n_gather)
    out["gather"] = Q.all_gather(_x(r, n_gather), world, bits=8, cuts=cuts)
    out["gather async"] = Q.all_gather(_x(r, n_gather), world, bits=8, cuts=cuts,
                                       async_op=True).wait()
    out["gather bytes"] = {k: world.stats[k] - before[k]
                           for k in ("bytes_sent", "bytes_sent_inter")}
    b_node, b_rail = dict(node.stats), dict(rail.stats)
    out["rs"] = Q.reduce_scatter(_x(r, W * S), node, rail, bits=4, block=32,
                                 cuts=_cuts(W * S))
    out["rs bytes"] = {"node": node.stats["bytes_sent"] - b_node["bytes_sent"],
                       "node inter": node.stats["bytes_sent_inter"]
                       - b_node["bytes_sent_inter"],
                       "rail": rail.stats["bytes_sent"] - b_rail["bytes_sent"],
                       "rail inter": rail.stats["bytes_sent_inter"]
                       - b_rail["bytes_sent_inter"]}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("W, L", [(4, 2), pytest.param(8, 4, marks=pytest.mark.slow),
                                  pytest.param(6, 3, marks=pytest.mark.slow)])
def test_quantised_collectives_equal_their_oracle_and_send_the_formula_bytes(W, L):
    N, n_gather, S = W // L, 301, 300
    runs = spawn(W, _collectives, L, n_gather, S, nodes=Nodes(L, alpha=0.0, beta=0.0))
    piece = [Q.piece_cuts(_cuts(W * n_gather), [(r * n_gather, (r + 1) * n_gather)])
             for r in range(W)]
    rows = np.stack([Q.roundtrip(_x(r, n_gather), 8, cuts=piece[r]) for r in range(W)])
    slots = max(len(Q.block_starts(n_gather, Q.BLOCK, c)) for c in piece)
    xs = [_x(r, W * S) for r in range(W)]
    want = Q.simulate_reduce_scatter(xs, L, bits=4, block=32, cuts=_cuts(W * S))
    exact = np.sum(xs, axis=0).reshape(W, S)
    # the bound of the module docstring: sum over hops of half a step, from the inputs'
    # and the node partials' largest magnitudes (a loose, closed form)
    partial_max = max(np.max(np.abs(sum(xs[i * L + j] for j in range(L)))) for i in range(N))
    bound = (W * max(np.max(np.abs(x)) for x in xs) + N * partial_max) / (2 * 7) * 1.001
    for r, out in enumerate(runs):
        assert np.array_equal(out["gather"], rows) and np.array_equal(out["gather async"], rows)
        packed = Q.packed_nbytes(n_gather, 8, 256, scale_slots=slots)
        edge = r % L == L - 1                                  # the ring leaves my node
        assert out["gather bytes"] == {"bytes_sent": 2 * (W - 1) * packed,
                                       "bytes_sent_inter": 2 * (W - 1) * packed * edge}, r
        assert np.array_equal(out["rs"], want[r]), r
        assert np.max(np.abs(out["rs"] - exact[r])) <= bound, r
        i, j = divmod(r, L)
        chunk = lambda i, j: (i * L + j) * S                         # noqa: E731
        column = lambda jj: Q.packed_nbytes(N * S, 4, 32, Q.piece_cuts(  # noqa: E731
            _cuts(W * S), [(chunk(k, jj), chunk(k, jj) + S) for k in range(N)]))
        row = sum(Q.packed_nbytes(S, 4, 32, Q.piece_cuts(_cuts(W * S),
                                                         [(chunk(k, j), chunk(k, j) + S)]))
                  for k in range(N) if k != i)
        assert out["rs bytes"] == {"node": sum(column(jj) for jj in range(L) if jj != j),
                                   "node inter": 0, "rail": row, "rail inter": row}, r
