"""Chrome traces: what each rank did and when, written as a timeline that Perfetto opens.

A distributed step is easiest to understand as a picture: one row per rank,
one bar per piece of work, time running to the right. Chrome's "Trace Event
Format" is the simplest file such viewers read, and this module writes it.

The format (Google, "Trace Event Format", the JSON Object Format): a JSON object

    {"traceEvents": [event, ...], "displayTimeUnit": "ms"}

where each event is a flat object. We write two kinds:

    complete event  {"ph": "X", "name": "ring step 1", "cat": "reduce-scatter",
                     "ts": 12.5, "dur": 3.0, "pid": 2, "tid": 0, "args": {...}}
                    one bar: it starts at `ts` and lasts `dur`, both in MICROseconds
                    (floats allowed); `pid` picks the row group, `tid` the track inside it;
                    `args` is shown when the bar is clicked.
    metadata event  {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "rank 2"}}
                    labels a row group (and "thread_name" with a tid labels a track).

Here pid = rank and tid = a lane inside the rank (0: the rank's main thread,
1: e.g. its communication worker), so each rank is one labelled group of tracks.
Bars on the same track must nest or follow each other; the viewer stacks nested ones.

One rank's view: record (name, start, end, args) of each piece of work with a
clock all processes share (time.perf_counter on Linux is CLOCK_MONOTONIC), and
return the events to the launcher, which puts every rank's events in one Trace,
`shifted` so that time 0 is the first event, and calls `write(path)`.

How to open the file: https://ui.perfetto.dev -> "Open trace file" (drag it in),
or chrome://tracing -> "Load". Keys W/S zoom, A/D pan; click a bar to see its args.

Reference: "Trace Event Format", Google (docs.google.com, "Trace Event Format",
    2016 revision), sections "JSON Object Format", "Complete Events", "Metadata Events".
Read next: runtime/flight.py (the per-rank record of collective calls, drawn with this).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator


@dataclass(frozen=True)
class Event:
    """One bar on the timeline: `name` ran on `rank` (lane `lane`) from start_us to end_us."""
    name: str
    rank: int
    start_us: float
    end_us: float
    args: dict = field(default_factory=dict)
    cat: str = ""
    lane: int = 0

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us

    def to_json(self) -> dict[str, Any]:
        """The complete ("X") event of the Trace Event Format."""
        return {"name": self.name, "cat": self.cat, "ph": "X", "ts": self.start_us,
                "dur": self.dur_us, "pid": self.rank, "tid": self.lane, "args": self.args}


def now_us() -> float:
    """Microseconds on a clock shared by every process of the machine (CLOCK_MONOTONIC)."""
    return time.perf_counter_ns() / 1e3


def _check(e: Event) -> Event:
    if not isinstance(e.name, str) or not e.name:
        raise ValueError(f"trace: event name must be a non-empty string, got {e.name!r}")
    if isinstance(e.rank, bool) or not isinstance(e.rank, int) or e.rank < 0:
        raise ValueError(f"trace: event {e.name!r} has rank {e.rank!r}; it must be an int "
                         ">= 0 (it becomes the pid of the row).")
    if not (math.isfinite(e.start_us) and math.isfinite(e.end_us)) or e.end_us < e.start_us:
        raise ValueError(f"trace: event {e.name!r} on rank {e.rank} ends at {e.end_us} us, "
                         f"before it starts at {e.start_us} us (or a time is not finite). "
                         "Pass start and end from the same clock, start first.")
    try:
        json.dumps(e.args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"trace: args of event {e.name!r} are not JSON-serialisable ({err}); "
                         "convert NumPy values with int(...), float(...) or .tolist().") from None
    return e


class Trace:
    """A set of events from any number of ranks, written as one Chrome-trace JSON file."""

    def __init__(self, events: Iterable[Event] = (), labels: dict[int, str] | None = None):
        self._events: list[Event] = []
        self.labels: dict[int, str] = dict(labels or {})
        self.extend(events)

    def __len__(self) -> int:
        return len(self._events)

    def add(self, name: str, rank: int, start_us: float, end_us: float,
            args: dict | None = None, *, cat: str = "", lane: int = 0) -> Event:
        """Record one complete event; ValueError if it ends before it starts."""
        e = _check(Event(name, rank, float(start_us), float(end_us), dict(args or {}), cat,
                         int(lane)))
        self._events.append(e)
        return e

    def extend(self, events: Iterable[Event]) -> None:
        for e in events:
            self._events.append(_check(e))

    def label(self, rank: int, text: str) -> None:
        """Name the row of `rank` (default "rank r")."""
        self.labels[rank] = text

    @contextmanager
    def span(self, name: str, rank: int, args: dict | None = None, *, cat: str = "",
             lane: int = 0) -> Iterator[dict]:
        """`with trace.span("step", rank) as args:` records the block's wall time;
        the yielded dict can be filled inside the block and becomes the event's args.
        A block that raises is recorded too, with args["error"] naming the exception."""
        a = dict(args or {})
        start = now_us()
        try:
            yield a
        except BaseException as e:
            a["error"] = type(e).__name__
            raise
        finally:
            self.add(name, rank, start, now_us(), a, cat=cat, lane=lane)

    def events(self) -> list[Event]:
        """Events ordered by start time, then rank, lane, and longest first (so that an
        enclosing event precedes the events nested in it)."""
        return sorted(self._events, key=lambda e: (e.start_us, e.rank, e.lane, -e.end_us))

    def shifted(self, origin_us: float | None = None) -> "Trace":
        """A copy with every time minus origin_us (default: the earliest start, so t = 0)."""
        if origin_us is None:
            origin_us = min((e.start_us for e in self._events), default=0.0)
        moved = [replace(e, start_us=e.start_us - origin_us, end_us=e.end_us - origin_us)
                 for e in self._events]
        return Trace(moved, self.labels)

    def to_json(self) -> dict[str, Any]:
        """The JSON object: row labels first (metadata events), then the ordered events."""
        ranks = sorted({e.rank for e in self._events} | set(self.labels))
        meta = [{"name": "process_name", "ph": "M", "pid": r, "tid": 0,
                 "args": {"name": self.labels.get(r, f"rank {r}")}} for r in ranks]
        meta += [{"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
                  "args": {"sort_index": r}} for r in ranks]
        return {"traceEvents": meta + [e.to_json() for e in self.events()],
                "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> Path:
        """Write the trace as JSON (atomically: a temporary file, then a rename); return path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_json(), indent=None, separators=(",", ":")))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Trace":
        """Load a file written by `write` (complete and process_name events; others ignored)."""
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict) or not isinstance(raw.get("traceEvents"), list):
            raise ValueError(f"trace: {path} is not a Trace Event Format object (expected a "
                             'JSON object with a "traceEvents" list).')
        trace = cls()
        for ev in raw["traceEvents"]:
            if ev.get("ph") == "X":
                trace.add(ev["name"], ev["pid"], ev["ts"], ev["ts"] + ev["dur"],
                          ev.get("args", {}), cat=ev.get("cat", ""), lane=ev.get("tid", 0))
            elif ev.get("ph") == "M" and ev.get("name") == "process_name":
                trace.label(ev["pid"], ev["args"]["name"])
        return trace
