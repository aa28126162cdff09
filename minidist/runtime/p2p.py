"""Point-to-point messages over shared memory: send, recv and sendrecv.

Every ordered pair of ranks (src -> dst) in a group owns a mailbox: a ring of
`nslots` fixed-size slots and two counters, `head` (chunks the sender has
published, written only by src) and `tail` (chunks the receiver has consumed,
written only by dst). One writer per counter, so no locks. A side that has waited
a while sleeps at its doorbell (runtime/doorbell.py); the other side's publish
rings it:

    sender, chunk i:   wait until i - tail < nslots      (a slot is free)
                       write header + payload into slot i % nslots
                       head = i + 1                      (publish)
                       ring dst if it sleeps
    receiver, chunk i: wait until head > i               (a chunk is there)
                       check the header, copy (or reduce) the payload out
                       tail = i + 1                      (free the slot)
                       ring src if it sleeps

A message larger than a slot is cut into chunks that flow through the ring,
so the sender fills slot k+1 while the receiver drains slot k (pipelining).
`sendrecv` advances its send and its receive together, chunk by chunk, so a
ring of ranks that all send right and receive left cannot deadlock even when
messages are many slots long.

Every slot carries a header: the sender's call record (runtime/call.py) and
the message's byte count and dtype. The receiver compares them with its own
call and its `out` buffer before it touches the payload; any difference is a
CollectiveMismatch that names both calls, never silent garbage. (A sendrecv's
header differs in the two ranks it names, which call.identity leaves out: the
comparison of identities after the quick one at a glance lets it through.)

A message that fits in the slots free now never waits for the receiver (`fits`): an
asynchronous send of one is done at once by the caller (the eager send, collectives/api.py).

Nodes (runtime/nodes.py): when the job's ranks are grouped into nodes, a message to a rank
on another node is held before its last chunk until alpha + n beta after it began (the
emulated inter-node tier), and counted in `bytes_sent_inter` / `messages_sent_inter` too.
Such a send never counts as eager: it waits by design.

Cost per message of N bytes: one copy in (sender) and one copy out (receiver),
about N/slot_bytes counter handshakes. Zero-copy reads of a peer's buffer are
in runtime/group.py (`shared`).

Read next: runtime/group.py
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from minidist.runtime import call
from minidist.runtime.errors import CollectiveMismatch
from minidist.runtime.shm import Arena, Ordering
from minidist.runtime.wait import wait_until

HDR = 32                                  # int64 header fields per slot
MSG_NBYTES, MSG_DTYPE, CHUNK_OFF, CHUNK_NBYTES = 16, 17, 18, 19


class Channel:
    """One direction of one pair: counters, headers and slots in shared memory."""

    def __init__(self, arena: Arena, nslots: int, slot_bytes: int, ordering: Ordering):
        self.nslots, self.slot_bytes = nslots, slot_bytes
        self.ctr = arena.view(arena.alloc(128, "counters"), np.int64, 16)   # [0] head, [8] tail
        hdr = arena.view(arena.alloc(8 * HDR * nslots, "headers"), np.int64, HDR * nslots)
        data = arena.view(arena.alloc(nslots * slot_bytes, "slots"), np.uint8,
                          nslots * slot_bytes)
        self.hdrs = list(hdr.reshape(nslots, HDR))                       # per-slot views
        self.slots = list(data.reshape(nslots, slot_bytes))
        self.done = 0                      # chunks this rank sent (or received) so far
        self.peer = -1                     # the global rank at the other end, seen from here
        self.inter = False                 # the other end is on another node (emulated tier)
        self.lock = ordering.lock          # None on x86: plain loads/stores are ordered

    def chunks(self, nbytes: int) -> int:
        """Slots a message of nbytes takes (an empty message still takes one)."""
        return max(1, -(-nbytes // self.slot_bytes))

    @staticmethod
    def nbytes(nslots: int, slot_bytes: int) -> int:
        """Arena bytes of one channel (each part a multiple of the 64 B alignment)."""
        return 128 + 8 * HDR * nslots + nslots * slot_bytes

    def head(self) -> int:
        if self.lock is None:
            return self.ctr[0]
        with self.lock:
            return int(self.ctr[0])

    def tail(self) -> int:
        if self.lock is None:
            return self.ctr[8]
        with self.lock:
            return int(self.ctr[8])

    def publish(self, i: int, value: int) -> None:
        if self.lock is None:
            self.ctr[i] = value
        else:
            with self.lock:
                self.ctr[i] = value


def byte_view(x: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, flat, without a copy."""
    return x.reshape(-1).view(np.uint8)


class Mailboxes:
    """This rank's outgoing and incoming channels in one group, and the
    operations on them. `link` is the owning group: it supplies the current
    call record (`record`, and its identity bytes `identity()`), the timeout,
    and the watcher for stalled waits."""

    def __init__(self, link, arena: Arena, rank: int, size: int, nslots: int,
                 slot_bytes: int, ordering: Ordering):
        self.link = link
        self.bells = link.bells            # a sleeping peer is rung (runtime/doorbell.py)
        self.nodes = getattr(link, "nodes", None)   # runtime/nodes.py, or None: one node
        self.out: dict[int, Channel] = {}
        self.inc: dict[int, Channel] = {}
        for src in range(size):            # identical allocation order on every rank
            for dst in range(size):
                if src != dst:
                    ch = Channel(arena, nslots, slot_bytes, ordering)
                    if src == rank:
                        self.out[dst], ch.peer = ch, link.ranks[dst]
                        ch.inter = self.nodes is not None and \
                            self.nodes.node(link.ranks[dst]) != self.nodes.node(link.ranks[rank])
                    if dst == rank:
                        self.inc[src], ch.peer = ch, link.ranks[src]
        self.stats = {"bytes_sent": 0, "bytes_recv": 0, "messages_sent": 0,
                      "bytes_sent_inter": 0, "messages_sent_inter": 0,
                      "seconds": 0.0}        # in synchronous calls (group.py's CallScope)

    @staticmethod
    def nbytes(size: int, nslots: int, slot_bytes: int) -> int:
        """Arena bytes of a group's mailboxes: size*(size-1) channels."""
        return size * (size - 1) * Channel.nbytes(nslots, slot_bytes)

    # --- one chunk at a time ---
    @staticmethod
    def _can_push(ch: Channel) -> bool:
        return ch.done - ch.tail() < ch.nslots

    def _push(self, ch: Channel, payload: np.ndarray, off: int, total: int, dtc: int) -> None:
        k = ch.done % ch.nslots
        h = ch.hdrs[k]
        h[:call.NFIELDS] = self.link.record
        h[MSG_NBYTES], h[MSG_DTYPE], h[CHUNK_OFF], h[CHUNK_NBYTES] = total, dtc, off, len(payload)
        ch.slots[k][:len(payload)] = payload
        ch.done += 1
        ch.publish(0, ch.done)
        if self.bells is not None:
            self.bells.ring(ch.peer)

    @staticmethod
    def _can_pop(ch: Channel) -> bool:
        return ch.head() > ch.done

    def _pop(self, ch: Channel, src: int, out: np.ndarray, flat: np.ndarray,
             combine: Callable | None) -> None:
        k = ch.done % ch.nslots
        h = ch.hdrs[k]
        off, n = int(h[CHUNK_OFF]), int(h[CHUNK_NBYTES])
        if off == 0 and (h[1:13].tobytes() != self.link.identity() or h[MSG_NBYTES] != out.nbytes
                         or h[MSG_DTYPE] != call.dtype_code(out.dtype)):
            self._check(h, src, out)
        if combine is None:
            flat[off:off + n] = ch.slots[k][:n]
        else:                                  # reduce straight out of the slot, no temporary
            isz = out.itemsize
            dst = out.reshape(-1)[off // isz:(off + n) // isz]
            combine(dst, ch.slots[k][:n].view(out.dtype), out=dst)
        ch.done += 1
        ch.publish(8, ch.done)
        if self.bells is not None:
            self.bells.ring(ch.peer)

    def _check(self, h: np.ndarray, src: int, out: np.ndarray) -> None:
        """A first chunk whose header differs from this call at a glance: a sendrecv's
        header carries its sender's own source and destination, which call.identity leaves
        out, so compare identities; anything else is a mismatch naming both calls."""
        mine, theirs = self.link.record, h[:call.NFIELDS]
        if call.identity(theirs) == self.link.identity() and h[MSG_NBYTES] == out.nbytes \
                and h[MSG_DTYPE] == call.dtype_code(out.dtype):
            return
        names = self.link.group_names
        raise CollectiveMismatch(
            f"{self.link.prefix} rank {src} of group '{self.link.name}' (global rank "
            f"{self.link.ranks[src]}) sent a message of "
            f"{int(h[MSG_NBYTES])} B {call.dtype_name(int(h[MSG_DTYPE]))} from call "
            f"[{call.describe(theirs, names)}] while this rank expected {out.nbytes} B "
            f"{out.dtype} in call [{call.describe(mine, names)}]. The ranks called different "
            "collectives (or the same one with different arguments) at this point.")

    def fits(self, dst: int, nbytes: int) -> bool:
        """True if a message of nbytes to dst fits in the free slots of its channel now,
        so that send() would copy it in without waiting for the receiver."""
        ch = self.out[dst]
        return not ch.inter and ch.chunks(nbytes) <= ch.nslots - (ch.done - ch.tail())

    # --- whole messages ---
    def send(self, x: np.ndarray, dst: int) -> None:
        ch, data = self.out[dst], byte_view(x)
        total, dtc, step = len(data), call.dtype_code(x.dtype), ch.slot_bytes
        hold = self._arrival(ch, total)
        for off in range(0, max(total, 1), step):
            if not self._can_push(ch):
                self._wait(lambda: self._can_push(ch), dst, "send to")
            if hold is not None and off + step >= total:      # the last chunk: not before
                time.sleep(max(0.0, hold - time.perf_counter()))   # alpha + n beta
            self._push(ch, data[off:off + step], off, total, dtc)
        self._count(total, ch)

    def recv(self, src: int, out: np.ndarray, combine: Callable | None = None) -> np.ndarray:
        ch, flat = self.inc[src], byte_view(out)
        for _ in range(ch.chunks(out.nbytes)):
            if not self._can_pop(ch):
                self._wait(lambda: self._can_pop(ch), src, "receive from")
            self._pop(ch, src, out, flat, combine)
        self.stats["bytes_recv"] += out.nbytes
        return out

    def sendrecv(self, x: np.ndarray, dst: int, src: int, out: np.ndarray,
                 combine: Callable | None = None) -> np.ndarray:
        och, ich = self.out[dst], self.inc[src]
        data, flat = byte_view(x), byte_view(out)
        total, dtc, step = len(data), call.dtype_code(x.dtype), och.slot_bytes
        offs = list(range(0, max(total, 1), step))
        n_in = ich.chunks(out.nbytes)
        hold = self._arrival(och, total)
        s = r = 0
        while s < len(offs) or r < n_in:
            moved = False
            held = hold is not None and s == len(offs) - 1 and time.perf_counter() < hold
            if s < len(offs) and not held and self._can_push(och):
                self._push(och, data[offs[s]:offs[s] + step], offs[s], total, dtc)
                s, moved = s + 1, True
            if r < n_in and self._can_pop(ich):
                self._pop(ich, src, out, flat, combine)
                r, moved = r + 1, True
            if not moved and held and self._can_push(och):   # only the held chunk is left
                time.sleep(max(0.0, hold - time.perf_counter()))   # to do: its arrival time
            elif not moved:
                def ready():
                    return ((s < len(offs) and self._can_push(och))
                            or (r < n_in and self._can_pop(ich)))
                peer = src if r < n_in else dst
                self._wait(ready, peer, "exchange with")
        self._count(total, och)
        self.stats["bytes_recv"] += out.nbytes
        return out

    def unread(self) -> list[tuple[int, np.ndarray, int]]:
        """(src, header, byte offset) of the first unreceived chunk from each sender."""
        return [(src, ch.hdrs[ch.done % ch.nslots], int(ch.hdrs[ch.done % ch.nslots][CHUNK_OFF]))
                for src, ch in self.inc.items() if ch.head() > ch.done]

    def _arrival(self, ch: Channel, nbytes: int) -> float | None:
        """perf_counter time before which a message to another node may not complete
        (alpha + n beta from now), or None inside a node."""
        return time.perf_counter() + self.nodes.delay(nbytes) if ch.inter else None

    def _count(self, nbytes: int, ch: Channel) -> None:
        self.stats["bytes_sent"] += nbytes
        self.stats["messages_sent"] += 1
        if ch.inter:
            self.stats["bytes_sent_inter"] += nbytes
            self.stats["messages_sent_inter"] += 1

    def _wait(self, ready: Callable[[], bool], peer: int, what: str) -> None:
        link = self.link
        wait_until(ready, link.watch(peer, ready, what), link.timeout, link.spin, link.bells)
