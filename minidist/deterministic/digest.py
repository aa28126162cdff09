"""The digest a run prints, `params sha256:`: two runs that print the same one hold bitwise
the same parameters (the deterministic mode's promise across layouts, checked by eye).
Read next: deterministic/__init__.py.
"""

from __future__ import annotations

import hashlib

import numpy as np


def params_digest(params: dict[str, np.ndarray]) -> str:
    """sha256 over the parameters in the given (model) order: each name, dtype, shape and
    bytes. Two runs with the same digest hold bitwise the same parameters."""
    h = hashlib.sha256()
    for name, value in params.items():
        value = np.ascontiguousarray(value)
        h.update(f"{name} {value.dtype.str} {value.shape}\n".encode())
        h.update(value.tobytes())
    return h.hexdigest()
