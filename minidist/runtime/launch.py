"""Launching ranks: one OS process per rank, and what happens when one fails.

`spawn(W, fn, *args)` maps the job's shared arena (runtime/shm.py), forks W
processes and runs `fn(ctx, *args)` in each, where `ctx` carries the rank,
the world size and the world group. It returns the W results in rank order.
`python -m minidist run -n W script.py` does the same for a script that
calls `minidist.init()` (the torchrun of minidist, `run_script`): each rank
gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) and its output
lines arrive tagged "[rank1]:" (runtime/rank_output.py).

Failure semantics (the heart of the runtime):
    a rank raises        it marks itself FAILED on the job board, which raises
                         the job's abort flag, and sends its error to the
                         launcher; every rank waiting in a collective sees
                         the flag within ~1 ms and raises RankFailure; ranks
                         not waiting are SIGKILLed after GRACE seconds. spawn
                         raises RankFailure naming the first failed rank, with
                         its traceback (the report: runtime/report.py). An
                         error while setting up the rank (its groups' arena
                         regions) is reported the same way.
    an async call fails  the same, at once, from the group's worker thread
                         (job.py, RankHealth): no later call on the rank waits.
    a rank is killed     the launcher reaps it (its process sentinel wakes the
                         launcher at once), marks it DEAD with the signal, and
                         the same happens.
    a rank hangs         the others reach their deadline and raise
                         CollectiveTimeout with a flight-recorder report that
                         names the ranks that never reached the call; spawn's
                         RankFailure blames them ("rank 2 of 4 is hung") and
                         the launcher kills them (SIGKILL ends a SIGSTOPped
                         process too) HUNG_GRACE s after the timeout, once
                         every other rank has reported.
    the launcher dies    each rank asked the kernel (PR_SET_PDEATHSIG) to be
                         killed with it, and every wait also checks its parent.
Nothing is left behind: the arena has no name, so the kernel frees it with
the last process; spawn joins (or kills) every child before it returns.

One rank's view, after fn returns: wait for its async work, meet the other
ranks at a final barrier ("exit" call; a rank still inside a collective sees
a mismatch instead of a hang), then check that no message is left unread
in any of its mailboxes (a message nobody received is a mismatch).

Read next: runtime/report.py, runtime/group.py
"""

from __future__ import annotations

import ctypes
import os
import resource
import runpy
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import multiprocess as mp
import multiprocess.connection

from minidist.runtime.doorbell import close_bells, make_bells
from minidist.runtime.errors import CollectiveMismatch, RankFailure
from minidist.runtime.group import ProcessGroup
from minidist.runtime.job import DEAD, DONE, EXITING, FAILED, RUNNING, JobBoard
from minidist.runtime.mpi import init_mpi, under_mpiexec
from minidist.runtime.nodes import Nodes
from minidist.runtime.process_setup import setup_rank_process
from minidist.runtime.rank_output import RankOutput
from minidist.runtime.report import Reports
from minidist.runtime.shm import Arena, strong_ordering
from minidist.runtime.world import Job, RuntimeConfig, current_job, is_initialized, set_job

GRACE = 1.0           # seconds between the first failure and SIGKILL of ranks still running
HUNG_GRACE = 0.2      # the same, when all that still runs is what a timeout named hung (a
                      # rank merely waiting elsewhere sees the abort flag in ~1 ms and reports)


@dataclass
class RankContext:
    """What `fn(ctx, ...)` receives on each rank."""
    rank: int
    world_size: int
    world: ProcessGroup
    job: Job

    def new_group(self, ranks, name: str | None = None) -> ProcessGroup | None:
        return self.job.new_group(ranks, name)


def max_ranks() -> int:
    """The most ranks this machine can start: each holds about 5 of the launcher's open
    files (its result pipe, its doorbell, and under `run` its stdout and stderr pipes)
    and takes at least 16 MiB (a forked Python process, 4-5 MB private, and its arena
    pages)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    by_files = (soft - 64) // 5 if soft != resource.RLIM_INFINITY else 1 << 20
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(by_files, memory // (16 << 20)))


def check_world_size(world_size: int) -> None:
    """ValueError, one line, for a world size this machine cannot start (max_ranks)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive int, got {world_size!r}")
    most = max_ranks()
    if world_size > most:
        raise ValueError(f"{world_size} ranks: this machine can start at most {most} (its "
                         "open-file limit, `ulimit -n`, and its memory: about 5 files and 16 "
                         "MiB per rank); use fewer ranks")


def spawn(world_size: int, fn: Callable[..., Any], *args: Any,
          collective_timeout: float | None = None, join_timeout: float | None = None,
          groups: int | None = None, nodes: Nodes | None = None, **kwargs: Any) -> list[Any]:
    """Run fn(ctx, *args, **kwargs) on `world_size` forked ranks; return results in rank order.

    collective_timeout: seconds any single wait may take (default MINIDIST_TIMEOUT or 60).
    join_timeout: seconds the whole run may take (default: no limit).
    groups: the process groups fn will make, when the caller knows (parallel/compose.py's
    group_count): the job's group table holds max(groups, 64) unless MINIDIST_GROUPS says.
    nodes: the ranks grouped into emulated nodes with a slower link between them
    (runtime/nodes.py; default: MINIDIST_RANKS_PER_NODE's, else one node).
    Raises RankFailure if any rank fails (see the module docstring).
    """
    check_world_size(world_size)
    if not callable(fn):
        raise ValueError(f"spawn: fn must be callable, got {type(fn).__name__}")
    knobs = {} if collective_timeout is None else {"timeout": collective_timeout}
    if groups is not None and "MINIDIST_GROUPS" not in os.environ:
        knobs["max_groups"] = max(groups, RuntimeConfig(world_size).max_groups)
    if nodes is not None:
        knobs["nodes"] = nodes
    cfg = RuntimeConfig(world_size, **knobs)
    ctx = mp.get_context("fork")            # ranks inherit the arena mapping
    lock = None if strong_ordering() else ctx.Lock()
    arena = Arena(cfg.arena_bytes())
    board = _board(cfg, arena, os.getpid())
    bells = make_bells(world_size)          # inherited by every rank (runtime/doorbell.py)
    procs, readers = [], []
    try:
        for r in range(world_size):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, name=f"minidist-rank{r}",
                            args=(r, cfg, arena, lock, os.getpid(), wr, bells, fn, args,
                                  kwargs))
            procs.append(p)
            readers.append((rd, wr))
        for p in procs:
            p.start()
        for _, wr in readers:
            wr.close()
        return _supervise(procs, [rd for rd, _ in readers], board, join_timeout)
    finally:
        _kill(procs)
        close_bells(bells)


def _rank_main(rank, cfg, arena, lock, launcher_pid, conn, bells, fn, args, kwargs) -> None:
    """What each forked rank runs: set up, call fn, finish cleanly, send one message.
    Every error reaches the launcher as that message: one in setting up the job (the
    groups' regions of the arena), in fn, in finishing, or in an async call (sent at
    once from the group's worker thread, see job.py's RankHealth)."""
    _die_with_parent(launcher_pid)
    setup_rank_process(rank, cfg.world_size)
    out = _Outbox(conn, _board(cfg, arena, launcher_pid), rank)
    job = None
    try:
        job = Job(cfg, arena, rank, launcher_pid, lock, bells)
        job.health.report = out.async_error
        set_job(job)
        job.board.status[rank] = RUNNING
        result = fn(RankContext(rank, cfg.world_size, job.world, job), *args, **kwargs)
        _finish(job)
        out.result(result)
    except BaseException as e:                       # noqa: BLE001 -- reported, not swallowed
        out.error(e, "" if job else "while setting up the job, before fn ran")
    out.close()
    sys.stdout.flush()
    sys.stderr.flush()


def _board(cfg: RuntimeConfig, arena: Arena, launcher_pid: int) -> JobBoard:
    """The job board at the start of the arena (the same bytes Job's board views)."""
    return JobBoard(Arena(cfg.board_bytes(), arena.buf, arena.base), cfg.world_size,
                    cfg.max_groups, launcher_pid)


class _Outbox:
    """A rank's one message to the launcher, sent once by whichever thread gets there
    first: the main thread, or a group's worker thread whose async call failed. Marking
    FAILED and sending happen under one lock, so the first error is the one reported
    (a thread that sees the abort flag this raises cannot report before it)."""

    def __init__(self, conn, board: JobBoard, rank: int):
        self.conn, self.board, self.rank = conn, board, rank
        self.lock, self.sent = threading.Lock(), False

    def async_error(self, e: BaseException, where: str) -> None:
        """RankHealth's report: `where` is "async <the call>", named unless e names it."""
        self.error(e, "" if where.removeprefix("async ") in str(e) else f"raised in {where}")

    def error(self, e: BaseException, context: str = "") -> None:
        text = f"{type(e).__name__}: {e}" + (f"\n  ({context})" if context else "")
        with self.lock:
            if not self.sent:
                self.board.mark(self.rank, FAILED)
                self._send(("error", text, _traceback(e), tuple(getattr(e, "hung", ()))))

    def result(self, value: Any) -> None:
        with self.lock:
            if self.sent:
                return
            self.board.mark(self.rank, DONE)
            try:
                self._send(("ok", value))
            except Exception as e:                   # e.g. an unpicklable result
                self.board.mark(self.rank, FAILED)
                self._send(("error", f"could not send rank {self.rank}'s result to the "
                            f"launcher: {type(e).__name__}: {e}", _traceback(e)))

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)              # pickles first: a failure sends nothing
        except (BrokenPipeError, ConnectionResetError):
            pass                             # the launcher is gone: nobody to tell
        self.sent = True

    def close(self) -> None:
        with self.lock:
            self.sent = True
            self.conn.close()


def _traceback(e: BaseException) -> str:
    """The traceback without its last lines, the error's own text: the report prints
    that once, above (a timeout's text carries the whole flight recorder)."""
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    own = traceback.format_exception_only(type(e), e)
    return "".join(lines[:len(lines) - len(own)])


def _die_with_parent(launcher_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass                                         # not Linux: waits still check the parent
    if os.getppid() != launcher_pid:
        os._exit(1)


def _finish(job: Job) -> None:
    """After fn returns: drain async work, meet at an exit barrier, check mailboxes."""
    for g in job.groups:
        if g is not None:
            g.drain()
    job.board.status[job.rank] = EXITING
    with job.world.collective("exit", None):
        job.world.barrier()
    for g in job.groups:
        unread = [] if g is None else g.unread()
        if unread:
            raise CollectiveMismatch(
                f"{g.prefix} finished with {unread[0]}. This rank never received it: "
                "the ranks made different calls.")


def _supervise(procs, readers, board: JobBoard, join_timeout: float | None) -> list[Any]:
    """The launcher's loop: collect each rank's one message (result or error), notice
    ranks that die without one (their process sentinel fires; mark them DEAD so the
    survivors' waits see it), SIGKILL whatever still runs GRACE s after the first
    failure (HUNG_GRACE s when all that has not reported is what a timeout named hung),
    and raise RankFailure naming the rank to blame."""
    W = len(procs)
    results: list[Any] = [None] * W
    rep = Reports(W)
    live = {p.sentinel: r for r, p in enumerate(procs)}
    pending = {rd: r for r, rd in enumerate(readers)}
    start, failed_at = time.monotonic(), None
    while live or pending:
        for obj in multiprocess.connection.wait(list(pending) + list(live), timeout=0.05):
            if obj in pending:
                r = pending.pop(obj)
                try:
                    msg = obj.recv()
                except (EOFError, OSError):
                    continue
                if msg[0] == "ok":
                    results[r] = msg[1]
                rep.message(r, msg)
            else:
                r = live.pop(obj)
                procs[r].join()
                reader = readers[r]
                if reader in pending and reader.poll():
                    live[obj] = r                   # read its last message first, next round
                    continue
                pending.pop(reader, None)
                if r not in rep.reported:
                    rep.died(r, procs[r].exitcode)
                    board.mark(r, DEAD, procs[r].exitcode or 1)
        now = time.monotonic()
        if rep.failures and failed_at is None:
            failed_at = now
        hung = rep.hung()
        grace = HUNG_GRACE if hung and set(pending.values()) <= hung else GRACE
        if failed_at is not None and now >= failed_at + grace:
            rep.killed |= _kill(procs)
        if join_timeout is not None and now - start > join_timeout and (live or pending):
            _kill(procs)
            raise RankFailure(f"spawn: the job did not finish within join_timeout="
                              f"{join_timeout:g} s; all ranks were killed.", rank=-1)
    if rep.failures:
        raise rep.failure(board.first_failed())
    return results


def _kill(procs) -> set[int]:
    """SIGKILL every rank still running (a stopped one too) and reap them all; returns
    the ranks it killed."""
    killed = set()
    for r, p in enumerate(procs):
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.add(r)
            except ProcessLookupError:
                pass
    for p in procs:
        if p.pid is not None:
            p.join()
    return killed


MASTER_ADDR, MASTER_PORT = "127.0.0.1", 29500     # torchrun's defaults; nothing listens here
_LEFT: list = []             # the job destroy_process_group() left; init() rejoins it


def init():
    """In a script run by `python -m minidist run`, return this rank's context;
    under mpiexec, join the MPI job (runtime/mpi.py); in a plain Python process,
    start a one-rank job and return its context. After `leave()` it rejoins the job
    this process left (a rank of a launched job stays that rank)."""
    if not is_initialized() and _LEFT:
        set_job(_LEFT.pop())
    if not is_initialized() and under_mpiexec():
        set_job(init_mpi())             # the default group, get_rank(), ... work under MPI too
    if not is_initialized():
        size = os.environ.get("WORLD_SIZE", "1")
        if size.strip() not in ("", "1", "0"):          # torchrun's, or set by hand
            raise ValueError(f"WORLD_SIZE={size} (and RANK={os.environ.get('RANK', '?')}) "
                             "ask for a job of several ranks, but this process was not "
                             "started by a launcher minidist can join: start it with "
                             f"`python -m minidist run -n {size} SCRIPT` (or mpiexec -n "
                             f"{size}), or unset WORLD_SIZE for a one-rank job")
        cfg = RuntimeConfig(1)
        set_job(Job(cfg, Arena(cfg.arena_bytes()), 0, os.getppid()))
    job = current_job()
    if not hasattr(job, "cfg"):         # an MPI job: its context is the job
        return job
    return RankContext(job.rank, job.cfg.world_size, job.world, job)


def leave() -> None:
    """Stop being initialised (torch's destroy_process_group): wait for this rank's async
    calls, then forget the job, so collectives raise "not initialised". The job itself
    stays: under spawn or `minidist run` the rank still meets the others at the exit
    barrier after fn returns, and its peers may still read its shared buffers; init()
    rejoins it."""
    job = current_job()
    for g in getattr(job, "groups", [job.world]):
        if g is not None:
            g.drain()
    _LEFT[:] = [job]
    set_job(None)


def torchrun_env(rank: int, world_size: int) -> dict[str, str]:
    """The variables torchrun gives each worker, for one node running every rank."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(MASTER_PORT)}


def _script_on_rank(ctx: RankContext, path: str, argv: list[str],
                    output: RankOutput | None = None) -> int:
    """One rank of `run_script`: its output into its pipes, torchrun's variables, then
    the script as __main__. A closed launcher stdout (`| head`) fails the rank with
    BrokenPipeError, quietly (what it still has buffered goes to /dev/null)."""
    if output is not None:
        output.attach(ctx.rank)
    os.environ.update(torchrun_env(ctx.rank, ctx.world_size))
    sys.argv = [path, *argv]
    try:
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        sys.stdout.flush()              # here, where a closed pipe is handled, not at exit
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
        raise
    return 0


def run_script(world_size: int, path: str, argv: list[str],
               collective_timeout: float | None = None, *, prefix: bool = True,
               log_dir: str | None = None, show: set[int] | None = None) -> int:
    """`python -m minidist run -n W script.py args`: returns the process exit code.

    Each rank's stdout and stderr lines reach the launcher's stdout and stderr tagged
    "[rank<r>]:" (prefix=False: untagged), only for the ranks in `show` (None: all),
    and with log_dir also DIR/rank<r>.log (runtime/rank_output.py). Returns 0, or 1
    after printing the RankFailure report on stderr, after every rank's output. Raises
    BrokenPipeError when the launcher's stdout was closed by its reader (`| head`).
    """
    check_world_size(world_size)                # before a pipe per rank is opened
    RuntimeConfig(world_size)                   # the MINIDIST_* variables, checked here
    if not os.path.isfile(path):
        raise ValueError(f"run: no such script {path!r}")
    if show is not None and not set(show) <= set(range(world_size)):
        raise ValueError(f"run: show={sorted(show)} names ranks outside 0..{world_size - 1}; "
                         f"the job has {world_size} ranks.")
    sys.stdout.flush()                  # the launcher's own lines come first
    sys.stderr.flush()
    failure = None
    with RankOutput(world_size, prefix=prefix, log_dir=log_dir, show=show) as output:
        try:                            # leaving the with: every rank is reaped; drain
            spawn(world_size, _script_on_rank, os.path.abspath(path), list(argv), output,
                  collective_timeout=collective_timeout)
        except RankFailure as e:
            failure = e
    if output.stdout_closed:
        raise BrokenPipeError("the reader of this run's stdout has gone")
    if failure is not None:
        print(f"minidist run: {failure}", file=sys.stderr)
        return 1
    return 0
