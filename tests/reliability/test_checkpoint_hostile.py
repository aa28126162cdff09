"""A checkpoint directory that someone else wrote into cannot be turned against the machine.

Every test plants something (a link at every level, pointer tricks, huge shapes and sizes,
devices, FIFOs, deep nesting, a full disk) and checks three things: nothing outside the
directory is read or written, memory stays bounded, and the newest intact checkpoint is
the one used (or the save refuses in one line, naming the file and the check).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tracemalloc

import numpy as np
import pytest

from minidist.reliability import checkpoint as ckpt
from minidist.reliability import confined
from minidist.reliability.checkpoint import (CheckpointError, CheckpointState,
                                             CheckpointStorageError, latest, load, save)
from minidist.reliability.checkpoint_format import MAX_MANIFEST, _checksum


def _state(step: int) -> CheckpointState:
    rng = np.random.default_rng(step)
    return CheckpointState(step, {"w": rng.standard_normal((4, 3)), "b": np.arange(5.0)},
                           {"step": step, "m.0": rng.standard_normal((4, 3))}, {}, {},
                           [1.0] * step, {"run": {"lr": 0.1}})


def _outside(tmp_path):
    """A directory outside the checkpoint root with files an attacker wants destroyed."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("precious\n")
    (out / "secret").write_text("root:x:0:0:root:/root:/bin/bash\n")
    return out


def _snapshot(path):
    """Every file below `path` with its bytes: what must not change."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


_PEAK = [0]


def _peak(fn, *args):
    """(fn(*args), the most bytes Python allocated meanwhile); the peak is also left in
    _PEAK[0] when fn raises."""
    tracemalloc.start()
    try:
        out = fn(*args)
    finally:
        _PEAK[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, _PEAK[0]


def _two_checkpoints(root):
    for step in (1, 2):
        save(_state(step), root)
    return root / "step00000001", root / "step00000002"


# --- saving into a hostile directory -------------------------------------------------------

def test_planted_links_at_the_old_temporary_names_are_never_followed(tmp_path):
    """Finding 1: .tmp-step00000002 linked to a directory and .tmp-latest to a file made
    a save empty the directory and overwrite the file. Now temporary names carry a random
    token, and the commit removes stale .tmp-* names without following them."""
    out, root = _outside(tmp_path), tmp_path / "ck"
    root.mkdir()
    before = _snapshot(out)
    for name, target in [(".tmp-step00000002", out), (".tmp-latest", out / "keep.txt"),
                         (".tmp-manifest.json", out / "secret"),
                         (".tmp-discard-step00000001", out)]:
        (root / name).symlink_to(target)
    for step in (1, 2, 3):
        save(_state(step), root, keep=1)
    assert _snapshot(out) == before
    assert sorted(os.listdir(root)) == ["latest", "step00000003"]


def test_a_link_at_the_save_s_own_temporary_name_is_refused(tmp_path):
    """Even a guessed token (given here) meets O_NOFOLLOW: the save refuses, in one line,
    as an error no restart can fix, and writes nothing outside."""
    out, root = _outside(tmp_path), tmp_path / "ck"
    root.mkdir()
    before = _snapshot(out)
    (root / ".tmp-step00000001-guessedtoken").symlink_to(out)
    with pytest.raises(CheckpointStorageError, match="symbolic link") as info:
        save(_state(1), root, token="guessedtoken")
    assert "\n" not in str(info.value) and "a restart cannot fix this" in str(info.value)
    assert _snapshot(out) == before


def test_links_named_latest_or_like_a_step_are_replaced_not_followed(tmp_path):
    out, root = _outside(tmp_path), tmp_path / "ck"
    root.mkdir()
    before = _snapshot(out)
    (root / "latest").symlink_to(out / "keep.txt")
    (root / "step00000001").symlink_to(out)
    save(_state(1), root)
    assert _snapshot(out) == before
    assert not (root / "latest").is_symlink() and not (root / "step00000001").is_symlink()
    assert latest(root).step == 1


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o077, 0o600, 0o700),
                                                        (0o022, 0o644, 0o755)])
def test_permissions_are_no_wider_than_the_umask_gives(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        path = save(_state(1), tmp_path / "ck")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == dir_mode
    for p in [*path.iterdir(), tmp_path / "ck" / "latest"]:
        assert stat.S_IMODE(p.stat().st_mode) == file_mode, p


def test_disk_full_is_one_line_keeps_the_previous_checkpoint_and_removes_the_partial_save(
        tmp_path, monkeypatch):
    """Finding 7: ENOSPC while writing the rank file. One line that says a restart cannot
    fix it and which checkpoint is latest; the partial temporary directory is gone."""
    root = tmp_path / "ck"
    save(_state(1), root)
    real = confined.write_all
    calls = []

    def full(fd, data):
        calls.append(len(memoryview(data).cast("B")))
        if len(calls) == 2:                       # the header went in; the first piece not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)
    monkeypatch.setattr(confined, "write_all", full)
    with pytest.raises(CheckpointStorageError) as info:
        save(_state(2), root)
    text = str(info.value)
    assert "\n" not in text and "No space left on device" in text, text
    assert "free space" in text and "the latest checkpoint is still step 1" in text, text
    assert sorted(os.listdir(root)) == ["latest", "step00000001"]       # no .tmp-* left
    monkeypatch.setattr(confined, "write_all", real)
    with pytest.raises(CheckpointStorageError, match="no checkpoint was committed yet"):
        monkeypatch.setattr(confined, "write_all", full)
        calls.clear()
        save(_state(1), tmp_path / "empty")
    monkeypatch.setattr(confined, "write_all", real)
    assert latest(root).step == 1 and save(_state(2), root) == root / "step00000002"


def test_an_unknown_entry_in_the_save_s_own_directory_stops_the_commit(tmp_path):
    """The temporary directory is new and unguessable: anything in it that no writer made
    is tampering, refused rather than removed (a commit removes only what it made)."""
    root = tmp_path / "ck"
    phases = []

    def plant(name):
        phases.append(name)
        if name == "marker_written":
            (next(root.glob(".tmp-step*")) / "extra.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="'extra.bin', which no writer of this save made"):
        save(_state(1), root, on_phase=plant)


# --- loading from a hostile directory ------------------------------------------------------

def _copy_outside(step_dir, out):
    """A valid copy of a checkpoint directory, outside the root."""
    copy = out / step_dir.name
    copy.mkdir()
    for p in step_dir.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    return copy


@pytest.mark.parametrize("what", ["rank file", "manifest", "step directory"])
def test_a_linked_file_or_step_directory_is_refused_and_the_older_one_used(tmp_path, what):
    """Finding 2: a symlinked rank file, manifest or step directory was accepted (a run
    silently resumed from an outside copy)."""
    out, root = _outside(tmp_path), tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    copy = _copy_outside(newest, out)
    if what == "step directory":
        for p in newest.iterdir():
            p.unlink()
        newest.rmdir()
        newest.symlink_to(copy)
    else:
        name = "manifest.json" if what == "manifest" else "rank00000.safetensors"
        (newest / name).unlink()
        (newest / name).symlink_to(copy / name)
    found = latest(root)
    assert found.step == 1, found
    assert "step00000002" in found.skipped[-1] or "step00000002" in " ".join(found.skipped)
    with pytest.raises(CheckpointError):
        load(newest)


def test_latest_linked_outside_is_refused_and_its_content_never_shown(tmp_path):
    """Finding 2: `latest` linked to /etc/passwd put its first 40 characters in the log;
    linked to an older step outside, it rolled the run back."""
    out, root = _outside(tmp_path), tmp_path / "ck"
    _two_checkpoints(root)
    (out / "pointer").write_text("step00000001\n")
    for target in (out / "secret", out / "pointer", "/dev/zero"):
        (root / "latest").unlink()
        (root / "latest").symlink_to(target)
        found = latest(root)
        assert found.step == 2, (target, found)                 # the newest real one
        notes = " ".join(found.skipped)
        assert "symbolic link" in notes and "root:x" not in notes, notes


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "directory"])
def test_a_manifest_that_is_a_device_a_fifo_or_a_directory_is_refused_at_once(tmp_path,
                                                                              target):
    """Finding 3: a manifest linked to /dev/zero was read until memory ran out."""
    root = tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    (newest / "manifest.json").unlink()
    if target == "fifo":
        os.mkfifo(newest / "manifest.json")         # an open without O_NONBLOCK would hang
    elif target == "directory":
        (newest / "manifest.json").mkdir()
    else:
        (newest / "manifest.json").symlink_to(target)
    found = latest(root)
    assert found.step == 1 and "manifest.json" in found.skipped[0], found


def test_a_huge_manifest_or_pointer_is_refused_by_its_size_without_reading_it(tmp_path):
    root = tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    os.truncate(newest / "manifest.json", MAX_MANIFEST + 1)      # sparse: no disk used
    found, peak = _peak(latest, root)
    assert found.step == 1 and "more than the" in found.skipped[0], found
    assert peak < 4 << 20, f"{peak} bytes allocated to refuse a {MAX_MANIFEST} byte file"
    os.truncate(root / "latest", 1 << 30)
    found = latest(root)
    assert found.step == 1 and found.skipped[0].startswith("latest: unreadable"), found


def _rewrite_manifest(step_dir, edit):
    """Change the manifest with `edit(body)` and give it a valid checksum again (what an
    attacker can do: the checksum guards against accidents, not against malice)."""
    body = json.loads((step_dir / "manifest.json").read_bytes())
    body.pop("checksum")
    edit(body)
    (step_dir / "manifest.json").write_text(json.dumps({**body, "checksum": _checksum(body)}))


@pytest.mark.parametrize("edit, check", [
    (lambda b: b["tensors"]["params/w"].update(shape=[2 ** 40]), "pieces of 'params/w' cover"),
    (lambda b: b["tensors"]["params/w"].update(shape=[2 ** 62, 2 ** 62]), "cover"),
    (lambda b: b["tensors"]["params/w"].update(shape=[-1, 12]), "shape"),
    (lambda b: b["tensors"]["params/w"].update(shape=[True, 12]), "shape"),
    (lambda b: b["tensors"]["params/w"].update(dtype="O"), "not a safetensors dtype"),
    (lambda b: b["tensors"]["params/w"]["pieces"][0].update(range=[0, 2 ** 40]),
     "is missing or has another dtype or shape"),
    (lambda b: b["files"].update({"../../outside/secret": {"size": 1, "header_sha256": ""}}),
     "not a rank file name"),
    (lambda b: b.update(state=[[[[[[]]]]]]), "malformed"),
])
def test_shapes_dtypes_and_byte_counts_are_checked_before_anything_is_allocated(
        tmp_path, edit, check):
    """Finding 3: a manifest shape of [2**40] made the loader allocate 4 TiB."""
    root = tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    _rewrite_manifest(newest, edit)
    with pytest.raises(CheckpointError, match=check):
        _peak(load, newest)
    assert _PEAK[0] < 4 << 20, f"{_PEAK[0]} bytes allocated"
    assert latest(root).step == 1


def test_a_sparsely_grown_rank_file_is_refused_by_its_size_before_it_is_read(tmp_path):
    """Finding 3: a rank file grown sparsely to 1.5 GiB was read whole before its size
    was checked."""
    root = tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    os.truncate(newest / "rank00000.safetensors", 3 << 29)
    found, peak = _peak(latest, root)
    assert found.step == 1 and "size check failed" in found.skipped[0], found
    assert peak < 4 << 20, f"{peak} bytes allocated"


def test_deep_nesting_in_the_manifest_is_refused(tmp_path):
    root = tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    (newest / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    found = latest(root)
    assert found.step == 1 and "not a valid manifest" in found.skipped[0], found


def test_any_failure_to_load_the_newest_falls_back_to_the_previous(tmp_path, monkeypatch):
    """Finding 3: latest() caught only CheckpointError, so a MemoryError ended `train`
    with a traceback instead of using the intact older checkpoint."""
    root = tmp_path / "ck"
    _, newest = _two_checkpoints(root)
    real = ckpt.load

    def flaky(path):
        if path == newest:
            raise MemoryError("Unable to allocate 4.00 TiB")
        return real(path)
    monkeypatch.setattr(ckpt, "load", flaky)
    found = latest(root)
    assert found.step == 1
    assert found.skipped == ("step00000002: MemoryError: Unable to allocate 4.00 TiB",)
