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

Constants. `fit` finds them by least squares on relative error. The calibration file
(JSON at $MINIDIST_COST_FILE or ~/.cache/minidist/cost.json) holds one set per W:
{"version": 2, "fitted": date, "constants": {"2": {"alpha": s, ..., "setup": {"op/algo":
s}}, "4": {...}}} ("any": one set for every W); a W not calibrated uses the nearest one
(ties: the larger). A version-1 file (alpha, beta, gamma) loads as the model it was
fitted for (barrier = alpha, nothing else). Without a file: DEFAULT. Every rank must see
the same constants (true on one machine), or ranks could choose different algorithms:
the call header records the algorithm, so that would be a CollectiveMismatch, not a hang.

Reference: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
    operations in MPICH", IJHPCA 19(1), 49-66 (the model; ring, tree, recursive
    halving/doubling and pairwise formulas); Lawson & Hanson 1974, "Solving Least
    Squares Problems", ch. 23 (the non-negative least squares in `fit`).
Read next: api.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import numpy as np

from minidist.collectives.direct import BUFFER_BYTES
from minidist.collectives.ring import SEGMENT_BYTES


# The module docstring's terms. Seconds: alpha, call, barrier, setup (("op/algo", s), ...);
# seconds per byte: beta, gamma, copy, dram; bytes: cache; cores: 0 = contention not modelled.
@dataclass(frozen=True)
class Constants:
    """The constants of the model for one world size."""
    alpha: float
    beta: float
    gamma: float
    call: float = 0.0
    barrier: float = 0.0
    copy: float = 0.0
    dram: float = 0.0
    cache: float = 0.0
    cores: int = 0
    setup: tuple[tuple[str, float], ...] = ()

    def __hash__(self) -> int:          # computed once: "auto" hashes these on every call
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


NAMES = tuple(f.name for f in fields(Constants))[:-2]    # the floats, in the order above
VERSION = 2
ANY_W = 0                                                # Table key: a set for every W

# Orders of magnitude of this runtime (per-W constants: bench collectives --calibrate). No
# copy term: without a calibration "auto" chooses exactly as the alpha-beta-gamma model did.
DEFAULT = Constants(alpha=10e-6, beta=4e-10, gamma=2e-10, call=10e-6, barrier=5e-6)

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


def _terms(op: str, algo: str, p: int, n: float) -> tuple[float, ...]:
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
    m, z, s, r, c, u = _terms(op, algo, int(W), float(nbytes))
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


# --- the calibration file ----------------------------------------------------------------

def cost_file() -> Path:
    """Where calibrated constants live: $MINIDIST_COST_FILE or ~/.cache/minidist/cost.json."""
    return _cost_path(os.environ.get("MINIDIST_COST_FILE"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _cost_path(env: str | None, home: str | None) -> Path:
    """Path objects are slow to build (~20 us); this runs on every "auto" call."""
    if env:
        return Path(env)
    return (Path(home) if home else Path.home()) / ".cache" / "minidist" / "cost.json"


@dataclass(frozen=True)
class Table:
    """Constants per world size, as a calibration file holds them ((W, Constants), ...);
    W = ANY_W serves every world size. `fitted`: when (ISO date); `version`: file format."""
    sets: tuple[tuple[int, Constants], ...]
    fitted: str = ""
    version: int = VERSION

    def at(self, W: int | None = None) -> Constants:
        """The set for W, else the nearest W's (ties: the larger); None: the smallest W's."""
        Ws = sorted(w for w, _ in self.sets)
        w = Ws[0] if W is None or ANY_W in Ws else min(Ws, key=lambda v: (abs(v - W), -v))
        return dict(self.sets)[w]


DEFAULTS = Table(((ANY_W, DEFAULT),))


def _to_json(c: Constants) -> dict:
    return {**{k: getattr(c, k) for k in NAMES}, "cores": c.cores, "setup": dict(c.setup)}


def _from_json(raw: dict) -> Constants:       # the inverse of _to_json, checked
    c = Constants(**{k: float(raw[k]) for k in NAMES}, cores=int(raw["cores"]),
                  setup=tuple(sorted((str(k), float(v)) for k, v in raw["setup"].items())))
    if not all(math.isfinite(v) and v >= 0 for v in [*map(c.__getattribute__, NAMES),
                                                     c.cores, *dict(c.setup).values()]):
        raise ValueError(f"every constant must be a finite number >= 0, got {raw}")
    return c


def load_table(path: str | Path | None = None) -> Table:
    """The Table in a calibration file (version 2, or version 1: alpha, beta, gamma only),
    or DEFAULTS when the file does not exist."""
    path = cost_file() if path is None else Path(path)
    if not path.exists():
        return DEFAULTS
    try:
        raw = json.loads(path.read_text())
        if "version" not in raw:                 # version 1: alpha, beta, gamma for every W
            old = {k: raw[k] for k in ("alpha", "beta", "gamma")}
            c = _from_json({**_to_json(DEFAULTS.at()), "call": 0, "copy": 0, **old,
                            "barrier": raw["alpha"]})
            return Table(((ANY_W, c),), version=1)
        if raw["version"] != VERSION:
            raise ValueError(f"version {raw['version']!r}; this code reads 1 and {VERSION}")
        t = Table(tuple(sorted((ANY_W if w == "any" else int(w), _from_json(v))
                               for w, v in raw["constants"].items())), str(raw["fitted"]))
        t.at()
        return t
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(
            f"cost: calibration file {path} is not valid ({type(e).__name__}: {e}). Rerun "
            "`python -m minidist bench collectives --calibrate`, or delete the file to use "
            "the defaults.") from None


def load(path: str | Path | None = None, W: int | None = None) -> Constants:
    """The constants a calibration file gives world size W (see Table.at), or DEFAULT."""
    return load_table(path).at(W)


def save(c: Constants | Table, path: str | Path | None = None, fit_report: dict | None = None
         ) -> Path:
    """Write constants (one set for every W) or a Table as version-2 JSON, atomically
    (temp file, then rename), with an optional summary of the fit; return the path."""
    path = cost_file() if path is None else Path(path)
    t = c if isinstance(c, Table) else Table(((ANY_W, c),), time.strftime("%Y-%m-%d %H:%M"))
    raw = {"version": VERSION, "fitted": t.fitted, "units": "seconds, seconds per byte (beta, "
           "gamma, copy, dram), bytes (cache)", "fit": fit_report or {},
           "constants": {str(w or "any"): _to_json(s) for w, s in t.sets}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(raw, indent=1))
    os.replace(tmp, path)
    _last["when"] = -1e9                        # the next constants() reads it
    return path


def describe(path: str | Path | None = None) -> str:
    """Where the constants in force come from, in words (the bench prints it)."""
    path = cost_file() if path is None else Path(path)
    t = load_table(path)
    if t is DEFAULTS:
        return f"defaults (no calibration file at {path})"
    if t.version == 1:
        return (f"calibrated {path} (old format: alpha, beta, gamma only, without the call, "
                "barrier, copy and cache terms; rerun with --calibrate)")
    Ws = sorted(w for w, _ in t.sets)
    which = "one set for every W" if Ws == [ANY_W] else f"W = {', '.join(map(str, Ws))} fitted"
    return f"calibrated {path} ({t.fitted or 'undated'}, {which})"


RECHECK_SECONDS = 1.0          # how often constants() looks at the calibration file
_last: dict = {"path": None, "env": None, "when": -1e9, "loaded": None}


def constants(W: int | None = None) -> Constants:
    """The constants in force for world size W: the calibration file's (Table.at) or DEFAULT.
    The file is looked at (one os.stat) at most every RECHECK_SECONDS and re-read when it
    changed; `save` takes effect at once. ("auto" calls this on every collective.)"""
    now, env = time.monotonic(), os.environ.get("MINIDIST_COST_FILE")
    if env != _last["env"] or now - _last["when"] >= RECHECK_SECONDS:   # else: ~0.4 us
        path = cost_file()
        try:
            stamp = os.stat(path).st_mtime_ns
        except OSError:
            stamp = -1
        _last.update(path=path, env=env, when=now, loaded=_cached_load(str(path), stamp))
    table, at = _last["loaded"]                 # at: W -> Constants, filled as asked
    c = at.get(W)
    return c if c is not None else at.setdefault(W, table.at(W))


def recent_constants(W: int | None = None) -> Constants:
    """constants(W) as last looked up, without reading the environment again (~0.1 us
    against ~1 us: os.environ is slow) while that look is under RECHECK_SECONDS old; the
    call path of a remembered "auto" collective (collectives/api.py) uses this."""
    loaded = _last["loaded"]
    if loaded is not None and time.monotonic() - _last["when"] < RECHECK_SECONDS:
        c = loaded[1].get(W)
        if c is not None:
            return c
    return constants(W)


@functools.lru_cache(maxsize=8)
def _cached_load(path: str, stamp: int) -> tuple[Table, dict]:
    return load_table(path), {}
