"""The array module: NumPy by default, CuPy on the GPU path, swappable at run time.

Everything that does math on arrays (autograd, nn, optim) reaches the array
library through this module and looks the attribute up at call time:

    from minidist import backend
    y = backend.xp.exp(x)          # never `import numpy as np` for math

so that `backend.use("cupy")` moves every later operation to the GPU without
touching the modules that do the math. Communication code keeps NumPy: shared
memory is host memory.

The second setting is the default float dtype. It only decides the dtype of a
Tensor built from Python numbers or lists of them; an array keeps the dtype it
has. float64 is the default because the tests compare parallel runs with the
single-process run at tolerances near 1e-12.

Read next: autograd/tensor.py
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy

xp: ModuleType = numpy
_default_dtype = numpy.dtype("float64")
_FLOAT_DTYPES = ("float32", "float64")


def use(name: str) -> ModuleType:
    """Make `xp` the module called `name` ("numpy" or "cupy") and return it."""
    global xp
    if name == "numpy":
        xp = numpy
    elif name == "cupy":
        try:
            import cupy
        except ImportError as e:
            raise ValueError(
                "backend.use('cupy'): CuPy is not installed, so the GPU path is unavailable. "
                "Install the 'gpu' extra (pip install -e '.[gpu]') or stay on 'numpy'."
            ) from e
        xp = cupy
    else:
        raise ValueError(f"backend.use({name!r}): unknown array module; use 'numpy' or 'cupy'.")
    return xp


def to_numpy(a: Any) -> numpy.ndarray:
    """Return `a` as a NumPy array (copied from the device when `a` is a CuPy array)."""
    if isinstance(a, numpy.ndarray):
        return a
    get = getattr(a, "get", None)          # cupy.ndarray.get() copies device -> host
    return get() if callable(get) else numpy.asarray(a)


def default_dtype() -> numpy.dtype:
    """The float dtype of Tensors made from Python numbers (float64 unless changed)."""
    return _default_dtype


def set_default_dtype(name: str) -> None:
    """Set the float dtype of Tensors made from Python numbers: "float32" or "float64"."""
    global _default_dtype
    if str(name) not in _FLOAT_DTYPES:
        raise ValueError(
            f"set_default_dtype({name!r}): only {_FLOAT_DTYPES} are supported; float16 and "
            "bfloat16 are handled by memory/precision.py, not as a global default."
        )
    _default_dtype = numpy.dtype(str(name))


def erf(a: Any) -> Any:
    """Elementwise error function erf(a) = 2/sqrt(pi) * integral_0^a exp(-t^2) dt.

    NumPy has no erf. SciPy's (or CuPy's) is used when installed; otherwise
    math.erf is applied element by element: exact to the last bit, but about
    50 ns per element, which is fine for the tests and the exact-GELU option
    (GPT uses the tanh form, which needs no erf).
    """
    if xp is not numpy:
        from cupyx.scipy.special import erf as device_erf
        return device_erf(a)
    try:
        from scipy.special import erf as scipy_erf
    except ImportError:
        out = numpy.frompyfunc(math.erf, 1, 1)(a)
        return numpy.asarray(out, dtype=numpy.result_type(a, numpy.float32))
    return scipy_erf(a)
