"""The alpha-beta(-gamma) cost model: predicted time of each collective algorithm.

Sending one message of m bytes costs alpha + m beta: alpha is the fixed
latency of a message (on shared memory: the handshake through a mailbox
counter), beta the time per byte (copy in, copy out). Reducing m bytes costs
m gamma. An algorithm's time is the sum over its sequential steps, so each
algorithm is a formula in W (ranks) and n (bytes). The formulas below let
`choose` pick an algorithm per call (algo="auto") and let the bench compare
prediction and measurement.

Conventions: p = W, n = x.nbytes of the array ONE rank passes in (scatter:
the bytes one rank receives; all_to_all: the bytes one rank sends in total),
L = ceil(log2 p), p' = 2^floor(log2 p) and f = 1 if p is not a power of two
(the fold/unfold of halving_doubling.py), k = ceil(n / ring.SEGMENT_BYTES)
segments of a chain, R = rounds of direct.py, a barrier costs alpha.

    all_reduce      ring      2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
                    tree      2L (a + n b) + L n g
                    halving   log2 p' (a + n b + n g) + f (2a + 2n b + n g)
                    direct    2R a + (2(p-1)/p + 1) n b + (p-1)/p n g
    reduce_scatter  ring      (p-1) a + (p-1)/p n (b + g)
                    halving   log2 p' a + (p'-1)/p' n (b + g) + f (2a + n (b + g) + n/p b)
                    direct    2R a + ((p-1)/p + 1) n b + (p-1)/p n g
    all_gather      ring      (p-1) (a + n b)
                    halving   log2 p' a + (p-1) n b + f (2a + n b + p n b)
    broadcast       tree      L (a + n b)
                    ring      (p-2+k) (a + n/k b)                  (0 for p = 1)
    reduce          tree      L (a + n b + n g)
                    ring      (p-2+k) (a + n/k (b + g))            (0 for p = 1)
    gather          tree      L a + (p-1) n b
    scatter         tree      2L a + (p-1) n b
    all_to_all      pairwise  (p-1) a + (p-1)/p n b

For large n ring's bandwidth term wins; for small n the log-depth algorithms'
latency term wins. The model has no link contention, so at a power of two it
ranks halving at or below ring for reduce_scatter and all_gather at every n
(same bandwidth term, fewer messages); off powers of two the fold makes ring
win for large n.

Large messages over shared memory. The model counts bytes SENT; over the
shared-memory transport a mailbox algorithm copies every sent byte twice
(into the slot, out of it), while `direct` reads its peers' inputs where they
lie. So for large n on a group with shared memory `direct` is the fastest
(measured with `python -m minidist bench collectives`, 2 cores, medians of 3
runs: at 256 KiB direct 1.64 GB/s busbw against ring's 1.47 at W=2 and 0.69
against 0.42 at W=4; at 64 MiB 1.84 against 1.48 and 1.32 against 0.91), and
"auto" picks it for all_reduce and reduce_scatter from SHM_DIRECT_MIN_BYTES
(256 KiB) up when the caller says the group has shared memory.
Small all_reduces (at most direct_small.SMALL_BYTES) take direct's one-wait
path (direct_small.py), measured fastest at W = 2, 3, 4 (e.g. 42 us against
halving's 52 us for 8 B at W=2), so "auto" picks direct there too. In between,
the formulas decide. Either way the result is bitwise reproducible.

Constants come from a calibration file (JSON with keys alpha, beta, gamma in
seconds and seconds per byte) at $MINIDIST_COST_FILE or
~/.cache/minidist/cost.json, written by the bench from measurements fitted
with `fit`; otherwise from DEFAULT. Every rank must see the same constants
(true for one machine), or ranks could choose different algorithms; the call
header records the algorithm, so that would be a CollectiveMismatch, not a hang.

Reference: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
    communication operations in MPICH", IJHPCA 19(1), 49-66 (the model and the
    ring, tree, recursive halving/doubling and pairwise formulas).
Read next: api.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minidist.collectives.direct import BUFFER_BYTES
from minidist.collectives.ring import SEGMENT_BYTES


@dataclass(frozen=True)
class Constants:
    """alpha: seconds per message; beta: seconds per byte sent; gamma: seconds per byte reduced."""
    alpha: float
    beta: float
    gamma: float


# Order of magnitude of this runtime on one multi-core machine: ~10 us per
# mailbox handshake, ~2.5 GB/s per copied byte (copy in + copy out), ~5 GB/s reduce.
DEFAULT = Constants(alpha=10e-6, beta=4e-10, gamma=2e-10)

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


def _terms(op: str, algo: str, p: int, n: float) -> tuple[float, float, float]:
    """(messages, bytes sent, bytes reduced) on the critical path: time = a m + b s + g r."""
    L, lp = math.ceil(math.log2(p)), p.bit_length() - 1
    pp, f = 1 << lp, int(p & (p - 1) != 0)
    q, k = (p - 1) / p, max(1, math.ceil(n / SEGMENT_BYTES))
    rounds = max(1, math.ceil(n / (BUFFER_BYTES * p / (p + 1))))
    chain = 0 if p == 1 else p - 2 + k
    table = {
        ("all_reduce", "ring"): (2 * (p - 1), 2 * q * n, q * n),
        ("all_reduce", "tree"): (2 * L, 2 * L * n, L * n),
        ("all_reduce", "halving"): (lp + 2 * f, (lp + 2 * f) * n, (lp + f) * n),
        ("all_reduce", "direct"): (2 * rounds, (2 * q + 1) * n, q * n),
        ("reduce_scatter", "ring"): (p - 1, q * n, q * n),
        ("reduce_scatter", "halving"): (lp + 2 * f, (pp - 1) / pp * n + f * (n + n / p),
                                        (pp - 1) / pp * n + f * n),
        ("reduce_scatter", "direct"): (2 * rounds, (q + 1) * n, q * n),
        ("all_gather", "ring"): (p - 1, (p - 1) * n, 0.0),
        ("all_gather", "halving"): (lp + 2 * f, (p - 1) * n + f * (n + p * n), 0.0),
        ("broadcast", "tree"): (L, L * n, 0.0),
        ("broadcast", "ring"): (chain, chain * n / k, 0.0),
        ("reduce", "tree"): (L, L * n, L * n),
        ("reduce", "ring"): (chain, chain * n / k, chain * n / k),
        ("gather", "tree"): (L, (p - 1) * n, 0.0),
        ("scatter", "tree"): (2 * L, (p - 1) * n, 0.0),
        ("all_to_all", "pairwise"): (p - 1, q * n, 0.0),
    }
    if (op, algo) not in table:
        known = ", ".join(f"{o}/{a}" for o, a in table)
        raise ValueError(f"cost: no formula for {op!r} with algo {algo!r}; known: {known}.")
    return table[(op, algo)]


def predict(op: str, algo: str, W: int, nbytes: float, c: Constants | None = None) -> float:
    """Predicted seconds of one call of `op` with `algo` on W ranks, n = nbytes per rank."""
    c = constants() if c is None else c
    msgs, sent, reduced = _terms(op, algo, W, float(nbytes))
    return c.alpha * msgs + c.beta * sent + c.gamma * reduced


def choose(op: str, nbytes: float, W: int, c: Constants | None = None,
           shared_memory: bool = False) -> str:
    """The algorithm "auto" runs: `direct` for large reductions on a shared-memory group,
    else the cheapest predicted one (direct excluded), ties -> first."""
    if op not in ALGOS:
        raise ValueError(f"cost.choose: unknown collective {op!r}; use one of {list(ALGOS)}.")
    return rule(op, nbytes, W, shared_memory) or _choose(
        op, int(nbytes), int(W), constants() if c is None else c)


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


def fit(nbytes, seconds) -> tuple[float, float]:
    """Least-squares (alpha, beta) of seconds = alpha + beta * nbytes from measured pairs.

    Feed it point-to-point timings (one message of each size); at least two
    distinct sizes are needed. The result is the plain least-squares line, not
    clipped: a negative alpha means the measurements are too noisy at small sizes.
    """
    n, t = np.asarray(nbytes, np.float64), np.asarray(seconds, np.float64)
    if n.shape != t.shape or n.ndim != 1 or len(np.unique(n)) < 2:
        raise ValueError(
            f"cost.fit: need two equally long 1-D sequences with at least 2 distinct sizes; "
            f"got nbytes of shape {n.shape} ({len(np.unique(n))} distinct) and seconds of "
            f"shape {t.shape}. Time messages of several sizes (e.g. 8 B to 8 MB).")
    design = np.stack([np.ones_like(n), n], axis=1)                  # (S, 2)
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    return float(alpha), float(beta)


def fit_gamma(nbytes, seconds) -> float:
    """Least-squares gamma of seconds = gamma * nbytes (reduction time through the origin)."""
    n, t = np.asarray(nbytes, np.float64), np.asarray(seconds, np.float64)
    if n.shape != t.shape or n.ndim != 1 or not np.any(n > 0):
        raise ValueError(f"cost.fit_gamma: need equally long 1-D sequences with a positive "
                         f"size; got shapes {n.shape} and {t.shape}.")
    return float(n @ t / (n @ n))


def calibrate(p2p_nbytes, p2p_seconds, reduce_nbytes, reduce_seconds) -> Constants:
    """Constants fitted from measured message times and reduction times (see fit, fit_gamma)."""
    alpha, beta = fit(p2p_nbytes, p2p_seconds)
    gamma = fit_gamma(reduce_nbytes, reduce_seconds)
    if not (alpha > 0 and beta > 0 and gamma > 0):
        raise ValueError(
            f"cost.calibrate: fitted alpha={alpha:.3g} s, beta={beta:.3g} s/B, "
            f"gamma={gamma:.3g} s/B; all must be > 0. Measure more sizes (spanning bytes to "
            "megabytes) and take the median of several repeats per size.")
    return Constants(alpha, beta, gamma)


def cost_file() -> Path:
    """Where calibrated constants live: $MINIDIST_COST_FILE or ~/.cache/minidist/cost.json."""
    return _cost_path(os.environ.get("MINIDIST_COST_FILE"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=8)
def _cost_path(env: str | None, home: str | None) -> Path:
    """Path objects are slow to build (~20 us); this runs on every "auto" call."""
    if env:
        return Path(env)
    return (Path(home) if home else Path.home()) / ".cache" / "minidist" / "cost.json"


def load(path: str | Path | None = None) -> Constants:
    """Constants from a calibration JSON file, or DEFAULT when the file does not exist."""
    path = cost_file() if path is None else Path(path)
    if not path.exists():
        return DEFAULT
    try:
        raw = json.loads(path.read_text())
        c = Constants(**{k: float(raw[k]) for k in ("alpha", "beta", "gamma")})
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"cost: calibration file {path} is not valid ({type(e).__name__}: {e}). It must be "
            'JSON like {"alpha": 1e-05, "beta": 4e-10, "gamma": 2e-10}; rerun the bench or '
            "delete the file to use the defaults.") from None
    if not all(math.isfinite(v) and v > 0 for v in (c.alpha, c.beta, c.gamma)):
        raise ValueError(f"cost: calibration file {path} holds {c}; every constant must be a "
                         "finite number > 0. Rerun the bench or delete the file.")
    return c


def save(c: Constants, path: str | Path | None = None) -> Path:
    """Write constants as JSON (atomically: temp file, then rename); return the path."""
    path = cost_file() if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"alpha": c.alpha, "beta": c.beta, "gamma": c.gamma}, indent=1))
    os.replace(tmp, path)
    _last["when"] = -1e9                        # the next constants() reads it
    return path


RECHECK_SECONDS = 1.0          # how often constants() looks at the calibration file
_last: dict = {"path": None, "when": -1e9, "constants": None}


def constants() -> Constants:
    """The constants in force: the calibration file's or DEFAULT. The file is looked at
    (one os.stat) at most every RECHECK_SECONDS and re-read when it changed; `save`
    takes effect at once. ("auto" calls this on every collective.)"""
    path, now = cost_file(), time.monotonic()
    if _last["path"] == path and now - _last["when"] < RECHECK_SECONDS:
        return _last["constants"]
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = -1
    _last.update(path=path, when=now, constants=_cached_load(str(path), stamp))
    return _last["constants"]


@functools.lru_cache(maxsize=8)
def _cached_load(path: str, stamp: int) -> Constants:
    return load(path)
