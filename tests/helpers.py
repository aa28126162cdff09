"""Helpers shared by the tests: comparisons that name what differs, and leak probes."""

from __future__ import annotations

import os

import numpy as np


def assert_close(actual, expected, *, atol: float = 0.0, rtol: float = 0.0, what: str = ""):
    """np.allclose with a message that names the worst element."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    err = np.abs(a.astype(np.float64) - e.astype(np.float64))
    bound = atol + rtol * np.abs(e.astype(np.float64))
    if not np.all(err <= bound):
        i = np.unravel_index(int(np.argmax(err - bound)), a.shape) if a.ndim else ()
        raise AssertionError(f"{what}: max |Δ| = {err.max():.3e} at {i} "
                             f"(got {a[i]!r}, expected {e[i]!r}; atol={atol}, rtol={rtol})")


def child_pids(pid: int | None = None) -> list[int]:
    """PIDs whose parent is `pid` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def mpiexec_or_skip() -> str:
    """Path of mpiexec (next to this Python first); skips the calling module without
    mpi4py or mpiexec. Call at module level in tests marked `mpi`."""
    import shutil
    import sys

    import pytest
    exe = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
           or shutil.which("mpiexec"))
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        exe = None
    if exe is None:
        pytest.skip("needs mpi4py and mpiexec (pip install -e '.[mpi]')", allow_module_level=True)
    return exe
