"""Checkpointing: the run's global state, written in pieces, committed atomically, verified.

This module saves and finds checkpoints; what a checkpoint holds, byte by byte, and `load`,
which reads one back, are in checkpoint_format.py (its public names are re-exported here).

Crash safety comes from ordering, not locks. Every file is written under a temporary name
and made durable (fsync) before the rename that publishes it; a rename within a directory
is atomic on POSIX file systems. The commit point is the replacement of `D/latest`: before
it the previous checkpoint is the current one, after it the new one. What a crash leaves
behind (a `.tmp-*` entry; a finished `step*` directory newer than what `latest` names) is
ignored by the reader and removed by the next save. One job writes into a root at a time.

One rank's view (rank r of W writers, `save(state, D, rank=r, world=W, barrier=b)`):
    1. write rank{r:05d}.safetensors into D/.tmp-step{N:08d}/ (header, then piece r of
       every array; flush, fsync), then its done marker rank{r:05d}.done.json (size and
       sha256 of the file and of each piece; temp name, fsync, rename)
    2. barrier: every writer's file is durable
    3. rank 0 only: check each marker and file size; write manifest.json (temp, fsync,
       rename); fsync; rename the directory to D/step{N:08d}; fsync D; write D/latest
       (temp, fsync, os.replace, fsync D) <- the commit point; keep the newest `keep`
       checkpoints, remove stale `.tmp-*` entries and step directories `latest` disowns
    4. barrier: every rank returns after the commit

Asynchronous saving (snapshot now, write behind): reliability/async_checkpoint.py.

Communication: two barriers per save (writers' group), no array data between ranks.
Cost: each writer writes ~S/W bytes (S the checkpoint size); rank 0 also the manifest.
`latest` reads and checks all S bytes of the checkpoint it returns; `load` reads them again.

References:
    fsync and rename -- Pillai et al. 2014, "All File Systems Are Not Created Equal", OSDI.
Read next: reliability/checkpoint_format.py, reliability/async_checkpoint.py
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minidist.reliability.checkpoint_format import (_STEP_DIR, FORMAT, VERSION, CheckpointError,
                                                    CheckpointState, _manifest, _meta, _rank_file,
                                                    _rank_file_parts, _sha, _step_name, _tensors,
                                                    load)

__all__ = ["FORMAT", "VERSION", "PHASES", "CheckpointError", "CheckpointState", "Found", "save",
           "AsyncCheckpointer", "latest", "load"]     # AsyncCheckpointer: async_checkpoint.py
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


def _no_op(*_: Any) -> None:
    return None


def _marker_file(r: int) -> str:
    return f"rank{r:05d}.done.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, phase: Callable, partial: str = "",
                  written: str = "") -> None:
    """Write `data` to a temporary name, fsync, rename onto `path`, fsync the directory."""
    tmp = path.with_name(".tmp-" + path.name)
    half = len(data) // 2 if partial else len(data)
    with open(tmp, "wb") as f:
        f.write(data[:half])
        if partial:
            f.flush()
            phase(partial)
        f.write(data[half:])
        f.flush()
        os.fsync(f.fileno())
    if written:
        phase(written)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _discard(root: Path, dirs: list[Path], phase: Callable = _no_op) -> None:
    """Remove step directories: first rename to .tmp-* (so a crash never leaves half a
    step directory), then delete."""
    for d in dirs:
        aside = root / f".tmp-discard-{d.name}"
        os.rename(d, aside)
        phase("retention_removing")
        _remove(aside)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step* directory, newest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def _pointer(root: Path) -> tuple[int | None, str]:
    """The step `latest` names (None if it names none), and a note when it is unusable."""
    try:
        text = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None, "latest: missing (no save has committed, or it was deleted)"
    except (OSError, UnicodeDecodeError) as e:
        return None, f"latest: unreadable ({e})"
    m = _STEP_DIR.fullmatch(text)
    return (int(m.group(1)), "") if m else (None, f"latest: holds {text[:40]!r}, not a step name")


@contextmanager
def _errors(where: str):
    """Turn an OSError (disk full, permissions ...) into a CheckpointError that says where."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"{where}: {e}. Free space or fix permissions, then save "
                              f"again; the previous checkpoint is still the latest") from e


def _write_pieces(path: Path, head: bytes, pieces: dict[str, np.ndarray],
                  phase: Callable) -> tuple[str, dict[str, str]]:
    """Write the header, then the pieces, to `path`; fsync; return the sha256 of the header
    and of each piece, hashed as they are written (each byte once: together they cover the
    whole file). "rank_file_partial" fires before the middle piece (after the header if
    there are none)."""
    digests = {}
    with open(path, "wb") as f:
        f.write(head)
        for i, (name, piece) in enumerate(pieces.items()):
            if i == len(pieces) // 2:
                f.flush()
                phase("rank_file_partial")    # a crash here leaves a truncated file
            f.write(piece)
            digests[name] = _sha(piece)
        if len(pieces) == 0:
            phase("rank_file_partial")
        f.flush()
        os.fsync(f.fileno())
    return _sha(head), digests


def _write_rank_file(root: Path, state: CheckpointState, rank: int, world: int,
                     phase: Callable) -> None:
    """Step 1 for writer `rank`: its safetensors file of pieces, then its done marker."""
    tmp = root / f".tmp-{_step_name(state.step)}"
    tmp.mkdir(parents=True, exist_ok=True)
    phase("tmp_dir_created")
    head, pieces = _rank_file_parts(state, rank, world)
    path = tmp / _rank_file(rank)
    head_sha, piece_sha = _write_pieces(path, head, pieces, phase)
    phase("rank_file_written")
    marker = {"step": int(state.step), "rank": rank, "writers": world, "file": path.name,
              "size": len(head) + sum(p.nbytes for p in pieces.values()),
              "header_sha256": head_sha, "pieces": piece_sha}
    _write_atomic(tmp / _marker_file(rank), json.dumps(marker).encode(), phase)
    phase("marker_written")


def _marker(tmp: Path, r: int, step: int, world: int, names: list[str]) -> dict:
    """Rank r's done marker, checked against its file and this save."""
    try:
        m = json.loads((tmp / _marker_file(r)).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(
            f"commit of step {step}: {tmp / _marker_file(r)} is missing, so writer {r} never "
            f"finished {_rank_file(r)}. Every rank must save at the same step with the same "
            f"world ({world}); if rank {r} crashed, restart from latest()") from None
    if (m["step"], m["rank"], m["writers"]) != (step, r, world) or list(m["pieces"]) != names:
        raise CheckpointError(
            f"commit of step {step}: {tmp / _marker_file(r)} is for step {m['step']}, rank "
            f"{m['rank']} of {m['writers']}, or other tensors: every rank must pass the same "
            f"full CheckpointState and the same world")
    size = (tmp / m["file"]).stat().st_size if (tmp / m["file"]).is_file() else None
    if size != m["size"]:
        raise CheckpointError(f"commit of step {step}: {tmp / m['file']} has {size} bytes, its "
                              f"marker says {m['size']}: it was cut short or overwritten")
    return m


def _commit(root: Path, state: CheckpointState, world: int, keep: int | None,
            phase: Callable, spare: str = "") -> Path:
    """Step 3 (rank 0): manifest, rename, `latest`, retention, cleanup (sparing `spare`)."""
    step, names = int(state.step), [n for n, _ in _tensors(state)]
    tmp, final = root / f".tmp-{_step_name(step)}", root / _step_name(step)
    markers = [_marker(tmp, r, step, world, names) for r in range(world)]
    ours = {m["file"] for m in markers} | {_marker_file(r) for r in range(world)}
    for p in tmp.iterdir():
        if p.name not in ours:        # left by a crashed attempt at this step (another W)
            _remove(p)
    phase("files_checked")
    _write_atomic(tmp / "manifest.json", _manifest(state, world, markers), phase,
                  written="manifest_tmp_written")
    phase("manifest_written")
    for r in range(world):
        (tmp / _marker_file(r)).unlink()
    _fsync_dir(tmp)
    committed = _pointer(root)[0]     # newer directories are uncommitted leftovers
    _discard(root, [d for s, d in _step_dirs(root)
                    if s == step or (committed is not None and s > committed)])
    os.rename(tmp, final)
    _fsync_dir(root)
    phase("dir_renamed")
    _write_atomic(root / "latest", f"{final.name}\n".encode(), phase, partial="latest_partial")
    phase("latest_replaced")
    done = _step_dirs(root)
    _discard(root, [d for s, d in done if s > step]
             + ([d for s, d in done if s <= step][keep:] if keep else []), phase)
    for p in root.glob(".tmp-*"):
        if p.name != spare:
            _remove(p)
    return final


def _check_writer(rank: int, world: int, keep: int | None, barrier: Any) -> str:
    if world != 1 and barrier is None:
        raise ValueError(f"checkpoint: world={world} writers need barrier= (a callable that "
                         f"returns when all of them have called it), e.g. minidist.barrier")
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int)
            and 0 <= rank < world):
        raise ValueError(f"checkpoint: need 0 <= rank < world, got rank={rank!r}, "
                         f"world={world!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"checkpoint: keep={keep!r}; keep at least 1 checkpoint (None: all)")
    return f"[rank {rank}/{world}] " if world > 1 else ""


def save(state: CheckpointState, root: str | os.PathLike, *, rank: int = 0, world: int = 1,
         barrier: Callable[[], Any] | None = None, keep: int | None = 3,
         on_phase: Callable[[str], Any] | None = None) -> Path:
    """Save `state` as checkpoint root/step{N:08d}; return that path (steps 1-4 above).

    Every rank of the job calls it with the same full `state`, its rank, the number of
    writers `world` and a `barrier()` over them; one process uses the defaults. Keeps the
    newest `keep` checkpoints. Raises ValueError for a state it cannot store (before any
    I/O, on every rank alike) and CheckpointError for a failed write or commit.
    """
    prefix, phase = _check_writer(rank, world, keep, barrier), on_phase or _no_op
    _meta(state)
    root, barrier = Path(root), barrier or _no_op
    with _errors(f"{prefix}saving step {state.step} into {root}"):
        _write_rank_file(root, state, rank, world, phase)
        barrier()
        if rank == 0:
            _commit(root, state, world, keep, phase)
    barrier()
    return root / _step_name(int(state.step))


def latest(root: str | os.PathLike) -> Found | None:
    """The newest complete checkpoint under `root`, verified (every byte read and checked).

    Starts at the directory `latest` names; one that fails a check is skipped for the
    next older one, and each skip is noted in `Found.skipped` (a step directory newer than
    `latest` is an uncommitted leftover: noted, never used). Returns None when nothing was
    ever committed; raises CheckpointError when checkpoints exist but none is intact.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    dirs = _step_dirs(root)
    named, note = _pointer(root)
    skipped = [note] if note and (dirs or (root / "latest").exists()) else []
    if named is not None:
        skipped += [f"{d.name}: newer than what `latest` names, so a save that crashed "
                    f"before its commit: ignored" for s, d in dirs if s > named]
        dirs = [(named, root / _step_name(named))] + [(s, d) for s, d in dirs if s < named]
    for step, d in dirs:
        if not d.is_dir():
            skipped.append(f"{d.name}: named by `latest` but missing")
            continue
        try:
            load(d)
            return Found(d, step, tuple(skipped))
        except CheckpointError as e:
            skipped.append(f"{d.name}: {e}")
    if skipped:
        raise CheckpointError(f"{root}: no intact checkpoint: " + "; ".join(skipped)
                              + ". Restore from a backup, or remove the directory to start over")
    return None


def __getattr__(name: str) -> Any:
    """checkpoint.AsyncCheckpointer, from async_checkpoint.py (which builds on this module,
    so it is imported on first use rather than at the top)."""
    if name == "AsyncCheckpointer":
        from minidist.reliability.async_checkpoint import AsyncCheckpointer
        return AsyncCheckpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
