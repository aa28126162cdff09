"""Nothing waits forever: the one polling loop every blocking operation uses.

A rank that waits for a peer polls a counter in shared memory. Polling is
what makes the transport fast (about a microsecond to notice a write, where
a sleeping primitive such as multiprocessing.Barrier costs 170-310 us here),
but a rank that only spins would steal the core its peer needs whenever
ranks outnumber cores. So the loop backs off in three phases:

    spin    re-check immediately, for a few microseconds (skipped when the job
            has more ranks than cores, since the peer may need this core)
    yield   os.sched_yield(): give the core to any runnable peer, ~0.5 ms
    sleep   at this rank's doorbell (runtime/doorbell.py): the peer that publishes
            what we wait for wakes us at once; each sleep ends after at most 1 ms.
            Without a doorbell (MPI, whose requests must be polled to progress):
            time.sleep with a doubling interval, capped at 1 ms

While waiting, about every millisecond, the loop calls `watch.check(late)`.
The watcher (built by the caller, who knows which peer and which call it is
waiting for) raises when the wait cannot succeed: the job is aborting, the
peer died or finished, the launcher is gone, the peer is in a different call
(CollectiveMismatch), or, once `late`, the deadline has passed
(CollectiveTimeout). That is how a dead rank is noticed within milliseconds
and a hung one at the deadline.

Read next: runtime/doorbell.py
"""

from __future__ import annotations

import os
import time
from typing import Callable, Protocol

from minidist.runtime.doorbell import Doorbells

SPIN_SECONDS = 20e-6
YIELD_SECONDS = 500e-6
MAX_SLEEP = 1e-3
CHECK_EVERY = 1e-3


class Watch(Protocol):
    def check(self, late: bool) -> None:
        """Raise if the wait can never succeed; `late` means the deadline passed."""


def wait_until(ready: Callable[[], bool], watch: Watch, timeout: float, spin: bool,
               bell: Doorbells | None = None) -> None:
    """Return as soon as ready() is true; raise through `watch` otherwise."""
    if ready():
        return
    start = time.perf_counter()
    if spin:
        while time.perf_counter() - start < SPIN_SECONDS:
            if ready():
                return
    deadline, next_check, nap = start + timeout, start, 20e-6
    while True:
        if ready():
            return
        now = time.perf_counter()
        if now >= next_check:
            watch.check(now >= deadline)
            next_check = now + CHECK_EVERY
        if now - start < YIELD_SECONDS:
            os.sched_yield()
        elif bell is not None:
            bell.sleep(ready, next_check - now)        # <= CHECK_EVERY
        else:
            time.sleep(nap)
            nap = min(2 * nap, MAX_SLEEP)
