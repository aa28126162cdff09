"""The fp8 recipes under Autocast: a linear layer's three GEMMs are the recipe's fprop, dgrad
and wgrad (rounded to bf16 as every GEMM output is); two activations (attention's q k^T)
are quantised along their own reduction axes; a recipe other than fp8's is refused."""

import ml_dtypes
import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.memory import fp8_recipes as R
from minidist.memory.precision import Autocast, Policy
from minidist.parallel.compose import Plan

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16(x):
    return np.asarray(x).astype(BF16).astype(np.float32)


@pytest.mark.parametrize("name", [r for r in R.RECIPES if r != "delayed"])
def test_a_linear_layers_gemms_are_the_recipes_fprop_dgrad_and_wgrad(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    g = rng.standard_normal((2, 5, 48)).astype(np.float32)
    recipe = R.make_recipe(name)
    with Autocast(Policy("fp8", fp8_recipe=name)):
        xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        y = xt @ wt
        y.backward(g)
    assert np.array_equal(y.data.astype(np.float32), _bf16(recipe.gemm(x, w, "fprop")))
    assert np.array_equal(xt.grad, _bf16(recipe.gemm(g, w.T.copy(), "dgrad")))
    assert np.array_equal(wt.grad, _bf16(recipe.gemm(x.reshape(-1, 64).T.copy(),
                                                     g.reshape(-1, 48), "wgrad")))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_two_activations_are_quantised_along_their_reduction_axes(name):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 7, 16)).astype(np.float32)       # (B, h, T, D)
    k = rng.standard_normal((2, 3, 16, 7)).astype(np.float32)       # k^T: (B, h, D, T)
    with Autocast(Policy("fp8", fp8_recipe=name)):
        qt, kt = Tensor(q, requires_grad=True), Tensor(k, requires_grad=True)
        s = qt @ kt
        s.backward(np.ones_like(q @ k))
    exact = q @ k
    err = np.abs(s.data.astype(np.float32) - exact)
    # each operand within 2^-4 (E4M3) of itself: the product within ~2 * 2^-4 of |q| @ |k|
    assert np.all(err <= 0.15 * (np.abs(q) @ np.abs(k)) + 1e-6)
    assert np.isfinite(qt.grad).all() and np.isfinite(kt.grad).all()


def test_a_recipe_needs_fp8():
    with pytest.raises(ValueError, match="precision='bf16' has none"):
        Plan(precision="bf16", fp8_recipe="rowwise")
    with pytest.raises(ValueError, match="fp8_recipe='fast' must be one of"):
        Policy("fp8", fp8_recipe="fast")
