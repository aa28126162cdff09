"""The cost model's constants, and the calibration file that holds one set per world size.

collectives/cost.py predicts each algorithm's time from a few constants (alpha, beta,
gamma, call, barrier, copy, dram, cache, cores, per-algorithm setup; its docstring says what
each means). `python -m minidist bench collectives --calibrate` fits them on this machine
(cost.fit) and `save`s them; every process then reads them back with `constants(W)`.

The file: JSON at $MINIDIST_COST_FILE or ~/.cache/minidist/cost.json,
    {"version": 2, "fitted": date, "constants": {"2": {"alpha": s, ..., "setup":
     {"op/algo": s}}, "4": {...}}}
("any": one set for every W). A W not calibrated uses the nearest one (ties: the larger).
A version-1 file (alpha, beta, gamma) loads as the model it was fitted for (barrier =
alpha, nothing else). Without a file: DEFAULT. Every rank must see the same constants
(true on one machine), or ranks could choose different algorithms: the call header records
the algorithm, so that would be a CollectiveMismatch, not a hang.

Cost: `constants(W)` runs on every algo="auto" call, so it looks at the file (one os.stat)
at most every RECHECK_SECONDS and keeps what it read; `recent_constants` skips even the
environment lookup while that look is fresh.
Read next: collectives/cost.py
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path


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
