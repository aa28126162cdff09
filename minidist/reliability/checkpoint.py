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

Asynchronous saving (`AsyncCheckpointer`): `snapshot` copies the arrays at the step
boundary and a background thread does step 1 while training goes on. That thread never
calls a collective (a barrier on the training group from a second thread could interleave
with training's own calls), so the barrier of step 2 runs on the training thread, at the
next `snapshot`; rank 0's thread then does the commit (step 3) before it writes the new
snapshot, so no fsync of the commit stalls training. Crash semantics: checkpoint k becomes
current when rank 0 commits it after snapshot k+1 (or in close()); a crash before that
loses k, although its files are written, and recovery restarts from k-1. Call `wait()` to
commit at once.

Communication: two barriers per save (writers' group), no array data between ranks.
Cost: each writer writes ~S/W bytes (S the checkpoint size); rank 0 also the manifest.
`latest` reads and checks all S bytes of the checkpoint it returns; `load` reads them again.

References:
    CheckFreq -- Mohan, Phanishayee, Chidambaram 2021, FAST '21 (snapshot, then persist).
    fsync and rename -- Pillai et al. 2014, "All File Systems Are Not Created Equal", OSDI.
Read next: reliability/checkpoint_format.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
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
           "AsyncCheckpointer", "latest", "load"]
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


def _copy(state: CheckpointState) -> CheckpointState:
    """A private copy (checked with `_meta`): what the background thread writes."""
    meta = _meta(state)
    dup = lambda v: v.copy() if isinstance(v, (np.ndarray, np.generic)) else v  # noqa: E731
    return CheckpointState(int(state.step), {k: v.copy() for k, v in state.params.items()},
                           {k: dup(v) for k, v in state.optimizer.items()}, meta["rng"],
                           meta["data_cursor"], meta["losses"], meta["extra"])


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


class AsyncCheckpointer:
    """Save without stopping training (CheckFreq): copy at the step boundary, write behind.

    One rank's view (rank r of W; every rank snapshots at the same steps, then closes):
        snapshot(state_k): 1. copy state_k (arrays too: training may change them now);
            2. wait for this rank's write of the previous snapshot and re-raise its error;
            3. if one is written: barrier (every rank's file of it is durable);
            4. start a thread that (rank 0, after 3) commits the previous snapshot, then
            writes this rank's file and marker of state_k. Returns the seconds spent in 2.
        wait(): 2 and 3, rank 0 commits on the calling thread, then a barrier (every rank
            returns after the commit).
        close(): wait(), then no more snapshots.
    Never two writes at once: each snapshot waits for the previous write (step 2). An error
    in the thread is raised at the next snapshot, wait or close, never lost; it is raised
    before that call's barrier, so in a job the other ranks then fail too (RankFailure)
    and the run restarts from the last committed checkpoint. `on_phase` also hears
    "snapshot_waiting" (on the training thread) when a snapshot must wait.
    """

    def __init__(self, root: str | os.PathLike, *, rank: int = 0, world: int = 1,
                 barrier: Callable[[], Any] | None = None, keep: int | None = 3,
                 timeout: float = 600.0, on_phase: Callable[[str], Any] | None = None):
        self.prefix = _check_writer(rank, world, keep, barrier)
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.barrier, self.timeout, self.phase = barrier or _no_op, timeout, on_phase or _no_op
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: CheckpointState | None = None    # written, not yet committed
        self._last: Path | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """True while the background thread is writing."""
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self, state: CheckpointState) -> float:
        """Copy `state`, commit the previous snapshot, write this one in the background;
        return the seconds waited for the previous write."""
        if self._closed:
            raise CheckpointError(f"{self.prefix}snapshot after close(): make a new "
                                  f"AsyncCheckpointer to save again")
        copy = _copy(state)
        t0, busy = time.perf_counter(), self.busy
        if busy:
            self.phase("snapshot_waiting")
        self._join()
        waited = time.perf_counter() - t0 if busy else 0.0
        _, previous = self._durable()
        self._thread = threading.Thread(target=self._persist, args=(previous, copy),
                                        daemon=True,
                                        name=f"checkpoint-rank{self.rank}-step{copy.step}")
        self._thread.start()
        return waited

    def wait(self) -> Path | None:
        """Finish and commit the last snapshot; return the newest committed directory."""
        self._join()
        written, previous = self._durable()
        if previous is not None:
            self._commit(previous)
        if written:
            self.barrier()
        return self._last

    def close(self) -> Path | None:
        """wait(), then refuse further snapshots. Safe to call twice."""
        if not self._closed:
            try:
                self.wait()
            finally:
                self._closed = True
        return self._last

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:              # another rank may be gone: finish our write, skip the barriers
            self._closed = True
            if self._thread is not None:
                self._thread.join(self.timeout)

    def _persist(self, previous: CheckpointState | None, state: CheckpointState) -> None:
        """The thread: commit `previous` (rank 0), then write this rank's part of `state`."""
        try:
            if previous is not None:
                self._commit(previous, spare=f".tmp-{_step_name(state.step)}")
            with _errors(f"{self.prefix}writing step {state.step} into {self.root}"):
                _write_rank_file(self.root, state, self.rank, self.world, self.phase)
            self._written = state
        except BaseException as e:    # kept for the training thread: a thread cannot raise
            self._error = e

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self.timeout)
            if thread.is_alive():
                raise CheckpointError(f"{self.prefix}{thread.name} still writing after "
                                      f"{self.timeout} s: the disk is slow or hung; check "
                                      f"{self.root}, or raise AsyncCheckpointer(timeout=)")
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"{self.prefix}the background save failed ({err!r}); it is "
                                  f"not committed and the previous checkpoint is still the "
                                  f"latest. Fix the cause, then snapshot again") from err

    def _durable(self) -> tuple[bool, CheckpointState | None]:
        """Step 2 for the written snapshot, if any: (True after the barrier, the state for
        rank 0 to commit, else None); (False, None) when nothing waits to be committed."""
        state, self._written = self._written, None
        if state is None:
            return False, None
        self.barrier()
        self._last = self.root / _step_name(state.step)
        return True, state if self.rank == 0 else None

    def _commit(self, state: CheckpointState, spare: str = "") -> None:
        with _errors(f"{self.prefix}committing step {state.step} in {self.root}"):
            _commit(self.root, state, self.world, self.keep, self.phase, spare)


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
