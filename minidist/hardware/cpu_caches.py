"""CPU caches: this machine's memory hierarchy, read off NumPy timings over growing working sets.

A cache is invisible to the program and visible to the clock. Read the same S bytes over
and over: while S fits in L1 every load hits L1, and as S grows past L1, L2 and L3 the
loads are served by ever slower levels, so the time per byte steps up. Plotted against S
the curve is a staircase, one plateau per level, with the steps at the cache sizes the
kernel reports under /sys/devices/system/cpu/cpu0/cache. It is the CPU twin of the GPU's
bandwidth sweep and pointer chase (gpu/kernels/bandwidth.cu, pointer_chase.cu): the same
idea on the L1/shared, L2 and HBM of a GPU.

Two probes, both in NumPy, so each call moves megabytes and Python's overhead vanishes:
    read    sequential bandwidth (GB/s): np.maximum.reduce over a (reps, n) view of an n-
            element array whose rows all alias it (stride 0): one call re-reads the same
            S bytes `reps` times, streaming, with the hardware prefetchers at full speed
    gather  random access (ns per access): np.take(x, idx) with idx uniform in [0, n): every
            load lands on a random line of the set. The loads are independent, so the core
            keeps several misses in flight: this is latency divided by memory-level
            parallelism, not the raw latency a pointer chase (one load at a time) shows;
            the steps are still at the cache sizes
NumPy's loop costs a little per element whatever the level, so the read plateaus of L1
and L2 often merge; the big steps (L2 -> L3 -> DRAM) always show.

One run's view (`sweep`):
    1. for each working set S = 16 KB, 32 KB, ... up to max_bytes (doubling):
       a. read:   best of `repeats` timings of one reduce over ~`traffic` bytes -> GB/s
       b. gather: best of `repeats` timings of np.take of `accesses` elements -> ns/access
    2. `level_of` files each S under the first cache level it fits in (L1d, L2, L3, DRAM) and
       `plateaus` reports the median of each probe per level.
Shapes: x (S/8,) float64; idx (accesses,) int64. Timings use time.perf_counter; the numbers
are measurements of this machine under its current load, never checked against a bound.

References: Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4) (bandwidth roofs
    per level); Saavedra & Smith 1995, "Measuring cache and TLB performance", IEEE Trans.
    Computers 44(10) (the working-set sweep); McCalpin 1995, STREAM (sequential bandwidth).
Read next: gpu/kernels/bandwidth.cu and gpu/kernels/pointer_chase.cu (the GPU's sweeps),
    demos/28_memory_hierarchy.py.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided

from minidist.cli import CliParser, at_least

SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
KB, MB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Point:
    """One working set: its size, its sequential read GB/s, its ns per random access."""
    size: int
    read_gbs: float
    gather_ns: float


def cache_sizes(root: Path = SYSFS) -> dict[str, int]:
    """{"L1d": bytes, "L2": bytes, "L3": bytes} for cpu0's data/unified caches, from sysfs;
    {} where sysfs has no cache directory (not Linux, or a container hiding it)."""
    sizes = {}
    for index in sorted(root.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        if kind == "Instruction" or not text:
            continue
        scale = {"K": KB, "M": MB, "G": 1 << 30}.get(text[-1], 1)
        value = int(text.rstrip("KMG")) * scale
        sizes[f"L{level}d" if kind == "Data" else f"L{level}"] = value
    return sizes


def working_sets(max_bytes: int, min_bytes: int = 16 * KB) -> list[int]:
    """min_bytes, 2 min_bytes, 4 min_bytes, ... <= max_bytes (at least [min_bytes])."""
    if min_bytes < 64 or max_bytes < min_bytes:
        raise ValueError(f"working sets from {min_bytes} to {max_bytes} bytes: need 64 <= "
                         f"min_bytes <= max_bytes; pass a larger max_bytes")
    sizes = [min_bytes]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return sizes


def _best(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn(), after one warm-up call (seconds)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(size: int, *, traffic: int = 32 * MB, accesses: int = 1 << 18, repeats: int = 3,
            seed: int = 0) -> Point:
    """Sequential read GB/s and random-gather ns/access over a working set of `size` bytes."""
    n = max(size // 8, 8)
    x = np.arange(n, dtype=np.float64)                      # (n,), S bytes
    reps = max(1, traffic // (8 * n))
    rows = as_strided(x, shape=(reps, n), strides=(0, 8), writeable=False)  # (reps, n): all x
    out = np.empty(reps)
    read_s = _best(lambda: np.maximum.reduce(rows, axis=1, out=out), repeats)
    idx = np.random.default_rng(seed).integers(0, n, size=accesses)        # (accesses,)
    got = np.empty(accesses)
    gather_s = _best(lambda: np.take(x, idx, out=got), repeats)
    return Point(size, reps * n * 8 / read_s / 1e9, gather_s / accesses * 1e9)


def sweep(max_bytes: int = 128 * MB, **options) -> list[Point]:
    """measure() at every working set from 16 KB to max_bytes, doubling."""
    return [measure(size, **options) for size in working_sets(max_bytes)]


def level_of(sizes: dict[str, int], size: int) -> str:
    """The first cache level a working set of `size` bytes fits in, or "DRAM"."""
    for name, capacity in sorted(sizes.items(), key=lambda item: item[1]):
        if size <= capacity:
            return name
    return "DRAM"


def plateaus(points: list[Point], sizes: dict[str, int]) -> list[tuple[str, int, float, float]]:
    """[(level, points in it, median read GB/s, median gather ns)] in hierarchy order."""
    groups: dict[str, list[Point]] = {}
    for p in points:
        groups.setdefault(level_of(sizes, p.size), []).append(p)
    return [(name, len(ps), statistics.median(p.read_gbs for p in ps),
             statistics.median(p.gather_ns for p in ps)) for name, ps in groups.items()]


def human(size: int) -> str:
    """16384 -> '16 KB', 1048576 -> '1 MB'."""
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def report(points: list[Point], sizes: dict[str, int]) -> list[str]:
    """The sweep as printable lines: one per working set, then one per plateau."""
    caches = ", ".join(f"{k} {human(v)}" for k, v in sizes.items()) or "unknown (no sysfs)"
    lines = [f"caches (sysfs, cpu0): {caches}",
             f"{'working set':>12} {'level':>6} {'read GB/s':>10} {'gather ns':>10}"]
    lines += [f"{human(p.size):>12} {level_of(sizes, p.size):>6} {p.read_gbs:>10.1f} "
              f"{p.gather_ns:>10.2f}" for p in points]
    lines.append("plateaus (median per level):")
    lines += [f"  {name:<5} {n:>2} sets  {gbs:6.1f} GB/s read  {ns:6.2f} ns per random access"
              for name, n, gbs, ns in plateaus(points, sizes)]
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist.hardware.cpu_caches`: print this machine's cache plateaus."""
    ap = CliParser(prog="python -m minidist.hardware.cpu_caches",
                   description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=at_least(1), default=128,
                    help="largest working set in MB (default 128: past most L3s)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="timings per point (best)")
    ap.add_argument("--traffic-mb", type=at_least(1), default=32,
                    help="bytes read per timing of the read probe")
    a = ap.parse_args(argv)
    points = sweep(a.max_mb * MB, repeats=a.repeats, traffic=a.traffic_mb * MB)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"cpu caches · one NumPy thread (OMP_NUM_THREADS={threads}) · best of {a.repeats}")
    print("\n".join(report(points, cache_sizes())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
