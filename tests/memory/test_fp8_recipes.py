"""The five FP8 recipes: formats per role, scale granularity (checked tile by tile against a
plain loop), quantisation error within each element's documented bound on random and
adversarial tensors, gemm equal to the product of the dequantised operands (blockwise: within
its promotion bound), delayed scaling's history, and refusals of bad input."""

import math

import ml_dtypes
import numpy as np
import pytest

from minidist.memory import fp8
from minidist.memory import fp8_recipes as R

DYNAMIC = ("tensorwise", "rowwise", "blockwise", "mxfp8")
ROLES_OF = {"fprop": ("activation", "weight"),     # y = x @ w
            "dgrad": ("gradient", "weight"),       # dx = dy @ w^T
            "wgrad": ("activation", "gradient")}   # dw = x^T @ dy
EXPECTED_FORMATS = {                       # (activation, weight, gradient)
    "delayed": ("e4m3", "e4m3", "e5m2"),   # TE's HYBRID
    "tensorwise": ("e4m3", "e4m3", "e5m2"),
    "rowwise": ("e4m3", "e4m3", "e4m3"),
    "blockwise": ("e4m3", "e4m3", "e4m3"),
    "mxfp8": ("e4m3", "e4m3", "e4m3"),
}


def _spread(shape, seed, decades=6.0):
    """Normal values times e^U(-decades, decades): many binades in every tile."""
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.uniform(-decades, decades, shape))
    return (rng.standard_normal(shape) * mag).astype(np.float32)


def _state(recipe, role):
    """A fresh history for delayed (its first use scales by its own amax); None otherwise."""
    if recipe.name != "delayed":
        return None
    return fp8.DelayedScaling(recipe.format(role), recipe.history_len, recipe.margin)


def _deq_product(recipe, a, b, kind, site):
    """deq(a) @ deq(b) from quantize with the roles `kind` gives: the reference for gemm."""
    role_a, role_b = ROLES_OF[kind]
    sa = site.history(kind, "a") if recipe.name == "delayed" else None
    sb = site.history(kind, "b") if recipe.name == "delayed" else None
    da = R.dequantize(recipe.quantize(a, role_a, -1, sa))
    db = R.dequantize(recipe.quantize(b, role_b, 0, sb))
    return (da.reshape(-1, a.shape[-1]) @ db).reshape(a.shape[:-1] + (b.shape[1],))


def test_formats_per_role_and_the_element_format_constants():
    for name, want in EXPECTED_FORMATS.items():
        r = R.make_recipe(name)
        assert tuple(r.format(role).name for role in R.ROLES) == want, name
        for role, fmt in zip(R.ROLES, want):
            x = _spread((4, 64), 0)
            q = r.quantize(x, role, 0 if role == "weight" else -1, _state(r, role))
            dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
            assert q.codes.dtype == dtype and q.scales.dtype == np.float32 and q.role == role
    assert R.make_recipe("delayed", fp8_format="e4m3").format("gradient") is fp8.E4M3
    assert R.make_recipe("mxfp8", grad_format="e5m2").format("gradient") is fp8.E5M2
    assert (R.emax(fp8.E4M3), R.emax(fp8.E5M2)) == (8, 15)      # 448 = 1.75 * 2^8, 57344
    assert R.RECIPES == ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")
    assert R.OPERANDS == ROLES_OF


@pytest.mark.parametrize("role", R.ROLES)
@pytest.mark.parametrize("name", R.RECIPES)
def test_quantisation_error_is_within_the_bound_on_random_tensors(name, role):
    r = R.make_recipe(name)
    x = _spread((48, 300), seed=R.RECIPES.index(name))          # K = 300: not a multiple of 128
    axis = 0 if role == "weight" else -1
    e = R.quantization_error(x, r, role, axis, _state(r, role))
    assert e.within_bound, e
    assert e.n_normal > 5000 and e.max_rel > e.rel_bound / 2    # the bound is nearly met
    assert e.n_poisoned == 0
    if name == "mxfp8":    # the spec's rounding clips the top of some blocks, by < 1/8
        assert e.n_saturated > 0 and e.max_rel_saturated > 2 ** -4
    else:                  # the scale from the tensor's own amax (delayed: first use)
        assert e.n_saturated == 0
    if e.fmt == "e4m3":
        assert e.n_subnormal > 0 and 0 < e.max_floor_ratio <= 1   # subnormals seen
    pow2 = name not in ("tensorwise", "blockwise")
    bound = 2.0 ** -(r.format(role).mantissa_bits + 1)
    assert e.rel_bound == (bound if pow2 else bound + 2.0 ** -22)


@pytest.mark.parametrize("name", R.RECIPES)
def test_adversarial_finite_tensors_stay_within_the_bound(name):
    r = R.make_recipe(name)
    x = np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32)
    x[3, 17] = 1e5                                              # an outlier
    x[5, :] = 0.0                                               # an all-zero row
    x[7, 128:] = 0.0                                            # an all-zero 1 x 128 tile
    x[9, :] = np.float32(1e-40) * np.arange(256)                # fp32 subnormals, a row
    x[11, :] = np.float32(3e-38)                                # tiny normals, a row
    for role in ("activation", "gradient"):
        e = R.quantization_error(x, r, role, -1, _state(r, role))
        assert e.within_bound and (e.n_saturated == 0 or name == "mxfp8"), e
        q = r.quantize(x, role, -1, _state(r, role))
        back = R.dequantize(q)
        assert np.all(np.isfinite(q.scales)) and np.all(np.isfinite(back))
        assert np.array_equal(back[x == 0], x[x == 0])          # zeros exact, tile or not
        assert np.all(back[5] == 0) and np.all(back[7, 128:] == 0)


def test_an_outlier_damages_only_its_tile():
    x = np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32)
    spiked = x.copy()
    spiked[10, 100] = 1e5            # pushes its tile's other values below E4M3's tiny
    flushed = {}
    for name in DYNAMIC:
        r = R.make_recipe(name)
        flushed[name] = (R.quantization_error(spiked, r, "activation").n_subnormal
                         - R.quantization_error(x, r, "activation").n_subnormal)
    assert flushed["tensorwise"] > 60 * 200                     # nearly the whole tensor
    assert flushed["tensorwise"] > flushed["rowwise"] > flushed["blockwise"] > flushed["mxfp8"]
    assert flushed["rowwise"] <= 255 and flushed["blockwise"] <= 127 and flushed["mxfp8"] <= 31


@pytest.mark.parametrize("name", R.RECIPES)
def test_non_finite_inputs_give_non_finite_outputs(name):
    r = R.make_recipe(name)
    a = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    b = np.random.default_rng(4).standard_normal((256, 16)).astype(np.float32)
    a[2, 5], a[4, 77], b[100, 3] = np.nan, np.inf, -np.inf
    y = r.gemm(a, b, "fprop", r.new_site())
    bad = np.zeros(y.shape, bool)
    bad[[2, 4], :], bad[:, 3] = True, True
    if name == "tensorwise":
        assert not np.isfinite(y).any()                # one scale: the whole tensor is NaN
    elif name == "blockwise":                          # b's 128 x 128 block covers all of N
        assert not np.isfinite(y).any()
        y = r.gemm(a, b, "wgrad")                      # b a gradient: 128 x 1 tiles
        assert not np.isfinite(y[bad]).any() and np.isfinite(y[~bad]).all()
    else:
        assert not np.isfinite(y[bad]).any() and np.isfinite(y[~bad]).all()
    for role in ("activation", "gradient"):
        x = a.copy()
        e = R.quantization_error(x, r, role, -1, _state(r, role))
        assert e.nonfinite_kept and e.within_bound, e
        back = R.dequantize(r.quantize(x, role, -1, _state(r, role)))
        if name == "delayed":                          # scale from the history: only they
            assert np.array_equal(~np.isfinite(back), ~np.isfinite(x))
            kept_inf = r.format(role).name == "e5m2"   # E5M2 has infinities, E4M3 does not
            assert np.isinf(back[4, 77]) == kept_inf and np.isnan(back[2, 5])
        else:                                          # the tile is NaN throughout
            q = r.quantize(x, role, -1)
            tile_nan = ~np.isfinite(R.expand(q.scales, q.tile, x.shape) * np.ones(x.shape))
            assert np.array_equal(np.isnan(back), tile_nan) and tile_nan[2, 5]
            assert e.n_poisoned == tile_nan.sum() - 2


@pytest.mark.parametrize("name", R.RECIPES)
def test_all_zero_operands_and_empty_shapes_are_exact(name):
    r = R.make_recipe(name)
    site = r.new_site()
    b = np.random.default_rng(5).standard_normal((40, 6)).astype(np.float32)
    for kind in R.KINDS:
        y = r.gemm(np.zeros((3, 40), np.float32), b, kind, site)
        assert y.dtype == np.float32 and np.array_equal(y, np.zeros((3, 6)))
        q = r.quantize(np.zeros((3, 40), np.float32), ROLES_OF[kind][0], -1,
                       site.history(kind, "a") if name == "delayed" else None)
        assert np.all(np.isfinite(q.scales)) and not np.any(R.dequantize(q))
    for a_shape, b_shape in (((0, 40), (40, 6)), ((3, 0), (0, 6)), ((2, 0, 40), (40, 6))):
        y = r.gemm(np.ones(a_shape, np.float32), np.ones(b_shape, np.float32), "fprop", site)
        assert y.shape == a_shape[:-1] + (b_shape[1],) and not np.any(y)


def test_per_tensor_scales():
    x = _spread((20, 50), 6)
    amax = float(np.abs(x).max())
    q = R.make_recipe("tensorwise").quantize(x, "activation")
    assert q.scales.shape == (1, 1) and q.scales[0, 0] == np.float32(448.0 / amax)   # torchao
    q = R.make_recipe("tensorwise", pow2_scales=True).quantize(x, "gradient")
    assert q.scales[0, 0] == 2.0 ** math.floor(math.log2(np.float32(57344.0 / amax)))
    d = R.make_recipe("delayed")
    q = d.quantize(x, "weight", 0, d.new_site().history("fprop", "b"))
    assert q.scales.shape == (1, 1) and q.scales[0, 0] == fp8.scale_for(fp8.E4M3, amax)


def test_rowwise_scales_one_power_of_two_per_slice_along_k():
    r = R.make_recipe("rowwise")
    a, b = _spread((6, 5, 40), 7), _spread((40, 7), 8)
    qa, qb = r.quantize(a, "activation", -1), r.quantize(b, "weight", 0)
    assert qa.scales.shape == (6, 5, 1) and qb.scales.shape == (1, 7)
    for i, j in np.ndindex(6, 5):
        s = np.float32(448.0 / float(np.abs(a[i, j]).max()))
        assert qa.scales[i, j, 0] == 2.0 ** (math.frexp(float(s))[1] - 1)
    for n in range(7):
        s = np.float32(448.0 / float(np.abs(b[:, n]).max()))
        assert qb.scales[0, n] == 2.0 ** (math.frexp(float(s))[1] - 1)


def test_blockwise_scales_1x128_tiles_and_128x128_blocks_with_k_not_a_multiple():
    r = R.make_recipe("blockwise")
    act, w, g = _spread((5, 300), 9), _spread((300, 200), 10), _spread((300, 9), 11)
    qa, qw, qg = r.quantize(act, "activation"), r.quantize(w, "weight", 0), \
        r.quantize(g, "gradient", 0)
    assert (qa.scales.shape, qw.scales.shape, qg.scales.shape) == ((5, 3), (3, 2), (3, 9))
    for i, k in np.ndindex(5, 3):
        tile = act[i, 128 * k:128 * (k + 1)]                     # the last one: 44 elements
        assert qa.scales[i, k] == np.float32(448.0 / float(np.abs(tile).max()))
    for k, n in np.ndindex(3, 2):
        block = w[128 * k:128 * (k + 1), 128 * n:128 * (n + 1)]
        assert qw.scales[k, n] == np.float32(448.0 / float(np.abs(block).max()))
    for k, n in np.ndindex(3, 9):                                # the 128 x 1 tiles of wgrad
        assert qg.scales[k, n] == np.float32(448.0 / float(np.abs(g[128 * k:128 * (k + 1),
                                                                     n]).max()))
    with pytest.raises(ValueError, match="2-D"):
        r.quantize(np.ones((2, 3, 4), np.float32), "weight", 0)


def test_mxfp8_scales_are_e8m0_powers_of_two_per_32_elements():
    r = R.make_recipe("mxfp8")
    a, b = _spread((5, 100), 12, decades=30.0), _spread((100, 3), 13)
    a[0, :32] = 0.0                                             # X = 2^-127, the E8M0 floor
    qa, qb = r.quantize(a, "activation", -1), r.quantize(b, "weight", 0)
    assert qa.scales.shape == (5, 4) and qb.scales.shape == (4, 3)
    for i, k in np.ndindex(5, 4):
        amax = float(np.abs(a[i, 32 * k:32 * (k + 1)]).max())
        want = -127 if amax == 0 else min(max(math.frexp(amax)[1] - 1 - 8, -127), 127)
        assert 1.0 / float(qa.scales[i, k]) == 2.0 ** want       # X = 2^(floor(log2 amax) - 8)
    for q in (qa, qb):
        e8 = R.to_e8m0(q)
        assert e8.dtype == ml_dtypes.float8_e8m0fnu
        assert np.array_equal(e8.astype(np.float32), np.float32(1.0) / q.scales)   # exact
        bits = e8.view(np.uint8).astype(int)
        assert bits.max() <= 254 and np.array_equal(
            bits, 127 + np.round(np.log2(1.0 / q.scales.astype(np.float64))).astype(int))
    assert R.to_e8m0(qa).view(np.uint8)[0, 0] == 0              # 2^-127


def test_mxfp8_spec_rounding_saturates_the_top_of_a_block_and_ceil_does_not():
    x = np.full((1, 32), 0.3, np.float32)
    x[0, 0] = 1.9                    # floor: X = 2^(0 - 8), 1.9 / X = 486 > 448: clipped
    floor, ceil = R.make_recipe("mxfp8"), R.make_recipe("mxfp8", scale_rounding="ceil")
    e = R.quantization_error(x, floor, "activation")
    assert e.n_saturated == 1 and e.within_bound
    assert 2.0 ** -4 < e.max_rel_saturated < 1 / 8 == e.saturation_bound
    assert R.dequantize(floor.quantize(x, "activation"))[0, 0] == 448.0 / 256
    e = R.quantization_error(x, ceil, "activation")             # X = 2^ceil(log2(1.9/448))
    assert e.n_saturated == 0 and e.within_bound and e.saturation_bound == 0.0
    assert ceil.quantize(x, "activation").scales[0, 0] == 128.0


@pytest.mark.parametrize("kind", R.KINDS)
@pytest.mark.parametrize("name", ("delayed", "tensorwise", "rowwise", "mxfp8"))
def test_gemm_is_the_product_of_the_dequantised_operands(name, kind):
    r = R.make_recipe(name)
    site, twin = r.new_site(), r.new_site()
    for step in range(2):                            # delayed: the second uses the history
        a, b = _spread((2, 12, 200), 20 + step, 2.0), _spread((200, 40), 30 + step, 2.0)
        if kind == "wgrad":
            a = a.reshape(24, 200)
        y = r.gemm(a, b, kind, site)
        assert y.dtype == np.float32 and y.shape == a.shape[:-1] + (40,)
        assert np.array_equal(y, _deq_product(r, a, b, kind, twin))


def test_round_to_bits_rounds_to_nearest_even():
    x = np.array([1 + 2.0 ** -15, 1 + 3 * 2.0 ** -15, 1 + 2.0 ** -14 + 2.0 ** -20, -1.5,
                  0.0, np.inf, np.nan])
    out = R.round_to_bits(x, 14)                     # spacing at 1: 2^-14
    assert np.array_equal(out[:5], [1.0, 1 + 2.0 ** -13, 1 + 2.0 ** -14, -1.5, 0.0])
    assert out[5] == np.inf and np.isnan(out[6])
    f32 = _spread(1000, 14).astype(np.float64)
    assert np.array_equal(R.round_to_bits(f32, 23), f32)          # fp32 values: unchanged


@pytest.mark.parametrize("kind", R.KINDS)
def test_blockwise_promotion_is_within_its_bound_and_fp32_at_23_bits(kind):
    rng = np.random.default_rng(40)
    # all-positive terms: each chunk's partial sum is large, so 14 bits lose visibly
    a = np.abs(rng.standard_normal((16, 1000))).astype(np.float32)       # K = 1000
    b = np.abs(rng.standard_normal((1000, 24))).astype(np.float32)
    worst = {}
    for bits in (14, 23):
        r = R.make_recipe("blockwise", accum_bits=bits)
        role_a, role_b = ROLES_OF[kind]
        da = R.dequantize(r.quantize(a, role_a, -1)).astype(np.float64)
        db = R.dequantize(r.quantize(b, role_b, 0)).astype(np.float64)
        exact = da @ db
        err = np.abs(r.gemm(a, b, kind) - exact)
        bound = r.accumulation_bound(np.abs(da), np.abs(db))
        assert np.all(err <= bound), (bits, float((err / bound).max()))
        worst[bits] = float((err / (np.abs(da) @ np.abs(db))).max())
    n_c = 8                                          # ceil(1000 / 128)
    assert worst[23] <= (n_c + 5) * 2.0 ** -24       # fp32: what a plain fp32 GEMM keeps
    assert worst[14] > 4 * (n_c + 5) * 2.0 ** -24    # 14 bits: the emulation shows
    r = R.make_recipe("blockwise", interval=32)      # more promotions, same tiles
    da = R.dequantize(r.quantize(a, "activation", -1)).astype(np.float64)
    db = R.dequantize(r.quantize(b, "weight", 0)).astype(np.float64)
    assert np.all(np.abs(r.gemm(a, b, "fprop") - da @ db)
                  <= r.accumulation_bound(np.abs(da), np.abs(db)))


def test_delayed_first_use_scales_by_its_own_amax_then_by_the_history():
    r = R.make_recipe("delayed", history_len=3)
    site = r.new_site()
    h = site.history("fprop", "a")
    q = r.quantize(np.array([[2.0, -1.0]], np.float32), "activation", -1, h)
    assert q.scales[0, 0] == 128.0                   # 448 / 2 -> 2^7: its own amax
    q = r.quantize(np.array([[50.0, 0.5]], np.float32), "activation", -1, h)
    assert q.scales[0, 0] == 128.0 and h.saturated == 1 == site.saturated    # 50*128 > 448
    assert R.dequantize(q)[0, 0] == 448.0 / 128
    e = R.quantization_error(np.array([[1000.0]], np.float32), r, "activation", -1, h)
    assert e.n_saturated == 1 and e.within_bound and e.saturation_bound == math.inf
    assert h.saturated == 2 == site.saturated and h.history == [2.0, 50.0, 1000.0]
    q = r.quantize(np.array([[1.0, np.nan]], np.float32), "activation", -1, h)
    assert q.scales[0, 0] == 0.25 and h.history == [2.0, 50.0, 1000.0]  # NaN: not recorded
    r.quantize(np.array([[1.0]], np.float32), "activation", -1, h)
    assert h.history == [50.0, 1000.0, 1.0]          # the window keeps the last 3
    recent = R.make_recipe("delayed", algo="most_recent")
    h = recent.new_site().history("wgrad", "b")
    for amax, want in ((2.0, 2.0 ** 14), (0.25, 2.0 ** 14), (1.0, 2.0 ** 17)):
        q = recent.quantize(np.array([[amax]], np.float32), "gradient", 0, h)
        assert q.scales[0, 0] == want and q.fmt is fp8.E5M2      # 57344/0.25 -> 2^17
    q = R.make_recipe("delayed", margin=1).quantize(
        np.array([[2.0]], np.float32), "activation", -1, fp8.DelayedScaling(fp8.E4M3, 4, 1))
    assert q.scales[0, 0] == 64.0


def test_delayed_site_keeps_one_history_per_operand_and_they_agree():
    r = R.make_recipe("delayed")
    site = r.new_site()
    x, w, dy = _spread((8, 16), 50, 1.0), _spread((16, 4), 51, 1.0), _spread((8, 4), 52, 1.0)
    for _ in range(2):
        r.gemm(x, w, "fprop", site)
        r.gemm(dy, w.T, "dgrad", site)
        r.gemm(x.T, dy, "wgrad", site)
    assert len(site.histories) == 6
    assert site.history("fprop", "b").history == site.history("dgrad", "b").history   # w
    assert site.history("dgrad", "a").history == site.history("wgrad", "b").history   # dy
    assert site.history("dgrad", "a").fmt is fp8.E5M2
    with pytest.raises(ValueError, match="new_site"):
        r.gemm(x, w, "fprop", None)
    with pytest.raises(ValueError, match="history"):
        r.quantize(x, "gradient", -1, site.history("fprop", "a"))   # E4M3 history for E5M2


def test_bad_names_options_and_shapes_are_refused():
    with pytest.raises(ValueError, match="one of"):
        R.make_recipe("fp4")
    with pytest.raises(ValueError, match="unknown option"):
        R.make_recipe("rowwise", block=32)
    for name, options, match in (("delayed", {"algo": "mean"}, "algo"),
                                 ("delayed", {"history_len": 0}, "history_len"),
                                 ("blockwise", {"interval": 100}, "divide"),
                                 ("blockwise", {"accum_bits": 24}, "accum_bits"),
                                 ("mxfp8", {"scale_rounding": "up"}, "scale_rounding"),
                                 ("mxfp8", {"block": 0}, "block"),
                                 ("tensorwise", {"pow2_scales": "yes"}, "pow2_scales")):
        with pytest.raises(ValueError, match=match):
            R.make_recipe(name, **options)
    r = R.make_recipe("rowwise")
    with pytest.raises(ValueError, match="kind"):
        r.gemm(np.ones((2, 3)), np.ones((3, 4)), "bprop")
    with pytest.raises(ValueError, match=r"\(K, N\)"):
        r.gemm(np.ones((2, 3)), np.ones((4, 4)), "fprop")
    with pytest.raises(ValueError, match="axis"):
        r.quantize(np.ones((2, 3)), "activation", 2)
    with pytest.raises(ValueError, match="role"):
        r.quantize(np.ones((2, 3)), "bias", -1)


SWEEP = [("delayed", {}), ("delayed", {"algo": "most_recent", "margin": 1, "history_len": 2}),
         ("delayed", {"fp8_format": "e4m3"}), ("tensorwise", {}),
         ("tensorwise", {"pow2_scales": True}), ("rowwise", {}),
         ("rowwise", {"pow2_scales": False}),
         ("blockwise", {}), ("blockwise", {"accum_bits": 23, "interval": 64}),
         ("blockwise", {"pow2_scales": True, "tile_len": 64, "interval": 16}), ("mxfp8", {}),
         ("mxfp8", {"scale_rounding": "ceil", "grad_format": "e5m2", "block": 16})]


@pytest.mark.slow
@pytest.mark.parametrize("name,options", SWEEP, ids=[f"{n}-{len(o)}" for n, o in SWEEP])
def test_sweep_shapes_kinds_steps_and_options(name, options):
    r = R.make_recipe(name, **options)
    shapes = [(1, 1, 1), (3, 31, 5), (7, 33, 9), (16, 127, 130), (9, 129, 257), (33, 300, 17),
              (64, 1024, 64), (8, 4096, 32)]
    for seed, (m, k, n) in enumerate(shapes):
        site, twin = r.new_site(), r.new_site()
        for step, kind in ((s, kind) for s in range(3) for kind in R.KINDS):
            a = _spread((2, m, k) if kind != "wgrad" else (m, k), 100 * seed + step, 4.0)
            b = _spread((k, n), 200 * seed + step, 4.0)
            y = r.gemm(a, b, kind, site)
            assert y.shape == a.shape[:-1] + (n,) and y.dtype == np.float32
            if name == "blockwise":
                role_a, role_b = ROLES_OF[kind]
                da = R.dequantize(r.quantize(a, role_a, -1)).astype(np.float64)
                db = R.dequantize(r.quantize(b, role_b, 0)).astype(np.float64)
                da = da.reshape(-1, k)
                assert np.all(np.abs(y.reshape(-1, n) - da @ db)
                              <= r.accumulation_bound(np.abs(da), np.abs(db)))
            else:
                assert np.array_equal(y, _deq_product(r, a, b, kind, twin))
            for role, x, axis in ((ROLES_OF[kind][0], a, -1), (ROLES_OF[kind][1], b, 0)):
                e = R.quantization_error(x, r, role, axis, _state(r, role))
                assert e.within_bound, (m, k, n, kind, e)
                assert e.n_saturated == 0 or (name == "mxfp8" and not options)
