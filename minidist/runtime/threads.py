"""One BLAS thread per rank.

With W ranks on a machine of C cores, a BLAS that starts C threads in every
rank runs W*C threads on C cores, and they fight. Each rank therefore pins its
BLAS to one thread. Environment variables only work before the BLAS library
is loaded; in a forked rank NumPy is already loaded, so we also call the
library's own setter, found among the shared objects mapped into this process.

Read next: runtime/launch.py
"""

from __future__ import annotations

import ctypes
import os

_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads", "MKL_Set_Num_Threads")


def _blas_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so")
                     or ".so." in line}
    except OSError:
        return []
    return sorted(p for p in paths if "blas" in p.lower() or "mkl" in p.lower())


def pin_blas_threads(n: int = 1) -> int:
    """Limit BLAS to `n` threads in this process (and its children); returns how
    many loaded libraries were set (0 when no known BLAS is loaded)."""
    for var in _ENV:
        os.environ[var] = str(n)
    count = 0
    for path in _blas_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                count += 1
                break
    return count
