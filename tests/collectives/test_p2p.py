"""Public send / recv: numbered like collectives, so a wrong message is named, a missing one
is a timeout naming the pending recv, and bad arguments fail before anything is sent."""

import time

import numpy as np
import pytest

from minidist import collectives as C
from minidist.runtime import RankFailure
from minidist.runtime import call
from minidist.runtime.launch import spawn
from tests.helpers import value_errors


def _pair(ctx):
    g = ctx.world
    if g.rank == 0:
        w = C.send(np.arange(6.0).reshape(2, 3), 1, group=g, tag=3, async_op=True)
        C.send(np.ones(4, np.int32), 1, group=g, tag=4)
        w.wait()
        return g.stats["bytes_sent"]
    a = C.recv(np.empty((2, 3)), 0, group=g, tag=3)
    b = C.recv(np.empty(4, np.int32), 0, group=g, tag=4)
    return a.tolist(), b.tolist(), g.stats["bytes_recv"]


@pytest.mark.multiproc
def test_send_and_recv_deliver_in_order_and_count_bytes():
    sent, (a, b, received) = spawn(2, _pair)
    assert a == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and b == [1, 1, 1, 1]
    assert sent == received == 48 + 16


def _eager_then_queued(ctx):
    """Slots of 4 KiB x 4: 4 KiB fits (eager), 20 KiB cannot until the receiver drains."""
    g = ctx.world
    if g.rank == 0:
        small = C.send(np.full(512, 1.0), 1, group=g, tag=1, async_op=True)
        eager = small.is_completed()                 # done before the receiver even looks
        big = C.send(np.full(2560, 2.0), 1, group=g, tag=2, async_op=True)
        behind = C.send(np.full(512, 3.0), 1, group=g, tag=3, async_op=True)
        queued = (big.is_completed(), behind.is_completed())   # the receiver sleeps yet
        small.wait(), big.wait(), behind.wait()
        return eager, queued
    time.sleep(0.3)
    return [float(C.recv(np.empty(n), 0, group=g, tag=t).sum())
            for n, t in ((512, 1), (2560, 2), (512, 3))]


@pytest.mark.multiproc
def test_an_async_send_that_fits_is_eager_and_one_queued_behind_keeps_its_order(monkeypatch):
    monkeypatch.setenv("MINIDIST_SLOT_BYTES", "4096")
    monkeypatch.setenv("MINIDIST_SLOTS", "4")
    (eager, queued), sums = spawn(2, _eager_then_queued)
    assert eager is True and queued == (False, False)
    assert sums == [512.0, 5120.0, 1536.0]


def _wrong_tag(ctx):
    g = ctx.world
    if g.rank == 0:
        C.send(np.ones(2), 1, group=g, tag=5)
        C.recv(np.empty(1), 1, group=g, tag=9)      # wait: rank 1's mismatch is the first
    else:                                            # failure, not an unread message here
        C.recv(np.empty(2), 0, group=g, tag=4)


@pytest.mark.multiproc
def test_a_message_with_another_tag_is_a_mismatch_naming_both():
    with pytest.raises(RankFailure) as info:      # found by the receiver, in the message
        spawn(2, _wrong_tag)                      # header or while it waits for it
    assert info.value.rank == 1
    text = str(info.value).splitlines()[1]
    assert text.startswith("  CollectiveMismatch: [rank 1/2]")
    assert "send #1 on 'world' (float64 (2,), group rank 0 -> 1, tag 5)" in text
    assert "recv #1 on 'world' (float64 (2,), group rank 0 -> 1, tag 4)" in text


def _nobody_sends(ctx):
    if ctx.rank == 1:
        C.recv(np.empty(2), 0, group=ctx.world, tag=7)


@pytest.mark.multiproc
def test_a_recv_nobody_answers_times_out_naming_it(monkeypatch):
    monkeypatch.setenv("MINIDIST_TIMEOUT", "2")
    with pytest.raises(Exception, match=r"recv #1 on 'world' \(float64 \(2,\), group rank "
                                        r"0 -> 1, tag 7\)"):
        spawn(2, _nobody_sends)


def _bad_arguments(ctx):
    g = ctx.world
    if g.rank == 1:
        return []
    return value_errors(lambda: C.send(np.ones(2), 0, group=g),
                        lambda: C.send(np.ones(2), 2, group=g),
                        lambda: C.send(np.ones(2), 1, group=g, tag=-1),
                        lambda: C.recv(np.ones((2, 2)).T, 1, group=g))


@pytest.mark.multiproc
def test_bad_peers_tags_and_buffers_are_refused():
    errors = spawn(2, _bad_arguments)[0]
    assert len(errors) == 4
    assert "another rank" in errors[0] and "0..1" in errors[1] and "tag" in errors[2]
    assert "C-contiguous" in errors[3]


def test_a_recv_record_matches_the_send_it_expects():
    x = np.zeros((2, 3))
    s = call.pack(4, 9, "send", x, p2p=(0, 1, 3))
    r = call.pack(4, 9, "recv", x, p2p=(0, 1, 3))
    assert call.same_call(s, r) and not call.same_call(s, call.pack(4, 9, "recv", x,
                                                                    p2p=(0, 1, 2)))
    assert call.describe(r, {4: "pp0"}) == \
        "recv #9 on 'pp0' (float64 (2, 3), group rank 0 -> 1, tag 3)"
