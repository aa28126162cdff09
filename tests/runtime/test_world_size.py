"""Any world size works with the default settings: the shared arena is sized from W.

Closed forms first (slot size, group region, board), then hello jobs of 32 and 64 ranks
that meet at a barrier, all-reduce and build a 2-D mesh. (Before, W >= 24 failed with
"shared arena full": a group's W(W-1) mailboxes outgrew the fixed 1 GiB per group.)
"""

import os

import numpy as np
import pytest

import minidist.collectives as C
from minidist.runtime import spawn
from minidist.runtime.group import ProcessGroup
from minidist.runtime.job import JobBoard
from minidist.runtime.mesh import DeviceMesh
from minidist.runtime.shm import Arena
from minidist.runtime.world import MAILBOX_BYTES, Job, RuntimeConfig, default_slot_bytes


@pytest.fixture
def default_env(monkeypatch):
    for var in ("MINIDIST_GROUP_BYTES", "MINIDIST_SLOT_BYTES", "MINIDIST_SLOTS",
                "MINIDIST_GROUPS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("W, slot", [(1, 1 << 19), (8, 1 << 19), (16, 1 << 19),
                                     (24, 1 << 17), (32, 1 << 17), (64, 1 << 15)])
def test_default_slot_size_shrinks_with_the_world(W, slot):
    assert default_slot_bytes(W, 4) == slot
    assert W * (W - 1) * 4 * slot <= MAILBOX_BYTES


@pytest.mark.parametrize("W", [1, 2, 3, 5, 8, 16, 17, 24, 33, 64, 100])
def test_default_regions_hold_a_world_group_and_its_data(W, default_env):
    cfg = RuntimeConfig(W)
    need = ProcessGroup.region_bytes(W, cfg.nslots, cfg.slot_bytes)
    assert cfg.group_bytes >= need + (1 << 30)              # mailboxes + 1 GiB for shared()
    assert cfg.arena_bytes() == cfg.board_bytes() + cfg.max_groups * cfg.group_bytes


@pytest.mark.parametrize("W, G", [(1, 1), (3, 64), (64, 64), (100, 7)])
def test_the_board_fits_its_bytes_exactly(W, G):
    nbytes = JobBoard.nbytes(W, G)
    arena = Arena(nbytes)
    JobBoard(arena, W, G, launcher_pid=0)                   # raises if it does not fit
    assert nbytes - 64 < arena.used <= nbytes               # exact up to the last alignment


@pytest.mark.parametrize("W", [1, 2, 5, 24])
def test_a_region_of_exactly_the_computed_bytes_holds_the_world_group(W, default_env):
    slots = RuntimeConfig(W)
    need = ProcessGroup.region_bytes(W, slots.nslots, slots.slot_bytes)
    cfg = RuntimeConfig(W, group_bytes=need, max_groups=2)
    job = Job(cfg, Arena(cfg.arena_bytes()), 0, os.getpid())   # raises if it overflows
    assert job.world.size == W
    with pytest.raises(ValueError, match=f"set it to at least {need}, or unset it"):
        RuntimeConfig(W, group_bytes=need - 64, max_groups=2)    # refused before launching


def test_settings_from_the_environment_win(monkeypatch):
    monkeypatch.setenv("MINIDIST_GROUP_BYTES", str(1 << 28))
    monkeypatch.setenv("MINIDIST_SLOT_BYTES", str(1 << 12))
    cfg = RuntimeConfig(64)
    assert (cfg.group_bytes, cfg.slot_bytes) == (1 << 28, 1 << 12)


def _hello(ctx, shape):
    y = C.all_reduce(np.full(3, float(ctx.rank)), group=ctx.world)
    C.barrier(group=ctx.world)
    mesh = DeviceMesh(ctx.job, ("dp", "tp"), shape)
    z = C.all_reduce(np.array([float(ctx.rank)]), group=mesh.group("tp"))
    return float(y[0]), float(z[0]), mesh.coords


def _check_hello(W, shape):
    out = spawn(W, _hello, shape)
    tp = shape[1]
    for r, (y, z, coords) in enumerate(out):
        assert y == W * (W - 1) / 2
        base = r - r % tp                                    # tp groups hold neighbours
        assert z == sum(range(base, base + tp))
        assert coords == {"dp": r // tp, "tp": r % tp}


@pytest.mark.multiproc
def test_a_32_rank_job_runs_with_the_defaults(default_env):
    _check_hello(32, (4, 8))


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_64_rank_job_runs_with_the_defaults(default_env):
    _check_hello(64, (8, 8))
