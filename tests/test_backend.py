"""backend: the swappable array module, the default float dtype, erf and to_numpy."""

import math

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd import functional as F


def test_numpy_is_the_default_and_use_swaps_it():
    assert backend.xp is np
    assert backend.use("numpy") is np and backend.xp is np
    with pytest.raises(ValueError, match="unknown array module"):
        backend.use("jax")


def test_use_cupy_without_cupy_is_a_clear_error():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="CuPy is not installed"):
            backend.use("cupy")
        assert backend.xp is np                      # a failed swap changes nothing
    else:
        pytest.skip("CuPy is installed; the swap itself is tested under the gpu marker")


def test_ops_look_up_xp_at_call_time(monkeypatch):
    calls = []

    class CountingNumpy:
        """numpy, but counting calls to exp: proves autograd reads backend.xp per call."""
        def __getattr__(self, name):
            return getattr(np, name)

        def exp(self, a, *args, **kwargs):
            calls.append(a.shape)
            return np.exp(a, *args, **kwargs)

    monkeypatch.setattr(backend, "xp", CountingNumpy())
    F.softmax(Tensor(np.zeros((2, 3))))
    assert calls == [(2, 3)]


def test_default_dtype_setting():
    assert backend.default_dtype() == np.float64
    try:
        backend.set_default_dtype("float32")
        assert backend.default_dtype() == np.float32 and Tensor(1.0).dtype == np.float32
        with pytest.raises(ValueError, match="float16"):
            backend.set_default_dtype("float16")
        assert backend.default_dtype() == np.float32
    finally:
        backend.set_default_dtype("float64")
    assert Tensor([1.0, 2.0]).dtype == np.float64


def test_erf_matches_math_erf_and_keeps_dtype():
    x = np.linspace(-6, 6, 49)
    expected = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(backend.erf(x) - expected)) <= 1e-15
    assert backend.erf(x.astype(np.float32)).dtype == np.float32


def test_to_numpy():
    a = np.arange(3.0)
    assert backend.to_numpy(a) is a
    assert np.array_equal(backend.to_numpy([1, 2]), [1, 2])
