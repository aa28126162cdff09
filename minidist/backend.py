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

Devices: `use_device("gpu")` (the CLI's `--device gpu`, or MINIDIST_DEVICE=gpu) is
use("cupy") after checking that CuPy is installed (the `gpu` extra, CuPy for CUDA
13) and sees a CUDA device; otherwise it says why in one line. The GPT, autograd,
optimizers and baseline.py then run on the GPU unchanged; data and results cross
to the host through to_numpy. A multi-rank run would put each rank's arrays on
the GPU too, but its collectives work on host shared memory, so every message
would be staged through host memory (to_numpy before the send, xp.asarray after
the receive); that staging is not wired in yet, and `train --device gpu` with
more than one rank stops with a one-line error. `python -m minidist gpu check`
(gpu/check.py) compares GPU steps with CPU steps.

Read next: autograd/tensor.py
"""

from __future__ import annotations

import math
import os
from types import ModuleType
from typing import Any, Mapping

import numpy

xp: ModuleType = numpy
_default_dtype = numpy.dtype("float64")
_FLOAT_DTYPES = ("float32", "float64")
DEVICES = ("cpu", "gpu")
DEVICE_ENV = "MINIDIST_DEVICE"
MULTI_RANK_GPU = ("--device gpu runs only the plain single-process job (no parallel, --zero, "
                  "--check, run-directory, memory or precision options): the ranks' "
                  "collectives work on host shared memory and do not yet stage GPU arrays "
                  "through it. Use --device cpu for this job.")


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


def parse_device(text: str) -> str:
    """"cpu" or "gpu" from `text` (case and spaces ignored, empty = "cpu"); ValueError else."""
    name = str(text).strip().lower() or "cpu"
    if name not in DEVICES:
        raise ValueError(f"device {text!r} is unknown; use 'cpu' or 'gpu' (--device, or the "
                         f"environment variable {DEVICE_ENV}).")
    return name


def device_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The device $MINIDIST_DEVICE names ("cpu" when it is unset or empty)."""
    return parse_device((os.environ if environ is None else environ).get(DEVICE_ENV, ""))


def gpu_problem() -> str | None:
    """Why the GPU path cannot run here, in a few words; None when CuPy sees a CUDA device."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                    # no driver, no device: CUDARuntimeError
        why = " ".join(str(e).split())[:120]
        return (f"CuPy {getattr(cupy, '__version__', '?')} finds no usable CUDA device "
                f"({type(e).__name__}: {why})")
    return None if count > 0 else "CuPy sees 0 CUDA devices"


def use_device(name: str) -> ModuleType:
    """use("numpy") for "cpu"; use("cupy") for "gpu" once CuPy sees a CUDA device, else a
    one-line ValueError saying why (`xp` is then left as it was)."""
    name = parse_device(name)
    if name == "cpu":
        return use("numpy")
    problem = gpu_problem()
    if problem is not None:
        raise ValueError(f"device 'gpu': {problem}; the GPU path needs the 'gpu' extra "
                         "(pip install -e '.[gpu]': CuPy for CUDA 13) and an NVIDIA GPU with "
                         "its driver. Use --device cpu here.")
    return use("cupy")


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
