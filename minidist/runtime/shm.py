"""Shared memory: one anonymous arena per job, carved up identically on every rank.

The launcher maps a single anonymous, MAP_SHARED region before it forks the
ranks. Every rank inherits the mapping at the same place, so a byte written
by one rank is visible to all the others with no copy and no system call.
Because the region has no name, no other process can open it (stronger than
a 0600 file), and nothing can be left behind in /dev/shm: the kernel frees
the pages when the last rank exits, even after SIGKILL.

The region is reserved, not allocated: pages cost memory only once touched
(MAP_NORESERVE), so the arena can be large enough for any group. Its size is
address space, which is plentiful: runtime/world.py sizes it from the world
size (64 GiB for W = 2, 160 GiB for W = 32, 290 GiB for W = 64), and mapping
even 16 TiB this way takes 0.03 ms, with no page tables until pages are
touched (fork copies none: the mapping is shared). Touched pages stay until
the job ends (the job's shared memory, Shmem in /proc/meminfo). The arena is
left out of core dumps (MADV_DONTDUMP). Only a kernel that refuses to
overcommit (vm.overcommit_memory=2) counts the whole reservation; there the
launcher's error says which variables to lower.

Who owns which bytes is decided without talking: allocation is a bump
pointer, and every rank performs the same allocations in the same order
(the job board first, then one fixed-size region per process group, in the
order the groups are created, which every rank does identically). Inside a
group's region, allocation is collective over that group only.

Memory ordering. A message is published by writing the payload, then a
counter; the reader polls the counter, then reads the payload. On x86 (TSO)
stores become visible in program order and loads are not reordered with
older loads, so plain 8-byte aligned stores and loads are enough. On CPUs
with weaker ordering (ARM, POWER) `Ordering` routes counter reads and writes
through a process-shared lock, whose acquire/release implies full barriers.

Read next: runtime/p2p.py (mailboxes built on these bytes).
"""

from __future__ import annotations

import mmap
import os
import platform

import numpy as np

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)    # Linux value; not exported by Python
ALIGN = 64                                               # one cache line
_TSO_MACHINES = {"x86_64", "amd64", "i386", "i686", "x86"}


def strong_ordering() -> bool:
    """True when plain loads and stores are ordered enough (x86 total store order).
    MINIDIST_LOCKED_ORDERING=1 forces the locked path (to test it on x86)."""
    if os.environ.get("MINIDIST_LOCKED_ORDERING") == "1":
        return False
    return platform.machine().lower() in _TSO_MACHINES


HINT = ("Raise MINIDIST_GROUP_BYTES (bytes per group) or MINIDIST_GROUPS (number of groups) "
        "before launching.")


def _reserve(nbytes: int) -> mmap.mmap:
    """Map `nbytes` of anonymous shared memory, reserved but not allocated."""
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | MAP_NORESERVE)
        if hasattr(mmap, "MADV_DONTDUMP"):
            buf.madvise(mmap.MADV_DONTDUMP)      # a crashing rank dumps its own memory only
        return buf
    except OSError as e:
        raise MemoryError(
            f"could not reserve the job's shared arena of {nbytes} B ({nbytes / 2**30:.1f} "
            f"GiB of address space): {e}. Only touched pages cost memory, but a kernel that "
            "does not overcommit (vm.overcommit_memory=2) counts all of it: set "
            "MINIDIST_GROUPS (number of groups) or MINIDIST_GROUP_BYTES (bytes per group) "
            "lower before launching.") from None


class Arena:
    """A bump allocator over one shared mapping; identical on every rank."""

    def __init__(self, nbytes: int, buf: mmap.mmap | None = None, offset: int = 0,
                 hint: str = HINT):
        if buf is None:
            buf = _reserve(nbytes)
        self.buf, self.base, self.nbytes, self.used = buf, offset, nbytes, 0
        self.hint = hint                   # what to raise when this arena is full

    def alloc(self, nbytes: int, what: str = "buffer") -> int:
        """Reserve `nbytes` (cache-line aligned) and return their offset in the mapping."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.nbytes:
            raise MemoryError(
                f"shared arena full: {what} needs {nbytes} B but only {self.nbytes - start} B "
                f"of {self.nbytes} B are left. {self.hint}")
        self.used = start + nbytes
        return self.base + start

    def sub(self, nbytes: int, what: str, hint: str = HINT) -> "Arena":
        """Carve a child arena (e.g. one per process group) out of this one."""
        return Arena(nbytes, self.buf, self.alloc(nbytes, what), hint)

    def view(self, offset: int, dtype, count: int) -> np.ndarray:
        """A NumPy view of `count` items of `dtype` at `offset` of the mapping."""
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=offset)


class Ordering:
    """Publishes and reads single-writer int64 counters with the ordering a
    message protocol needs: everything written before `store` is visible to a
    reader whose `load` sees the new value.

    x86: plain aligned 8-byte stores and loads (TSO gives this for free).
    Elsewhere: every store and load goes through one process-shared lock, made
    before the ranks fork; lock acquire/release are full memory barriers.
    """

    def __init__(self, lock=None):
        self.lock = None if strong_ordering() else lock
        if self.lock is None and not strong_ordering():
            raise RuntimeError(
                f"CPU {platform.machine()!r} has weak memory ordering and no fence lock was "
                "given; create the job through minidist.runtime.launch.spawn.")

    def store(self, arr: np.ndarray, i: int, value: int) -> None:
        if self.lock is None:
            arr[i] = value
        else:
            with self.lock:
                arr[i] = value

    def load(self, arr: np.ndarray, i: int) -> int:
        if self.lock is None:
            return int(arr[i])
        with self.lock:
            return int(arr[i])
