"""Checkpointing: the run's global state, written in pieces, committed atomically, verified.

This module saves and finds checkpoints; what a checkpoint holds, byte by byte, and `load`,
which reads one back, are in checkpoint_format.py (its public names are re-exported here).

Crash safety comes from ordering, not locks. Every file is written under a temporary name
and made durable (fsync) before the rename that publishes it; a rename within a directory
is atomic on POSIX file systems. The commit point is the replacement of `D/latest`: before
it the previous checkpoint is the current one, after it the new one. What a crash leaves
behind (a `.tmp-*` entry; a finished `step*` directory newer than what `latest` names) is
ignored by the reader and removed by the next save. One job writes into a root at a time.

Safety against the directory itself: whoever can write into D may have planted links or
files there. Every access below D goes through reliability/confined.py: no link is ever
followed (O_NOFOLLOW, lstat), files are created exclusively, and the save's temporary
names carry a random token shared by its writers (`token`: the launcher draws one per
attempt), so none can be planted in advance. Removing a stale `.tmp-*` entry or an old
step directory unlinks the name itself, never what a link points at; inside its own
temporary directory a commit removes nothing and refuses anything no writer made.

One rank's view (rank r of W writers, `save(state, D, rank=r, world=W, barrier=b, token=t)`):
    1. write rank{r:05d}.safetensors into D/.tmp-step{N:08d}-{t}/ (header, then piece r of
       every array; fsync), then its done marker rank{r:05d}.done.json (size and sha256 of
       the file and of each piece; temp name, fsync, rename)
    2. barrier: every writer's file is durable
    3. rank 0 only: check each marker and file size, and that the directory holds nothing
       else; write manifest.json (temp, fsync, rename); fsync; rename the directory to
       D/step{N:08d}; fsync D; write D/latest (temp, fsync, os.replace, fsync D) <- the
       commit point; keep the newest `keep` checkpoints, remove stale `.tmp-*` entries and
       step directories `latest` disowns
    4. barrier: every rank returns after the commit
A failure a restart cannot fix (disk full, no permission, a planted link) raises
CheckpointStorageError, one line saying what would fix it and which checkpoint is still
the latest, and removes the save's temporary directory at once.

Asynchronous saving (snapshot now, write behind): reliability/async_checkpoint.py.

Communication: two barriers per save (writers' group), no array data between ranks.
Cost: each writer writes ~S/W bytes (S the checkpoint size); rank 0 also the manifest.
`latest` reads and checks all S bytes of the checkpoint it returns; `load` reads them again.

References:
    fsync and rename -- Pillai et al. 2014, "All File Systems Are Not Created Equal", OSDI.
Read next: reliability/checkpoint_format.py, reliability/confined.py,
    reliability/async_checkpoint.py
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minidist.reliability import confined
from minidist.reliability.checkpoint_format import (FORMAT, STEP_DIR, VERSION, CheckpointError,
                                                    CheckpointState, load, manifest_bytes,
                                                    rank_file, rank_file_parts, sha256_hex,
                                                    state_meta, state_tensors, step_name)

__all__ = ["FORMAT", "VERSION", "PHASES", "CheckpointError", "CheckpointStorageError",
           "CheckpointState", "Found", "save", "latest", "load"]
# The moments a save passes, in order; `on_phase(name)` is called at each (for timing, and
# to inject a crash in tests and in faults.py). The first four run on every writer.
PHASES = ("tmp_dir_created", "rank_file_partial", "rank_file_written", "marker_written",
          "files_checked", "manifest_tmp_written", "manifest_written", "dir_renamed",
          "latest_partial", "latest_replaced", "retention_removing")


@dataclass(frozen=True)
class Found:
    """What `latest` found: a verified checkpoint directory, and why newer ones were skipped."""
    path: Path
    step: int
    skipped: tuple[str, ...] = ()


def no_op(*_: Any) -> None:
    """The default `on_phase`: does nothing."""
    return None


def _marker_file(r: int) -> str:
    return f"rank{r:05d}.done.json"


def tmp_name(step: int, token: str) -> str:
    """The temporary directory of the save of `step`: unguessable (the writers' shared
    random token), so nothing can be planted under its name before the save makes it."""
    return f".tmp-{step_name(step)}-{token}"


def _write_atomic(dir_fd: int, name: str, data: bytes, where: Path, phase: Callable,
                  partial: str = "", written: str = "") -> None:
    """Write `data` to a new file under a random temporary name, fsync, rename it onto
    `name` (a link named `name` is replaced, never followed), fsync the directory."""
    tmp = f".tmp-{name}-{confined.token()}"
    half = len(data) // 2 if partial else len(data)
    fd = confined.create(dir_fd, tmp, where.with_name(tmp))
    try:
        confined.write_all(fd, data[:half])
        if partial:
            phase(partial)
        confined.write_all(fd, data[half:])
        os.fsync(fd)
    finally:
        os.close(fd)
    if written:
        phase(written)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _discard(root_fd: int, root: Path, names: list[str], token: str,
             phase: Callable = no_op) -> None:
    """Remove step directories: first rename to a .tmp-* name (so a crash never leaves
    half a step directory), then delete (nothing is followed: confined.remove)."""
    for name in names:
        aside = f".tmp-discard-{name}-{token}"
        os.rename(name, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        phase("retention_removing")
        confined.remove(root_fd, aside, root / aside)


def _step_entries(listing: list[tuple[str, int]]) -> list[tuple[int, str, bool]]:
    """(step, name, is a real directory) of every step* entry of a root's listing
    (confined.entries), newest first; links and files named like step directories are
    listed as not directories."""
    found = [(int(m.group(1)), name, stat.S_ISDIR(mode)) for name, mode in listing
             if (m := STEP_DIR.fullmatch(name))]
    return sorted(found, reverse=True)


def _pointer(root_fd: int, root: Path) -> tuple[int | None, str]:
    """The step `latest` names (None if it names none), and a note when it is unusable.
    `latest` is read as a confined file of at most 64 bytes: a link is refused."""
    try:
        text = confined.read_bounded(root_fd, "latest", root / "latest", 64).decode().strip()
    except FileNotFoundError:
        return None, "latest: missing (no save has committed, or it was deleted)"
    except (OSError, UnicodeDecodeError) as e:
        return None, f"latest: unreadable ({' '.join(str(e).split())})"
    m = STEP_DIR.fullmatch(text)
    return (int(m.group(1)), "") if m else (None, f"latest: holds {text[:40]!r}, not a step name")


PERMANENT = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space (a quota)",
             errno.EROFS: "choose a writable --checkpoint-dir",
             errno.EACCES: "fix the directory's permissions or choose another one",
             errno.EPERM: "fix the directory's permissions or choose another one",
             errno.ENOTDIR: "give a directory, not a file",
             errno.EEXIST: "remove what someone else put there",
             errno.ELOOP: "remove the link someone planted there"}


class CheckpointStorageError(CheckpointError):
    """A save failed for a reason a restart cannot fix (disk full, no permission, a path
    that is not a directory, a planted link): recovery does not retry it."""


@contextmanager
def storage_errors(where: str, root: Path):
    """Turn an OSError (disk full, permissions ...) into a one-line CheckpointError that
    says where, what would fix it, and which checkpoint is still the latest."""
    try:
        yield
    except OSError as e:
        step = _committed(root)
        still = "no checkpoint was committed yet" if step is None else \
            f"the latest checkpoint is still step {step}"
        text = " ".join((e.strerror or str(e)).split())
        if isinstance(e, confined.Refused) or e.errno in PERMANENT:
            fix = "refusing to write through it" if isinstance(e, confined.Refused) else \
                PERMANENT[e.errno]
            raise CheckpointStorageError(f"{where}: {text}; a restart cannot fix this: "
                                         f"{fix}, then run again ({still})") from None
        raise CheckpointError(f"{where}: {text}; {still}") from e


def _committed(root: Path) -> int | None:
    """The step `latest` names now, or None (never raises: used while reporting)."""
    try:
        fd = confined.open_root(root)
    except OSError:
        return None
    try:
        return _pointer(fd, root)[0]
    finally:
        os.close(fd)


def _open_root(root: Path) -> int:
    """A descriptor of the checkpoint root, made if missing."""
    root.mkdir(parents=True, exist_ok=True)
    return confined.open_root(root)


def abandon(root: Path, tmp: str) -> None:
    """Remove a failed save's temporary directory at once (best effort, nothing followed)."""
    try:
        fd = confined.open_root(root)
    except OSError:
        return
    try:
        confined.remove(fd, tmp, root / tmp)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_pieces(fd: int, head: bytes, pieces: dict[str, np.ndarray],
                  phase: Callable) -> tuple[str, dict[str, str]]:
    """Write the header, then the pieces, to the new file `fd`; fsync; return the sha256
    of the header and of each piece, hashed as they are written (each byte once: together
    they cover the whole file). "rank_file_partial" fires before the middle piece (after
    the header if there are none)."""
    digests = {}
    confined.write_all(fd, head)
    for i, (name, piece) in enumerate(pieces.items()):
        if i == len(pieces) // 2:
            phase("rank_file_partial")    # a crash here leaves a truncated file
        confined.write_all(fd, piece.view(np.uint8) if piece.size else b"")
        digests[name] = sha256_hex(piece)
    if len(pieces) == 0:
        phase("rank_file_partial")
    os.fsync(fd)
    return sha256_hex(head), digests


def write_rank_file(root: Path, state: CheckpointState, rank: int, world: int,
                     phase: Callable, token: str) -> None:
    """Step 1 for writer `rank`: its safetensors file of pieces, then its done marker."""
    tmp = tmp_name(state.step, token)
    root_fd = _open_root(root)
    try:
        tmp_fd = confined.make_dir(root_fd, tmp, root / tmp, exist_ok=True)
    finally:
        os.close(root_fd)
    try:
        phase("tmp_dir_created")
        head, pieces = rank_file_parts(state, rank, world)
        fd = confined.create(tmp_fd, rank_file(rank), root / tmp / rank_file(rank))
        try:
            head_sha, piece_sha = _write_pieces(fd, head, pieces, phase)
        finally:
            os.close(fd)
        phase("rank_file_written")
        marker = {"step": int(state.step), "rank": rank, "writers": world,
                  "file": rank_file(rank),
                  "size": len(head) + sum(p.nbytes for p in pieces.values()),
                  "header_sha256": head_sha, "pieces": piece_sha}
        _write_atomic(tmp_fd, _marker_file(rank), json.dumps(marker).encode(),
                      root / tmp / _marker_file(rank), phase)
        phase("marker_written")
    finally:
        os.close(tmp_fd)


def _marker(tmp_fd: int, tmp: Path, r: int, step: int, world: int, names: list[str]) -> dict:
    """Rank r's done marker, checked against its file and this save."""
    where = tmp / _marker_file(r)
    try:
        m = json.loads(confined.read_bounded(tmp_fd, _marker_file(r), where, 16 << 20))
    except FileNotFoundError:
        raise CheckpointError(
            f"commit of step {step}: {where} is missing, so writer {r} never finished "
            f"{rank_file(r)}. Every rank must save at the same step with the same world "
            f"({world}); if rank {r} crashed, restart from latest()") from None
    if (m["step"], m["rank"], m["writers"], m["file"]) != (step, r, world, rank_file(r)) \
            or list(m["pieces"]) != names:
        raise CheckpointError(
            f"commit of step {step}: {where} is for step {m['step']}, rank {m['rank']} of "
            f"{m['writers']}, or other tensors: every rank must pass the same full "
            f"CheckpointState and the same world")
    fd, size = confined.open_regular(tmp_fd, m["file"], tmp / m["file"])
    os.close(fd)
    if size != m["size"]:
        raise CheckpointError(f"commit of step {step}: {tmp / m['file']} has {size} bytes, its "
                              f"marker says {m['size']}: it was cut short or overwritten")
    return m


def commit(root: Path, state: CheckpointState, world: int, keep: int | None,
            phase: Callable, token: str, spare: str = "") -> Path:
    """Step 3 (rank 0): manifest, rename, `latest`, retention, cleanup (sparing `spare`)."""
    root_fd = _open_root(root)
    try:
        return _commit_in(root_fd, root, state, world, keep, phase, token, spare)
    finally:
        os.close(root_fd)


def _commit_in(root_fd: int, root: Path, state: CheckpointState, world: int,
               keep: int | None, phase: Callable, token: str, spare: str) -> Path:
    step, names = int(state.step), [n for n, _ in state_tensors(state)]
    tmp, final = tmp_name(step, token), step_name(step)
    tmp_fd = confined.open_dir(root_fd, tmp, root / tmp)
    try:
        markers = [_marker(tmp_fd, root / tmp, r, step, world, names) for r in range(world)]
        ours = {m["file"] for m in markers} | {_marker_file(r) for r in range(world)}
        strange = [name for name, _ in confined.entries(tmp_fd) if name not in ours]
        if strange:                   # the directory is new and unguessable: tampering
            raise CheckpointError(f"commit of step {step}: {root / tmp} holds {strange[0]!r}, "
                                  f"which no writer of this save made; refusing to commit it")
        phase("files_checked")
        _write_atomic(tmp_fd, "manifest.json", manifest_bytes(state, world, markers),
                      root / tmp / "manifest.json", phase, written="manifest_tmp_written")
        phase("manifest_written")
        for r in range(world):
            os.unlink(_marker_file(r), dir_fd=tmp_fd)
        os.fsync(tmp_fd)
    finally:
        os.close(tmp_fd)
    committed = _pointer(root_fd, root)[0]      # newer entries are uncommitted leftovers
    _discard(root_fd, root, [name for s, name, _ in _step_entries(confined.entries(root_fd))
                             if s == step or (committed is not None and s > committed)], token)
    os.rename(tmp, final, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.fsync(root_fd)
    phase("dir_renamed")
    _write_atomic(root_fd, "latest", f"{final}\n".encode(), root / "latest", phase,
                  partial="latest_partial")
    phase("latest_replaced")
    done = [(s, name) for s, name, is_dir in _step_entries(confined.entries(root_fd)) if is_dir]
    _discard(root_fd, root, [name for s, name in done if s > step]
             + ([name for s, name in done if s <= step][keep:] if keep else []), token, phase)
    for name, _ in confined.entries(root_fd):   # crashed saves' leftovers (names only)
        if name.startswith(".tmp-") and name != spare:
            confined.remove(root_fd, name, root / name)
    return root / final


_TOKEN = re.compile(r"[0-9A-Za-z_-]{8,64}")


def check_writer(rank: int, world: int, keep: int | None, barrier: Any,
                  token: str | None) -> tuple[str, str]:
    """(the "[rank r/W] " prefix of this writer's errors, the save's token), or a
    ValueError for arguments that make no save."""
    if world != 1 and barrier is None:
        raise ValueError(f"checkpoint: world={world} writers need barrier= (a callable that "
                         f"returns when all of them have called it), e.g. minidist.barrier")
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int)
            and 0 <= rank < world):
        raise ValueError(f"checkpoint: need 0 <= rank < world, got rank={rank!r}, "
                         f"world={world!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"checkpoint: keep={keep!r}; keep at least 1 checkpoint (None: all)")
    if token is None and world > 1:
        raise ValueError(f"checkpoint: world={world} writers need token=, one random string "
                         f"shared by all of them (confined.token(), drawn once by the "
                         f"launcher), so that the save's temporary names cannot be guessed")
    if token is not None and not (isinstance(token, str) and _TOKEN.fullmatch(token)):
        raise ValueError(f"checkpoint: token={token!r} must be 8-64 letters, digits, - or _")
    return f"[rank {rank}/{world}] " if world > 1 else "", token or confined.token()


def save(state: CheckpointState, root: str | os.PathLike, *, rank: int = 0, world: int = 1,
         barrier: Callable[[], Any] | None = None, keep: int | None = 3,
         on_phase: Callable[[str], Any] | None = None, token: str | None = None) -> Path:
    """Save `state` as checkpoint root/step{N:08d}; return that path (steps 1-4 above).

    Every rank of the job calls it with the same full `state`, its rank, the number of
    writers `world`, a `barrier()` over them and the same random `token` (the temporary
    directory's name part; one writer draws its own). Keeps the newest `keep` checkpoints.
    Raises ValueError for a state it cannot store (before any I/O, on every rank alike),
    CheckpointStorageError for a failure a restart cannot fix (disk full, permissions, a
    planted link: the save's temporary directory is removed at once) and CheckpointError
    for any other failed write or commit.
    """
    prefix, token = check_writer(rank, world, keep, barrier, token)
    phase = on_phase or no_op
    state_meta(state)
    root, barrier = Path(root), barrier or no_op
    try:
        with storage_errors(f"{prefix}saving step {state.step} into {root}", root):
            write_rank_file(root, state, rank, world, phase, token)
            barrier()
            if rank == 0:
                commit(root, state, world, keep, phase, token)
    except CheckpointStorageError:
        abandon(root, tmp_name(int(state.step), token))
        raise
    barrier()
    return root / step_name(int(state.step))


def latest(root: str | os.PathLike) -> Found | None:
    """The newest complete checkpoint under `root`, verified (every byte read and checked).

    Starts at the directory `latest` names; one that fails any check, or whose load fails
    in any way (a MemoryError, an OSError ...), is skipped for the next older one, and each
    skip is noted in `Found.skipped`, one line naming the file and the check. Nothing below
    `root` is followed: a `latest` or step directory that is a link is refused (noted); a
    step directory newer than `latest` is an uncommitted leftover (noted, never used).
    Returns None when nothing was ever committed; raises CheckpointError when checkpoints
    exist but none is intact.
    """
    root = Path(root)
    try:
        root_fd = confined.open_root(root)
    except OSError:
        return None
    try:
        listing = confined.entries(root_fd)
        entries = _step_entries(listing)
        named, note = _pointer(root_fd, root)
    finally:
        os.close(root_fd)
    has_latest = any(name == "latest" for name, _ in listing)
    skipped = [note] if note and (entries or has_latest) else []
    skipped += [f"{name}: a symbolic link or a file, not a checkpoint directory: ignored"
                for _, name, is_dir in entries if not is_dir]
    dirs = [(s, name) for s, name, is_dir in entries if is_dir]
    if named is not None:
        skipped += [f"{name}: newer than what `latest` names, so a save that crashed "
                    f"before its commit: ignored" for s, name in dirs if s > named]
        if not any(s == named for s, _ in dirs):
            skipped.append(f"{step_name(named)}: named by `latest` but missing")
        dirs = [(s, name) for s, name in dirs if s <= named]
    for step, name in dirs:
        try:
            load(root / name)
            return Found(root / name, step, tuple(skipped))
        except CheckpointError as e:
            skipped.append(f"{name}: {e}")
        except Exception as e:           # MemoryError, OSError ...: fall back all the same
            skipped.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    if skipped:
        raise CheckpointError(f"{root}: no intact checkpoint: " + "; ".join(skipped)
                              + ". Restore from a backup, or remove the directory to start over")
    return None
