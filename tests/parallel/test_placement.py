"""Placements: shards are exact (padded) slices, unshard inverts shard, and check mode passes
tags through the autograd and raises on a placement that cannot be right."""

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.nn.module import Parameter
from minidist.parallel import placement as pl
from minidist.seed import zeros


@pytest.mark.parametrize("n, W, blocks", [(11, 2, 1), (11, 4, 1), (5, 4, 1), (12, 3, 3),
                                          (6, 1, 3), (7, 7, 1)])
def test_unshard_inverts_shard_and_padding_is_zero(n, W, blocks):
    full = np.arange(2.0 * n).reshape(2, n) + 1
    pieces = [pl.shard(full, pl.Shard(1, blocks), W, r) for r in range(W)]
    L = pl.piece_length(n, W, blocks)
    assert all(p.shape == (2, blocks * L) for p in pieces)
    assert sum(int((p == 0).sum()) for p in pieces) == 2 * (blocks * W * L - n)
    assert np.array_equal(pl.unshard(pieces, pl.Shard(1, blocks), n), full)


def test_replicated_copies_count_once():
    p = Parameter((2,), zeros())
    assert pl.placement_of(p, "tp") == pl.Replicate()
    assert [pl.owns_uniquely(p, "tp", r) for r in range(3)] == [True, False, False]
    p.placements = {"tp": pl.Shard(0)}
    assert [pl.owns_uniquely(p, "tp", r) for r in range(3)] == [True, True, True]


def test_tags_pass_through_operations_and_mixing_raises():
    was = pl.checking()
    pl.set_checking(True)
    try:
        a = pl.tag(Tensor(np.ones((2, 3))), "tp", pl.Shard(1))
        b = (a * 2.0 + 1.0).tanh()                                  # tags survive
        assert pl.placement_tag(b, "tp") == pl.Shard(1)
        pl.expect(b, "tp", pl.Shard(1), name="b", where="here")
        with pytest.raises(pl.PlacementError, match=r"here: input 'c' must be Partial\(\) "
                                                    r"over tp, but it is Replicate\(\)"):
            pl.expect(Tensor(np.ones(2)), "tp", pl.Partial(), name="c", where="here")
        partial = pl.tag(Tensor(np.ones((2, 3))), "tp", pl.Partial())
        with pytest.raises(pl.PlacementError, match=r"Add combines activations placed "
                                                    r"Shard\(1\) and Partial\(\)"):
            a + partial
    finally:
        pl.set_checking(was)


def test_check_mode_off_records_and_checks_nothing():
    was = pl.checking()
    pl.set_checking(False)
    try:
        a = pl.tag(Tensor(np.ones(2)), "tp", pl.Partial())
        assert pl.placement_tag(a, "tp") is None
        pl.expect(a, "tp", pl.Replicate(), name="a", where="off")      # no error
    finally:
        pl.set_checking(was)
