"""What every rank process sets up: one BLAS thread, a malloc that keeps memory, a core.

One BLAS thread. With W ranks on a machine of C cores, a BLAS that starts C threads in every
rank runs W*C threads on C cores, and they fight. Each rank therefore pins its
BLAS to one thread. Environment variables only work before the BLAS library
is loaded; in a forked rank NumPy is already loaded, so we also call the
library's own setter, found among the shared objects mapped into this process.

An allocator that keeps memory. glibc serves large allocations (above ~128 KiB)
with fresh mmap'd pages and returns them to the kernel on free, so a NumPy
temporary of a few MB costs a page fault per 4 KiB every time it is made
(about 0.25 ms per MB here: more than the arithmetic on it). Raising glibc's
mmap and trim thresholds keeps freed blocks in the heap for reuse. Training
loops and collectives allocate the same sizes again and again, so this is
where their time goes otherwise.

A core of its own. When there are at least as many usable cores as ranks, rank r runs
on the r-th of them (bind_to_core): waiting ranks poll, and two pollers on one core
only take turns.

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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3              # glibc mallopt parameters


def keep_freed_memory(mmap_threshold: int = 1 << 28, trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc to serve allocations below `mmap_threshold` from the heap and to keep up
    to `trim_threshold` freed bytes; False where there is no glibc mallopt."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
                    and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


def setup_rank_process(rank: int | None = None, world_size: int | None = None) -> None:
    """Everything a rank (or the CLI process) sets before it computes; a rank of a job
    (rank and world_size given) is also bound to a core of its own (bind_to_core)."""
    pin_blas_threads(1)
    keep_freed_memory()
    if rank is not None and world_size is not None:
        bind_to_core(rank, world_size)


def bind_to_core(rank: int, world_size: int) -> bool:
    """Run rank r on the r-th CPU this process may use, when every rank can have one
    (as `mpiexec --bind-to core` does); True if bound. Ranks poll shared memory while
    they wait (runtime/wait.py): two ranks the kernel happens to put on one core take
    turns instead, and a small all_reduce measured 42 us there against 6 us on two
    cores. MINIDIST_BIND=0 leaves placement to the kernel."""
    if os.environ.get("MINIDIST_BIND", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        return False
    cpus = sorted(os.sched_getaffinity(0))
    if world_size > len(cpus):
        return False                   # more ranks than cores: they must share anyway
    os.sched_setaffinity(0, {cpus[rank]})
    return True


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
