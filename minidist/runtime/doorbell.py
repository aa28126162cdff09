"""Doorbells: a rank that has waited a while sleeps in the kernel, and the peer it waits
for wakes it the moment it publishes.

runtime/wait.py polls shared counters: a spin, then ~0.5 ms of yielding the core. A
rank that still waits must then give its core away, and a plain nap (time.sleep) does,
but a message that lands during the nap is noticed only when the nap ends: 0.5-1 ms late,
once per message, which a pipeline pays on every hop between stages. A doorbell removes
that delay. Each rank has one bell, a Linux eventfd the launcher makes before it forks
(so every rank holds every rank's bell), and one cell on the job board, `sleeping[r]`:
how many of rank r's threads are asleep at its bell.

    waiter, rank r                          publisher, a peer of r
    sleeping[r] += 1                        store the counter r waits on (a mailbox's
    ---- fence ----                           head or tail, a barrier line)
    if ready(): stop                        ---- fence ----
    select(bell r, timeout)                 if sleeping[r] > 0: write 1 to bell r
    read bell r (empties it)
    sleeping[r] -= 1

The fences make this Dekker's pattern: each side stores, then loads what the other
stored, so at least one side sees the other: either the waiter finds its data ready and
does not sleep, or the publisher finds it asleep and rings. x86 may let a load pass an
earlier store; the atomic instruction in a lock's acquire and release is a full fence
there, and is what `_fence` does. (On a weakly ordered CPU a wake may be missed; the
timeout below bounds what that costs.) A publisher pays one system call only
when someone sleeps; otherwise a fence and one load, ~0.2 us.

The sleep still ends after `timeout` (wait.py passes its 1 ms check interval), so a wait
keeps noticing a failed peer or its deadline on time, and a wake that is missed (two
threads of one rank asleep at once, where one empties the bell the other was rung for)
costs what a nap did, never a hang. Without bells (the MPI transport, a one-rank job)
wait.py naps as before.

Cost of a wake: the publisher's eventfd write and the waiter's return from select, about
10-30 us here, where a nap cost up to 1 ms.

Read next: runtime/p2p.py
"""

from __future__ import annotations

import os
import select
import threading
from typing import Callable, Sequence

import numpy as np


def make_bells(world_size: int) -> list[int]:
    """The launcher's part, before it forks: one non-blocking eventfd per rank."""
    return [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(world_size)]


def close_bells(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


class Doorbells:
    """One rank's view: every rank's bell to ring, and its own to sleep at.

    fds: the eventfds of make_bells, inherited through fork, indexed by global rank.
    sleeping: the job board's (W,) cells, how many threads of each rank are asleep.
    """

    def __init__(self, fds: Sequence[int], sleeping: np.ndarray, rank: int):
        self.fds, self.sleeping, self.rank = list(fds), sleeping, rank
        self._count = threading.Lock()      # this rank's threads change sleeping[rank]
        self._fence = threading.Lock()      # acquire + release: a full memory fence

    def ring(self, peer: int) -> None:
        """Call after publishing something `peer` (a global rank) may wait for."""
        with self._fence:
            pass
        if self.sleeping[peer]:
            self._write(peer)

    def ring_all(self, peers: Sequence[int]) -> None:
        """ring() for several peers with one fence (a barrier wakes every member)."""
        with self._fence:
            pass
        sleeping = self.sleeping
        for peer in peers:
            if sleeping[peer]:
                self._write(peer)

    def _write(self, peer: int) -> None:
        try:
            os.eventfd_write(self.fds[peer], 1)
        except BlockingIOError:             # its count is at the maximum: rung already
            pass

    def sleep(self, ready: Callable[[], bool], timeout: float) -> None:
        """Sleep at this rank's bell until it rings or `timeout` seconds pass, unless
        ready() is already true once this rank is marked asleep."""
        fd = self.fds[self.rank]
        with self._count:                   # the release is the waiter's fence
            self.sleeping[self.rank] += 1
        try:
            if ready():
                return
            select.select([fd], [], [], timeout)
            try:
                os.eventfd_read(fd)         # empty it: the next sleep waits for a new ring
            except BlockingIOError:         # it timed out, or another thread emptied it
                pass
        finally:
            with self._count:
                self.sleeping[self.rank] -= 1
