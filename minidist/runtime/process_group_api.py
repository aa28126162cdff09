"""The torch.distributed-shaped lifecycle: init_process_group, destroy_process_group.

A torch.distributed script starts with `dist.init_process_group(backend)` and
ends with `dist.destroy_process_group()`; in between, collectives run on the
default group. minidist has the same four calls, so such a script ports by
changing its import and its backend name (README, "Running ranks"):

    init_process_group(backend=None, init_method=None, timeout=None,
                       world_size=-1, rank=-1)       join the job (or start one)
    destroy_process_group()                          leave it
    is_initialized()                                 in a job now?
    get_backend(group=None)                          "shm" or "mpi"

The job is made by whatever started the process, never by these calls: the
launcher of `python -m minidist run -n W` (shared memory, backend "shm"),
mpiexec (backend "mpi"), or nobody, in a plain Python process, where
init_process_group starts a one-rank "shm" job, as minidist.init() does. So
there is no rendezvous: init_method may only be None or "env://" (the
variables the launcher set), and world_size and rank, when given, must agree
with the running job; a wrong backend or a disagreeing size is a ValueError
that says what to launch instead.

One rank's view:
    1. init_process_group: check the arguments against how this process was
       started; join the job (launch.init); with `timeout`, use it for this
       rank's waits from now on (every group; groups made later too).
    2. collectives, get_rank(), new_group(), ... on the default (world) group.
    3. destroy_process_group: wait for this rank's async calls, then forget the
       job (launch.leave): is_initialized() is False and a collective raises
       "not initialised". Nothing else changes, and no message is sent: under
       the shm runtime the rank process still meets the others at the
       launcher's exit barrier when the script ends, the shared arena stays
       mapped (peers may still be reading this rank's buffers), and under MPI,
       MPI is finalised at exit by mpi4py. Calling init_process_group again
       rejoins the same job, with its groups and sequence numbers.

Differences from torch.distributed: the backends are "shm" and "mpi" ("gloo"
and "nccl" are refused, naming these); a rank started by the launcher is in
its job before any call (is_initialized() is True from the start); calling
init_process_group again while initialised is allowed when its arguments agree
(it returns at once); a running job cannot be resized or renumbered;
destroy_process_group takes no group (groups live as long as the job).

Read next: collectives/api.py (the collectives, send/recv, isend/irecv)
"""

from __future__ import annotations

import datetime
from dataclasses import replace

from minidist.runtime.launch import init, leave
from minidist.runtime.mpi import under_mpiexec
from minidist.runtime.world import current_job, is_initialized

BACKENDS = ("shm", "mpi")

__all__ = ["init_process_group", "destroy_process_group", "is_initialized", "get_backend"]


def _backend() -> str:
    """The backend of this process: "mpi" under mpiexec (or in a joined MPI job), else "shm"."""
    if is_initialized():
        return "shm" if hasattr(current_job(), "cfg") else "mpi"
    return "mpi" if under_mpiexec() else "shm"


def _seconds(timeout) -> float | None:
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"init_process_group: timeout={timeout!r} must be a positive number "
                         "of seconds or a datetime.timedelta.")
    return None if timeout is None else float(timeout)


def _check_backend(backend, init_method) -> None:
    """ValueError unless the backend is how this process was started, and there is no
    rendezvous to make."""
    have = _backend()
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"init_process_group: backend={backend!r} is not a minidist backend. Use 'shm' "
            "(shared memory: python -m minidist run, or a one-rank job) or 'mpi' (under "
            f"mpiexec), or None for the one this process was started with ({have!r}).")
    if backend is not None and backend != have:
        how = "was started by mpiexec" if have == "mpi" else "was not started by mpiexec"
        raise ValueError(f"init_process_group: backend={backend!r}, but this process {how}, "
                         f"so its backend is {have!r}. Pass backend={have!r} (or None), or "
                         f"start it {'under' if backend == 'mpi' else 'without'} mpiexec.")
    if init_method not in (None, "env://"):
        raise ValueError(f"init_process_group: init_method={init_method!r}, but minidist has no "
                         "rendezvous: ranks meet through their launcher (python -m minidist "
                         "run, or mpiexec). Pass init_method=None (or 'env://').")


def _check_size(world_size, rank) -> None:
    """ValueError unless world_size and rank are -1 or the joined job's own."""
    job = current_job()
    W = job.cfg.world_size if hasattr(job, "cfg") else job.world_size
    for name, value, actual in (("world_size", world_size, W), ("rank", rank, job.rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"init_process_group: {name}={value!r} must be an int (-1: the "
                             "job's own).")
        if value not in (-1, actual):
            kind = (f"an MPI job of {W} ranks" if _backend() == "mpi" else
                    f"a shared-memory job of {W} ranks" if W > 1 else
                    "a one-rank job (a plain Python process)")
            fix = (f", or launch {value} ranks: python -m minidist run -n {value} script.py "
                   f"(or mpiexec -n {value} python script.py)" if name == "world_size" else
                   " (the launcher numbers the ranks)")
            raise ValueError(f"init_process_group: {name}={value}, but this process is rank "
                             f"{job.rank} of {kind}. Pass {name}=-1 "
                             f"to take the job's{fix}.")


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: float | datetime.timedelta | None = None,
                       world_size: int = -1, rank: int = -1) -> None:
    """Join the job this process belongs to, as torch.distributed.init_process_group does.

    backend: "shm" (a rank of `python -m minidist run`, or a plain process, which
    becomes a one-rank job), "mpi" (under mpiexec), or None for whichever applies.
    init_method: None or "env://". world_size, rank: -1, or the running job's own.
    timeout: seconds (or a timedelta) any one wait of this rank may take from now on.
    Raises ValueError, saying what to change, when an argument disagrees with the job
    (and then leaves a job it had joined).
    """
    _check_backend(backend, init_method)
    seconds = _seconds(timeout)
    joined = is_initialized()
    init()                                  # join: a launched rank, mpiexec, or one rank
    try:
        _check_size(world_size, rank)
    except ValueError:
        if not joined:
            leave()
        raise
    if seconds is not None:
        job = current_job()
        if hasattr(job, "cfg"):             # shm: groups made later read the config
            job.cfg = replace(job.cfg, timeout=seconds)
        else:                               # MPI: ... the context
            job.timeout = seconds
        for g in getattr(job, "groups", [job.world]):
            if g is not None:
                g.timeout = seconds


def destroy_process_group(group=None) -> None:
    """Leave the job: wait for this rank's async calls, then is_initialized() is False and
    collectives raise "not initialised" (see the module docstring for what stays)."""
    if group is not None:
        raise ValueError("destroy_process_group: minidist groups live as long as the job; "
                         "call destroy_process_group() with no group to leave the job.")
    leave()


def get_backend(group=None) -> str:
    """"shm" or "mpi": the transport of `group` (None: the default group of this job)."""
    if group is None:
        current_job()                       # "not initialised" if so
        return _backend()
    return "mpi" if hasattr(group, "comm") else "shm"
