"""Asynchronous checkpoints: copy the state at the step boundary, write it while training goes on.

A synchronous save (checkpoint.save) stops training for as long as the disk takes.
CheckFreq's answer is to split a save in two: a snapshot at the step boundary (copy the
arrays in memory, fast) and a persist (write, fsync, commit) in the background while the
next steps run. The copy is needed because training changes the arrays in place right
after the snapshot.

The steps are checkpoint.py's (1 write this rank's file and marker, 2 barrier, 3 rank 0
commits, 4 barrier), placed differently. The background thread never calls a collective
(a barrier on the training group from a second thread could interleave with training's
own calls), so the barrier of step 2 runs on the training thread, at the next `snapshot`;
rank 0's thread then commits (step 3) before it writes the new snapshot, so no fsync of the
commit stalls training. Crash semantics: checkpoint k becomes current when rank 0 commits
it after snapshot k+1 (or in close()); a crash before that loses k, although its files are
written, and recovery restarts from k-1. Call `wait()` to commit at once.

One rank's view: see AsyncCheckpointer.
Cost on the training thread: copying the state it is given (S bytes: every rank passes
the full state; nothing when the caller owns the arrays, as train.py's hook does, since
the engine's full state is made of new arrays) and one barrier per snapshot; the write
(~S/W bytes, each hashed once) and rank 0's commit run on this process's background
thread.

Reference: CheckFreq -- Mohan, Phanishayee, Chidambaram 2021, FAST '21 (snapshot, then
    persist; <= 3.5 % overhead).
Read next: reliability/recovery.py
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from minidist.reliability.checkpoint import (CheckpointError, CheckpointState,
                                             CheckpointStorageError, abandon, check_writer,
                                             commit, no_op, storage_errors, tmp_name,
                                             write_rank_file)
from minidist.reliability.checkpoint_format import state_meta, step_name

# The writer thread's nice value (Linux: per thread). It shares the rank's core with
# training; a low priority lets training run first and the writer fill the gaps.
NICE = 10


def _copy(state: CheckpointState, meta: dict) -> CheckpointState:
    """A private copy (`meta`: state_meta(state), which checked it): what the background
    thread writes."""
    dup = lambda v: v.copy() if isinstance(v, (np.ndarray, np.generic)) else v  # noqa: E731
    return CheckpointState(int(state.step), {k: v.copy() for k, v in state.params.items()},
                           {k: dup(v) for k, v in state.optimizer.items()}, meta["rng"],
                           meta["data_cursor"], meta["losses"], meta["extra"])


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
                 timeout: float = 600.0, on_phase: Callable[[str], Any] | None = None,
                 token: str | None = None):
        self.prefix, self.token = check_writer(rank, world, keep, barrier, token)
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self.barrier, self.timeout, self.phase = barrier or no_op, timeout, on_phase or no_op
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written: CheckpointState | None = None    # written, not yet committed
        self._last: Path | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """True while the background thread is writing."""
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self, state: CheckpointState, *, owned: bool = False) -> float:
        """Copy `state`, commit the previous snapshot, write this one in the background;
        return the seconds waited for the previous write. owned=True: the caller hands
        over arrays that nothing else holds or changes (engine.full_params() and
        full_optimizer_state() return such), so they are written without a copy."""
        if self._closed:
            raise CheckpointError(f"{self.prefix}snapshot after close(): make a new "
                                  f"AsyncCheckpointer to save again")
        meta = state_meta(state)           # what is not storable is refused here, not later
        copy = state if owned else _copy(state, meta)
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
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)   # this thread
        except (OSError, AttributeError):    # not permitted, or not Linux: run as it is
            pass
        try:
            if previous is not None:
                self._commit(previous, spare=tmp_name(state.step, self.token))
            try:
                with storage_errors(f"{self.prefix}writing step {state.step} into {self.root}",
                             self.root):
                    write_rank_file(self.root, state, self.rank, self.world, self.phase,
                                     self.token)
            except CheckpointStorageError:
                abandon(self.root, tmp_name(state.step, self.token))
                raise
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
            if isinstance(err, CheckpointError):      # it says where and what is latest
                raise type(err)(f"the background save failed: {err}") from err
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
        self._last = self.root / step_name(state.step)
        return True, state if self.rank == 0 else None

    def _commit(self, state: CheckpointState, spare: str = "") -> None:
        with storage_errors(f"{self.prefix}committing step {state.step} in {self.root}", self.root):
            commit(self.root, state, self.world, self.keep, self.phase, self.token, spare)
