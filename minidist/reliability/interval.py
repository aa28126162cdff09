"""The checkpoint interval: how much training to do between two checkpoints.

    python -m minidist interval --checkpoint-cost 30s --restart 120s --mtbf 3h
    python -m minidist interval --checkpoint-cost 30s --restart 2m --gpus 1024 --llama3

Checkpointing often wastes the time spent saving; checkpointing rarely wastes the work
redone after a failure. With T the training time between checkpoints, C the cost of one
save, R the time a restart takes (relaunch, load) and failures that arrive as a Poisson
process with mean time between failures M, the waste per unit of work is about
C/T (saving) + (R + T/2)/M (a failure, one per M on average, costs the restart and, on
average, half an interval of lost work). Minimising C/T + T/(2M) gives Young's optimum
T = sqrt(2 C M). Daly computes the expected time exactly and finds a better optimum.

The model (exact, and the one this module uses). A segment is T of work then C of
saving: L = T + C of uninterrupted wall time. Failures also strike during saves and
restarts. The time to get an uninterrupted window of length x, starting afresh, has
E = E[min(X, x)] + P(X < x) E with X ~ Exp(M), so E = M (e^(x/M) - 1). The first try
of a segment needs x = L; after a failure every retry needs x = R + L. Hence

    E[segment] = M (1 - e^(-L/M)) + (1 - e^(-L/M)) M (e^((R+L)/M) - 1)
               = M e^(R/M) (e^((T+C)/M) - 1)        (Daly 2006's complete cost model)
    efficiency(T) = T / E[segment]       the fraction of wall time that is useful work.

Because failures are memoryless, segments are independent and this is exact for a run of
whole segments, not an approximation: `simulate` walks the same model event by event
and must agree within its confidence interval (the tests check it). To first order in
1/M it gives back the picture above, E[segment] ~ (T + C)(1 + (R + (T+C)/2)/M): each
failure costs R + (T+C)/2. That estimate is wrong once T + C is not small against M (its
efficiency even goes negative); hence the exact form. R multiplies E[segment] by the
constant e^(R/M): it lowers the efficiency but does not move the optimum. Setting
d/dT [T / E] = 0 gives e^((T+C)/M) (1 - T/M) = 1 (`exact_interval` solves it); Daly's
perturbation series in sqrt(C/2M) is

    T_Daly = sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C   for C < 2M,  else  T_Daly = M.

Failures that are not memoryless. Field data fit the time between failures better with a
Weibull distribution of decreasing hazard (shape k < 1: a failure is often soon followed
by another; Schroeder and Gibson 2006). `simulate(..., shape=k)` draws the gaps between
failures from a Weibull of shape k and mean M (scale M / Gamma(1 + 1/k); k = 1 is the
exponential) as a renewal process: the clock restarts at each failure, not at a save. The
formulas above assume k = 1; the simulation shows where the optimum moves for k != 1, and
for a run of one segment it matches the renewal closed form `one_segment_time`.

How to use it:
    1. measure a save (seconds, e.g. time.perf_counter around checkpoint.save) and a
       restart, estimate the MTBF of the job (or `llama3_mtbf(n_gpus)`);
    2. `recommend(save_seconds, mtbf=..., restart=...)` gives Young's, Daly's and the
       exact optimum, and the efficiency there;
    3. `simulate(...)` checks a choice against simulated runs; the CLI prints both.

Units: every time is in seconds (the formulas hold in any one unit).
References:
    Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9).
    Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart
        dumps", Future Generation Computer Systems 22(3), 303-312, Eq. (37).
    Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv:2407.21783, Sec. 3.3.4:
        466 job interruptions in 54 days of pre-training on 16K GPUs.
    Schroeder, Gibson 2006, "A large-scale study of failures in high-performance computing
        systems", DSN '06 (time between failures: Weibull, decreasing hazard rate).
Read with: reliability/checkpoint.py (the save that C measures) and reliability/recovery.py
(the restart that R measures).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384     # Dubey et al. 2024
Z95 = 1.959964                                  # two-sided 95% quantile of N(0, 1)
MAX_FAILURES = 100_000                          # per simulated run: refuse hopeless settings
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}


def _positive(what: str, x: float, zero_ok: bool = False) -> float:
    x = float(x)
    if not (math.isfinite(x) and (x >= 0 if zero_ok else x > 0)):
        raise ValueError(f"{what} must be {'>= 0' if zero_ok else '> 0'} seconds (and finite), "
                         f"got {x!r}")
    return x


def young_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Young's first-order optimum T = sqrt(2 C M) (Young 1974): minimises C/T + T/(2M)."""
    return math.sqrt(2 * _positive("checkpoint_cost", checkpoint_cost)
                     * _positive("mtbf", mtbf))


def daly_interval(checkpoint_cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum (Daly 2006, Eq. 37), with C the save cost, M the MTBF:
    T = sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else T = M.
    The restart time R does not appear: it scales the expected run time by e^(R/M)."""
    c, m = _positive("checkpoint_cost", checkpoint_cost), _positive("mtbf", mtbf)
    if c >= 2 * m:
        return m
    f = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(f) / 3 + f / 9) - c


def exact_interval(checkpoint_cost: float, mtbf: float) -> float:
    """The T in (0, M) that maximises `efficiency`: the root of e^((T+C)/M) (1 - T/M) = 1,
    i.e. T = M (1 + W0(-e^(-1 - C/M))) with W0 Lambert's function. Found by bisection:
    the left side falls monotonically from e^(C/M) > 1 at T = 0 to 0 at T = M."""
    c, m = _positive("checkpoint_cost", checkpoint_cost), _positive("mtbf", mtbf)
    lo, hi = 0.0, m
    for _ in range(200):                        # interval halves each time: far past 1 ulp
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.exp((mid + c) / m) * (1 - mid / m) > 1 else (lo, mid)
    return 0.5 * (lo + hi)


def segment_time(interval, checkpoint_cost: float, restart: float, mtbf: float):
    """Expected wall time of one segment (T of work, then a save of C) under exponential
    failures with mean M, restart R after each: M e^(R/M) (e^((T+C)/M) - 1) (module
    docstring; Daly 2006). `interval` may be an array."""
    c, r = _positive("checkpoint_cost", checkpoint_cost, True), _positive("restart", restart, True)
    m, t = _positive("mtbf", mtbf), np.asarray(interval, dtype=float)
    if not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError(f"interval must be > 0 seconds (and finite), got {np.min(t)!r}")
    with np.errstate(over="ignore"):                     # T + C >> M: inf, as it should be
        return m * np.exp(r / m) * np.expm1((t + c) / m)


def efficiency(interval, checkpoint_cost: float, restart: float, mtbf: float):
    """Fraction of wall time spent on useful training, T / E[segment], in steady state."""
    return np.asarray(interval, dtype=float) / segment_time(interval, checkpoint_cost,
                                                            restart, mtbf)


def expected_wall_time(work: float, interval, checkpoint_cost: float, restart: float,
                       mtbf: float):
    """Expected wall time of a whole run of `work` seconds of training: ceil(W/T) segments,
    the last one shorter (W - (n-1) T), each ending with a save. Exact under the model."""
    w, t = _positive("work", work), np.asarray(interval, dtype=float)
    n = np.maximum(np.ceil(w / t - 1e-9), 1)            # no sliver segment from rounding
    last = w - (n - 1) * t
    return ((n - 1) * segment_time(t, checkpoint_cost, restart, mtbf)
            + segment_time(last, checkpoint_cost, restart, mtbf))


def llama3_mtbf(n_gpus: int) -> float:
    """A job's MTBF in seconds, scaled from Llama 3's 466 interruptions in 54 days on 16K
    GPUs (Dubey et al. 2024, Sec. 3.3.4): M = 54*24 h / 466 * (16384 / n_gpus). Assumes
    the job stops when any GPU (or its host) fails, so the failure rate grows as n_gpus."""
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, (int, np.integer)) or n_gpus < 1:
        raise ValueError(f"n_gpus must be an int >= 1, got {n_gpus!r}")
    return LLAMA3_DAYS * 86400 / LLAMA3_INTERRUPTIONS * (LLAMA3_GPUS / n_gpus)


@dataclass(frozen=True)
class Recommendation:
    """The optima for one (C, R, M), all in seconds, and the efficiency at each."""
    checkpoint_cost: float
    restart: float
    mtbf: float
    young: float
    daly: float
    exact: float
    efficiency_young: float
    efficiency_daly: float
    efficiency_exact: float


def recommend(checkpoint_seconds: float | Sequence[float], *, mtbf: float,
              restart: float = 0.0) -> Recommendation:
    """Optimal intervals from a checkpoint cost measured by the caller: one duration in
    seconds, or several (their mean is used: the waste C/T is linear in C to first order)."""
    measured = np.atleast_1d(np.asarray(checkpoint_seconds, dtype=float))
    if measured.ndim != 1 or measured.size == 0 or not np.all(np.isfinite(measured)) \
            or np.any(measured <= 0):
        raise ValueError(f"checkpoint_seconds must be one or more durations > 0 s, "
                         f"got {checkpoint_seconds!r}")
    c = float(measured.mean())
    opt = {k: f(c, mtbf) for k, f in
           (("young", young_interval), ("daly", daly_interval), ("exact", exact_interval))}
    eff = {f"efficiency_{k}": float(efficiency(t, c, restart, mtbf)) for k, t in opt.items()}
    return Recommendation(c, float(restart), float(mtbf), **opt, **eff)


@dataclass(frozen=True)
class Simulation:
    """Simulated runs per interval: efficiency W / mean(wall) with its 95% CI half-width
    (delta method), per-run wall times (I, runs) and failures (I, runs), seconds."""
    intervals: np.ndarray
    efficiency: np.ndarray
    ci95: np.ndarray
    wall: np.ndarray
    failures: np.ndarray


def weibull_scale(mtbf: float, shape: float) -> float:
    """The Weibull scale whose mean is `mtbf`: M / Gamma(1 + 1/k)."""
    if not (math.isfinite(shape) and shape > 0):
        raise ValueError(f"shape must be > 0 (1: exponential failures), got {shape!r}")
    return _positive("mtbf", mtbf) / math.gamma(1 + 1 / shape)


def one_segment_time(length: float, restart: float, mtbf: float, shape: float = 1.0,
                     grid: int = 200_001) -> float:
    """Expected wall time to get `length` seconds without a failure, first try from a fresh
    clock, each retry after a restart R, gaps i.i.d. Weibull(k, mean M): with survival
    S(x) = exp(-(x/s)^k), E = E[min(X, L)] + (1 - S(L)) E[min(X, R+L)] / S(R+L), where
    E[min(X, x)] = integral_0^x S (trapezoids on `grid` points)."""
    s = weibull_scale(mtbf, shape)

    def upto(x: float) -> float:
        u = np.linspace(0.0, x, grid)
        f = np.exp(-(u / s) ** shape)
        return float((f[1:] + f[:-1]).sum() * (u[1] - u[0]) / 2)
    surv = lambda x: math.exp(-((x / s) ** shape))                 # noqa: E731
    return upto(length) + (1 - surv(length)) * upto(restart + length) / surv(restart + length)


def simulate(work: float, intervals, checkpoint_cost: float, restart: float, mtbf: float,
             *, runs: int = 200, seed: int = 0, shape: float = 1.0) -> Simulation:
    """Simulate `runs` training runs of `work` seconds for each interval, failure by failure.

    A run is ceil(W/T) segments (T of work, then a save of C; the last segment shorter).
    Per run: draw the gap g ~ Exp(M) to the next failure; after a failure the next try
    starts with the restart R. If g covers the restart and every segment left, the run
    ends; else it keeps the k = floor((g - r)/(T + C)) segments whose saves completed,
    loses the rest, and pays g. Vectorised over (interval, run) cells; run j of every
    interval sees the same gaps (common random numbers: sharper comparisons between T).
    shape: the gaps' Weibull shape k (1: exponential; see the module docstring).

    Estimator: the model gives W / E[wall], so efficiency = W / mean(wall), and by the
    delta method its 95% CI half-width is 1.96 eff sd(wall) / (mean(wall) sqrt(runs)).
    """
    w, c = _positive("work", work), _positive("checkpoint_cost", checkpoint_cost, True)
    r_cost, m = _positive("restart", restart, True), _positive("mtbf", mtbf)
    t = np.atleast_1d(np.asarray(intervals, dtype=float))
    if runs < 2:
        raise ValueError(f"runs must be >= 2 to estimate a confidence interval, got {runs}")
    expect = expected_wall_time(w, t, c, r_cost, m) / m     # ~ failures per run
    if np.max(expect) > MAX_FAILURES:
        bad = t[np.argmax(expect)]
        raise ValueError(f"interval T={bad:g} s with C={c:g} s, R={r_cost:g} s and MTBF "
                         f"{m:g} s expects ~{np.max(expect):.3g} failures per run: T + C + R "
                         f"must be well below the MTBF for a run to finish")
    n_seg = np.maximum(np.ceil(w / t - 1e-9), 1).astype(np.int64)[:, None]   # (I, 1)
    seg, last = (t + c)[:, None], (w - (n_seg[:, 0] - 1) * t + c)[:, None]   # (I, 1) each
    rng, scale = np.random.default_rng(seed), weibull_scale(m, shape)
    done = np.zeros((t.size, runs), dtype=np.int64)          # segments saved, (I, runs)
    wall, fails = np.zeros((t.size, runs)), np.zeros((t.size, runs), dtype=np.int64)
    r, active = np.zeros((t.size, runs)), np.ones((t.size, runs), dtype=bool)
    while active.any():
        g = (rng.exponential(m, size=runs) if shape == 1        # (1, runs), shared over T
             else scale * rng.weibull(shape, size=runs))[None, :]
        left = n_seg - done                                   # >= 1 segment to go
        need = r + (left - 1) * seg + last                    # time to finish without failure
        finish, fail = active & (g >= need), active & (g < need)
        k = np.clip(np.floor((g - r) / seg), 0, left - 1).astype(np.int64)
        wall += np.where(finish, need, np.where(fail, g, 0.0))
        done += np.where(fail, k, 0)
        fails += fail
        r = np.where(fail, r_cost, r)
        active = fail
    mean, sd = wall.mean(axis=1), wall.std(axis=1, ddof=1)
    eff = w / mean
    return Simulation(t, eff, Z95 * eff * sd / (mean * math.sqrt(runs)), wall, fails)


def parse_duration(text: str) -> float:
    """'30s', '5m', '90min', '3h', '1.5d' -> seconds. A bare number is refused (ambiguous)."""
    hit = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]+)\s*",
                       str(text).lower())
    if hit is None or hit.group(2) not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a duration; write a number and a unit, "
                         f"like 30s, 5m, 3h or 2d")
    return float(hit.group(1)) * _UNITS[hit.group(2)]


def format_duration(seconds: float) -> str:
    """Seconds as a short human reading: '30 s', '13.42 min', '3.00 h', '2.1 d'."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.2f} min"
    return f"{seconds / 3600:.2f} h" if seconds < 4 * 86400 else f"{seconds / 86400:.1f} d"
