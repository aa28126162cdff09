"""The machine's peak: the matmul FLOP/s one rank can reach, measured, per dtype, cached.

MFU divides by a peak. A GPU's comes from its data sheet; a CPU core running NumPy has
no such number (it depends on the core, its vector units, the BLAS library and the
clock), so this module measures it: the best a rank can do is what the BLAS does on one
large square matmul, on one thread, as each rank runs (runtime/process_setup.py pins
BLAS to one thread in every rank and in `python -m minidist`). A plain script must set
OMP_NUM_THREADS=1 (and OPENBLAS_NUM_THREADS=1) before it imports NumPy.

One rank's view:
    1. look up the key "CPU model | numpy version | dtype | n" in the cache file;
    2. if it is missing (or refresh=True): make a, b (n, n) of the dtype, run c = a @ b
       once to warm up, then `repeats` times, timing each; FLOP/s = 2 n^3 / median time;
    3. store it in the cache (written atomically: a temporary file, then os.replace).
The cache is a small JSON file, {key: {"flops": ..., "n": ..., "repeats": ..., "median_s":
...}}, at $MINIDIST_PEAK_CACHE, else $XDG_CACHE_HOME/minidist/peak.json, else
~/.cache/minidist/peak.json. A new CPU, NumPy or size is a new key; refresh=True measures
again. No communication: ranks on one machine share the file.

Reference: Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4) (the peak as the
    roof a kernel's FLOP/s is measured against); Chowdhery et al. 2022, arXiv:2204.02311,
    App. B (MFU divides by the peak).
Read next: observe/throughput.py.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class Peak:
    """Measured matmul FLOP/s of one thread for one dtype, and where it came from."""

    dtype: str
    flops: float            # FLOP/s
    n: int                  # the matrices were (n, n)
    repeats: int
    median_s: float         # median seconds of one matmul
    key: str
    cached: bool            # True: read from the cache file; False: measured now
    path: str               # the cache file


def cache_path() -> Path:
    """$MINIDIST_PEAK_CACHE, else $XDG_CACHE_HOME/minidist/peak.json, else ~/.cache/..."""
    if os.environ.get("MINIDIST_PEAK_CACHE"):
        return Path(os.environ["MINIDIST_PEAK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minidist" / "peak.json"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_key(dtype: str, n: int) -> str:
    """The cache key: CPU model, NumPy version, dtype and matrix size."""
    return f"{cpu_model()} | numpy {np.__version__} | {dtype} | n={n}"


def measure_matmul(dtype: str, n: int = 1024, repeats: int = 7) -> tuple[float, float]:
    """(FLOP/s, median seconds) of an (n, n) @ (n, n) matmul in `dtype`: 2 n^3 FLOPs over
    the median of `repeats` timed runs, after one untimed warm-up run."""
    _check(dtype, n, repeats)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    c = np.empty((n, n), dtype=dtype)
    np.matmul(a, b, out=c)                                   # warm-up: pages, caches, clock
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return 2.0 * n ** 3 / median, median


def peak_flops(dtype: str = "float64", *, n: int = 1024, repeats: int = 7,
               refresh: bool = False, path: str | os.PathLike | None = None) -> Peak:
    """The cached peak of this machine for `dtype`, measured now if not cached (or
    refresh=True). path: the cache file (default: cache_path())."""
    _check(dtype, n, repeats)
    file = Path(path) if path is not None else cache_path()
    key = machine_key(dtype, n)
    table = _read(file)
    entry = table.get(key)
    if entry is not None and not refresh:
        return Peak(dtype, float(entry["flops"]), n, int(entry["repeats"]),
                    float(entry["median_s"]), key, True, str(file))
    flops, median = measure_matmul(dtype, n, repeats)
    table[key] = {"flops": flops, "n": n, "repeats": repeats, "median_s": median,
                  "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    _write(file, table)
    return Peak(dtype, flops, n, repeats, median, key, False, str(file))


def _check(dtype: str, n: int, repeats: int) -> None:
    if dtype not in DTYPES or n < 1 or repeats < 1:
        raise ValueError(f"peak: dtype={dtype!r} must be one of {DTYPES}, n={n} and "
                         f"repeats={repeats} >= 1 (e.g. n=1024, repeats=7).")


def _read(file: Path) -> dict:
    """The cache's table; {} if the file is missing or is not a JSON object (a damaged
    file is then replaced on the next write)."""
    try:
        with open(file) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write(file: Path, table: dict) -> None:
    """Write the table atomically: readers see the old file or the new, never half."""
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".peak-", suffix=".json", dir=file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except BaseException:
        os.unlink(tmp)
        raise
