"""backend: the swappable array module, the default float dtype, erf and to_numpy."""

import math

import numpy as np
import pytest

from minidist import backend, train_cli
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


# --- the device: --device / MINIDIST_DEVICE, and the one-line error without a GPU ---------

def test_device_names_and_the_environment_variable():
    assert backend.device_from_env({}) == "cpu"
    assert backend.device_from_env({"MINIDIST_DEVICE": ""}) == "cpu"
    assert backend.device_from_env({"MINIDIST_DEVICE": " GPU "}) == "gpu"
    assert backend.device_from_env({"MINIDIST_DEVICE": "cpu"}) == "cpu"
    with pytest.raises(ValueError, match="device 'tpu' is unknown; use 'cpu' or 'gpu'"):
        backend.device_from_env({"MINIDIST_DEVICE": "tpu"})
    assert backend.use_device("cpu") is np and backend.xp is np


def _without_a_gpu(monkeypatch, kind: str) -> None:
    """Make `import cupy` fail ("missing"), or give a CuPy whose runtime finds no device."""
    import sys
    import types
    if kind == "missing":
        monkeypatch.setitem(sys.modules, "cupy", None)        # import raises ImportError
        return

    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    fake = types.SimpleNamespace(__version__="14.2.0", cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=no_device)))
    monkeypatch.setitem(sys.modules, "cupy", fake)


@pytest.mark.parametrize("kind, says", [
    ("missing", "CuPy is not installed"),
    ("no device", "CuPy 14.2.0 finds no usable CUDA device (RuntimeError: cudaErrorNoDevice")])
def test_use_device_gpu_without_one_says_why_in_one_line(monkeypatch, kind, says):
    _without_a_gpu(monkeypatch, kind)
    with pytest.raises(ValueError) as e:
        backend.use_device("gpu")
    message = str(e.value)
    assert message.startswith(f"device 'gpu': {says}") and "\n" not in message, message
    assert message.endswith("Use --device cpu here.")
    assert backend.xp is np                                   # nothing was swapped


@pytest.mark.parametrize("argv, env, says", [
    (["--device", "gpu"], None, "error: device 'gpu': CuPy is not installed"),
    ([], "gpu", "error: device 'gpu': CuPy is not installed"),
    (["--device", "gpu", "--dp", "2"], None, "error: --device gpu runs only the plain "
                                             "single-process job"),
    ([], "tpu", "error: argument --device: device 'tpu' is unknown")])
def test_train_device_errors_are_one_line_with_exit_code_2(monkeypatch, capsys, argv, env,
                                                           says):
    from minidist import train
    _without_a_gpu(monkeypatch, "missing")
    if env is None:
        monkeypatch.delenv("MINIDIST_DEVICE", raising=False)
    else:
        monkeypatch.setenv("MINIDIST_DEVICE", env)
    try:
        code = train_cli.main(["--steps", "1", *argv])
    except SystemExit as e:                                    # argparse's usage error
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), captured.err
    assert backend.xp is np
