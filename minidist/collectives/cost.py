"""The alpha-beta(-gamma) cost model: predicted time of each collective algorithm.

Sending one message of m bytes costs alpha + m beta: alpha is the fixed latency of a
message (on shared memory: the handshake through a mailbox counter), beta the time per
byte (copy in, copy out). Reducing m bytes costs m gamma. An algorithm's time is the sum
over its sequential steps, so each algorithm is a formula in W (ranks) and n (bytes).
The formulas let `choose` pick an algorithm per call (algo="auto") and let the bench
compare prediction and measurement.

On a network alpha dwarfs the rest; between Python processes on one machine it does
not (alpha, beta, gamma alone underestimate small calls ~4x), so the model also has:
    setup    each algorithm's own Python per call (api.py, the call header, its set-up
             such as np.array_split), timed alone at W = 1: 4 to 23 us here, too
             different for one constant (`call` stands in for an unmeasured one).
    barrier  per group barrier: direct.py meets at barriers, not messages.
    copy     per byte a rank copies itself: the working copy of x most algorithms start
             with, direct.py's copies into and out of its region, and in an exchange
             (sendrecv) the bytes it copies out of the slot while its partner does the
             same (a one-way chain overlaps them with the sender's next copy-in).
    dram     per byte moved beyond the first `cache` bytes (data out of cache: ~2x).
    cores    with more ranks than cores (W = 4 on 2 cores) the u ranks that work at once
             share the cores: set-up and bytes take g = max(1, u / cores) times longer.
             Waiting ranks must give up the CPU (runtime/wait.py yields, then sleeps),
             so alpha and barrier become scheduler round trips, several times their
             W = 2 value: hence one set of constants per world size.
On its critical path an algorithm sends m messages, meets z barriers, sends s bytes,
reduces r bytes and copies c bytes, while u ranks work at once; its time is
    t = m alpha + z barrier + g (setup + s beta + r gamma + c copy + max(0, s+r+c-cache) dram)

Conventions: p = W, n = x.nbytes of the array ONE rank passes in (scatter: the bytes one
rank receives; all_to_all: the bytes one rank sends in total), q = (p-1)/p, L =
ceil(log2 p), l = log2 p' with p' = 2^floor(log2 p), h = (p'-1)/p', f = 1 if p is not a
power of two (the fold/unfold of halving_doubling.py), k = ceil(n / ring.SEGMENT_BYTES)
segments and e = p-2+k hops of a chain, R = rounds of direct.py (z = 2R barriers, no
messages; z = 1 for direct_small.py, n <= 4 KiB), T = rows a binomial tree sends in all.

                              m      s                    r            c            u
    all_reduce      ring      2(p-1) 2q n                 q n          (1 + q) n    p
                    tree      2L     2L n                 L n          n            (p-1)/L
                    halving   l+2f   (l+2f) n             (l+f) n      (1 + l) n    p
                    direct    0      0                    q n          (2q + 1/p) n p
                    (small)   0      0                    (p-1) n      n            p
    reduce_scatter  ring      p-1    q n                  q n          (1 + 1/p) n  p
                    halving   l+2f   h n + f (n + n/p)    h n + f n    (1+1/p+h) n  p
                    direct    0      0                    q n          q n          p
    all_gather      ring      p-1    (p-1) n              0            p n          p
                    halving   l+2f   (p-1) n + f (n+p n)  0            p n          p
    broadcast       tree      L      L n                  0            n            (p-1)/L
                    ring      e      e n/k                0            n            (p-1) k/e
    reduce          tree      L      L n                  L n          n            (p-1)/L
                    ring      e      e n/k                e n/k        n            (p-1) k/e
    gather          tree      L      (p-1) n              0            (p+1) n      T/(p-1)
    scatter         tree      2L     (p-1) n              0            (p+1) n      T/(p-1)
    all_to_all      pairwise  p-1    q n                  0            n            p

For large n ring's bandwidth term wins, for small n the log-depth algorithms' latency
term. Without link contention, at a power of two halving ranks at or below ring for
reduce_scatter and all_gather at every n; off powers of two the fold makes ring win for
large n. With copy = 0 (DEFAULT) these are Thakur's formulas plus a call and barrier cost.

Shared memory. `direct` sends nothing: it reads its peers' inputs where they lie (its
bytes are copies), while a mailbox byte is copied twice (into the slot, out of it). So on
a shared-memory group "auto" picks direct for all_reduce and reduce_scatter from
SHM_DIRECT_MIN_BYTES (256 KiB) up (bench collectives, 2 cores: at 256 KiB 1.64 GB/s busbw
against ring's 1.47 at W=2, 0.69 against 0.42 at W=4; at 64 MiB 1.84 against 1.48 and
1.32 against 0.91), and for all_reduces of at most direct_small.SMALL_BYTES (its one-wait
path, fastest at W = 2, 3, 4). In between, the formulas decide (`rule`, then `choose`).

Constants. `fit` finds them by least squares on relative error; collectives/calibration.py
keeps them, one set per W, in a calibration file that every process reads (defaults
without one).

Reference: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
    operations in MPICH", IJHPCA 19(1), 49-66 (the model; ring, tree, recursive
    halving/doubling and pairwise formulas); Lawson & Hanson 1974, "Solving Least
    Squares Problems", ch. 23 (the non-negative least squares in `fit`).
Read next: collectives/calibration.py (the constants and their file), api.py.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from minidist.collectives.calibration import (ANY_W, DEFAULT, DEFAULTS, NAMES, VERSION,
                                              Constants, Table, constants, cost_file, describe,
                                              load, load_table, recent_constants, save)
from minidist.collectives.direct import BUFFER_BYTES
from minidist.collectives.ring import SEGMENT_BYTES

__all__ = ["ANY_W", "DEFAULT", "DEFAULTS", "NAMES", "VERSION", "Constants", "Table",
           "constants", "cost_file", "describe", "load", "load_table", "recent_constants",
           "save", "predict", "choose", "rule", "fit", "setup_key", "terms", "ALGOS", "CACHE_GRID",
           "SHM_DIRECT_MIN_BYTES", "SMALL_BYTES"]


# Algorithms per collective, in the order "auto" breaks ties (cheapest-latency first).
ALGOS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("halving", "tree", "ring", "direct"),
    "reduce_scatter": ("halving", "ring", "direct"),
    "all_gather": ("halving", "ring"),
    "broadcast": ("tree", "ring"),
    "reduce": ("tree", "ring"),
    "gather": ("tree",),
    "scatter": ("tree",),
    "all_to_all": ("pairwise",),
}
_NOT_AUTO = ("direct",)              # chosen by the shared-memory rule below, not the formulas
SHM_DIRECT_MIN_BYTES = 1 << 18      # measured crossover, see the module docstring
SMALL_BYTES = 4096                  # = direct_small.SMALL_BYTES (checked by a test)


def terms(op: str, algo: str, p: int, n: float) -> tuple[float, ...]:
    """(messages, barriers, bytes sent, bytes reduced, bytes copied) on the critical path,
    and u, the ranks that work at once (total bytes sent over critical-path bytes)."""
    L, lp = math.ceil(math.log2(p)), p.bit_length() - 1
    pp, f = 1 << lp, int(p & (p - 1) != 0)
    q, k = (p - 1) / p, max(1, math.ceil(n / SEGMENT_BYTES))
    R = max(1, math.ceil(n / (BUFFER_BYTES * p / (p + 1))))
    e = 0 if p == 1 else p - 2 + k
    tree_u, chain_u = (p - 1) / max(L, 1), (p - 1) * k / max(e, 1)
    rows_u = sum(min(v & -v, p - v) for v in range(1, p)) / max(p - 1, 1)   # binomial subtrees
    table = {
        ("all_reduce", "ring"): (2 * (p - 1), 0, 2 * q * n, q * n, n + q * n, p),
        ("all_reduce", "tree"): (2 * L, 0, 2 * L * n, L * n, n, tree_u),
        ("all_reduce", "halving"): (lp + 2 * f, 0, (lp + 2 * f) * n, (lp + f) * n,
                                    n + lp * n, p),
        ("all_reduce", "direct"): (0, 1, 0, (p - 1) * n, n, p) if n <= SMALL_BYTES else
                                  (0, 2 * R, 0, q * n, (2 * q + 1 / p) * n, p),
        ("reduce_scatter", "ring"): (p - 1, 0, q * n, q * n, n + n / p, p),
        ("reduce_scatter", "halving"): (lp + 2 * f, 0, (pp - 1) / pp * n + f * (n + n / p),
                                        (pp - 1) / pp * n + f * n,
                                        n + n / p + (pp - 1) / pp * n, p),
        ("reduce_scatter", "direct"): (0, 2 * R, 0, q * n, q * n, p),
        ("all_gather", "ring"): (p - 1, 0, (p - 1) * n, 0, p * n, p),
        ("all_gather", "halving"): (lp + 2 * f, 0, (p - 1) * n + f * (n + p * n), 0, p * n, p),
        ("broadcast", "tree"): (L, 0, L * n, 0, n, tree_u),
        ("broadcast", "ring"): (e, 0, e * n / k, 0, n, chain_u),
        ("reduce", "tree"): (L, 0, L * n, L * n, n, tree_u),
        ("reduce", "ring"): (e, 0, e * n / k, e * n / k, n, chain_u),
        ("gather", "tree"): (L, 0, (p - 1) * n, 0, (p + 1) * n, rows_u),
        ("scatter", "tree"): (2 * L, 0, (p - 1) * n, 0, (p + 1) * n, rows_u),
        ("all_to_all", "pairwise"): (p - 1, 0, q * n, 0, n, p),
    }
    if (op, algo) not in table:
        known = ", ".join(f"{o}/{a}" for o, a in table)
        raise ValueError(f"cost: no formula for {op!r} with algo {algo!r}; known: {known}.")
    return table[(op, algo)]


def setup_key(op: str, algo: str, nbytes: float) -> str:
    """The name of an algorithm's set-up: "op/algo" (+ "-small" on direct_small.py's path)."""
    small = op == "all_reduce" and algo == "direct" and nbytes <= SMALL_BYTES
    return f"{op}/{algo}" + ("-small" if small else "")


def _columns(op: str, algo: str, W: int, nbytes: float, cache: float, setup: float,
             cores: int) -> tuple[float, ...]:
    """What (1, alpha, barrier, beta, gamma, copy, dram) multiply in t (module docstring):
    the set-up and the bytes are CPU work, g = max(1, u / cores) times longer when shared."""
    m, z, s, r, c, u = terms(op, algo, int(W), float(nbytes))
    g = max(1.0, u / cores) if cores else 1.0
    return (g * setup, m, z, g * s, g * r, g * c, g * max(0.0, s + r + c - cache))


def predict(op: str, algo: str, W: int, nbytes: float,
            c: Constants | Table | None = None) -> float:
    """Predicted seconds of one call of `op` with `algo` on W ranks, n = nbytes per rank."""
    c = constants(W) if c is None else c.at(W) if isinstance(c, Table) else c
    setup = dict(c.setup).get(setup_key(op, algo, nbytes), c.call)
    return sum(x * k for x, k in zip(_columns(op, algo, W, nbytes, c.cache, setup, c.cores),
                                     (1.0, c.alpha, c.barrier, c.beta, c.gamma, c.copy, c.dram)))


def choose(op: str, nbytes: float, W: int, c: Constants | Table | None = None,
           shared_memory: bool = False) -> str:
    """The algorithm "auto" runs: `direct` for large reductions on a shared-memory group,
    else the cheapest predicted one (direct excluded), ties -> first."""
    if op not in ALGOS:
        raise ValueError(f"cost.choose: unknown collective {op!r}; use one of {list(ALGOS)}.")
    return rule(op, nbytes, W, shared_memory) or _choose(
        op, int(nbytes), int(W), constants(W) if c is None else
        c.at(W) if isinstance(c, Table) else c)


def rule(op: str, nbytes: float, W: int, shared_memory: bool) -> str | None:
    """The algorithm the measured shared-memory rule fixes ("direct" for large reductions
    and small all_reduces), or None where the formulas decide. A rule's choice does not
    depend on the constants, so a caller may remember it (collectives/api.py does)."""
    if shared_memory and "direct" in ALGOS[op] and W > 1 and (
            nbytes >= SHM_DIRECT_MIN_BYTES or (op == "all_reduce" and nbytes <= SMALL_BYTES)):
        return "direct"
    return None


@functools.lru_cache(maxsize=4096)
def _choose(op: str, nbytes: int, W: int, c: Constants) -> str:
    """choose() memoised: it sits on the path of every small collective."""
    candidates = [a for a in ALGOS[op] if a not in _NOT_AUTO]
    return min(candidates, key=lambda a: predict(op, a, W, nbytes, c))


# --- fitting the constants to measured calls ---------------------------------------------

CACHE_GRID = tuple(float(1 << k) for k in range(12, 31))     # 4 KiB .. 1 GiB


def fit(samples: Sequence[tuple[str, str, int, float, float]],
        setup: dict[str, float] | None = None, cores: int = 0) -> Constants:
    """The constants >= 0 that minimise sum_i ((predict_i - t_i) / t_i)^2 over measured
    calls (op, algo, W, nbytes, seconds t_i): relative error, so 8 B and 64 MiB weigh alike.

    `setup`: each algorithm's time alone (W = 1) by setup_key, all scaled by one fitted
    factor (call = factor * median); without it `call` is fitted for every algorithm.
    `cores`: of the machine measured. For each cache in CACHE_GRID the model is linear in
    the rest: non-negative least squares (`_nnls`) on rows columns_i / t_i against 1; the
    smallest residual wins. Times made by the model (cache in the grid) come back exactly.
    """
    if len(samples) < 7 or not all(t > 0 and math.isfinite(t) for *_, t in samples):
        raise ValueError(
            f"cost.fit: need at least 7 samples with finite times > 0, got {len(samples)}. "
            "Time every algorithm over a sweep of sizes (bench collectives --calibrate).")
    t, best = np.array([x[4] for x in samples], np.float64), None
    for cache in CACHE_GRID:
        A = np.array([_columns(op, a, W, n, cache, setup[setup_key(op, a, n)] if setup else 1,
                               cores) for op, a, W, n, _ in samples]) / t[:, None]   # (S, 7)
        scale = np.linalg.norm(A, axis=0)                # columns of unit length: seconds
        scale[scale == 0] = 1.0                          # and bytes differ by 1e10
        x = _nnls(A / scale, np.ones(len(t))) / scale
        err = float(np.sum((A @ x - 1) ** 2))
        if best is None or err < best[0] * (1 - 1e-12):
            best = (err, cache, x)
    k, alpha, barrier, beta, gamma, copy, dram = map(float, best[2])
    scaled = tuple(sorted((key, k * v) for key, v in setup.items())) if setup else ()
    call = k * float(np.median(list(setup.values()))) if setup else k
    return Constants(alpha, beta, gamma, call, barrier, copy, dram, best[1], cores, scaled)


def _nnls(A: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """x >= 0 minimising |A x - b| (Lawson & Hanson 1974, ch. 23): free the variable the
    residual pulls on hardest, solve on the free set, and step back to the boundary
    whenever a free variable would turn negative; stop when no fixed one wants to move."""
    n = A.shape[1]
    free, x = np.zeros(n, bool), np.zeros(n)
    for _ in range(3 * n):
        pull = A.T @ (b - A @ x)                         # (n,) minus the gradient
        if free.all() or np.max(pull[~free]) <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, pull))] = True
        while free.any():
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
            if np.all(z[free] > 0):
                x = z
                break
            bad = free & (z <= 0)                        # step from x towards z until the
            x = x + np.min(x[bad] / (x[bad] - z[bad])) * (z - x)   # first one hits 0
            free &= x > tol * np.max(np.abs(x), initial=1.0)
            x[~free] = 0.0
    return x
