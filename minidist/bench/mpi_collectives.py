"""MPI's own collectives, timed exactly like bench/collectives.py times minidist's.

The reference point for the hand-written collectives: the same sizes, the same
inputs (x_r = r + 1), the same timing rule (each repeat between barriers, the
slowest rank's time, the median over repeats), but every call is MPI's own
(MPICH from the `mpich` wheel, through mpi4py at its default thread level):

    all_reduce Allreduce        reduce_scatter Reduce_scatter_block
    all_gather Allgather        broadcast Bcast (in place)       reduce Reduce
    gather Gather               scatter Scatter                  all_to_all Alltoall

MPI writes into buffers the caller allocated once, while minidist's API returns a
new array per call; that difference is part of what the ratio column shows.

This file has two halves: `mpi_times` runs in the benchmark's process and
starts `mpiexec -n W python -m minidist.bench.mpi_collectives ...` (the mpiexec
next to sys.executable first, then the one on PATH); `main` runs on every MPI
rank and rank 0 prints one JSON line per (op, size). Without mpi4py or mpiexec,
`mpi_times` returns the reason instead, and the bench prints it.

Run (normally through `python -m minidist bench collectives --mpi`):
    mpiexec -n 2 python -m minidist.bench.mpi_collectives --ops all_reduce --sizes 8,1024
Reference: MPI Forum, "MPI: A Message-Passing Interface Standard", version 4.0, ch. 6.
Read next: collectives/cost.py
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import json                                    # noqa: E402
import shlex                                   # noqa: E402
import shutil                                  # noqa: E402
import statistics                              # noqa: E402
import subprocess                              # noqa: E402
import sys                                     # noqa: E402
import time                                    # noqa: E402
from importlib.util import find_spec           # noqa: E402

import numpy as np                             # noqa: E402

from minidist.bench.collective_inputs import (count_wrong, counts,  # noqa: E402
                                              default_iters, make_input)
from minidist.cli import CliParser, at_least                     # noqa: E402


def find_mpiexec() -> str | None:
    """The mpiexec of this Python environment (the `mpich` wheel), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


def mpi_times(W: int, plan, timeout: float = 600.0) -> dict | str:
    """{(op, size): (median seconds, #wrong)} of MPI's collectives for bench/collectives.py's
    `plan` on W ranks, or a sentence saying why MPI could not be run."""
    mpiexec = find_mpiexec()
    if find_spec("mpi4py") is None or mpiexec is None:
        return ("MPI skipped: mpi4py or mpiexec is not installed (pip install mpi4py mpich, "
                "i.e. minidist's `mpi` extra)")
    cmd = [mpiexec, "-n", str(W), sys.executable, "-m", "minidist.bench.mpi_collectives",
           "--ops", ",".join(plan.ops), "--sizes", ",".join(map(str, plan.sizes)),
           "--dtype", plan.dtype, "--iters", str(plan.iters)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return f"MPI skipped: `{shlex.join(cmd)}` did not finish within {timeout:g} s"
    if done.returncode:
        return f"MPI failed (exit {done.returncode}): {done.stderr.strip()[-500:]}"
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[(r["op"], r["size"])] = (statistics.median(r["seconds"]), r["wrong"])
    return out


def _call(op: str, count: int, comm, MPI, dtype):
    """(zero-argument callable running one MPI collective, callable giving its result)."""
    rank, W = comm.Get_rank(), comm.Get_size()
    x = make_input(op, count, W, rank, dtype)
    root_out = (lambda n: np.empty(n, dtype) if rank == 0 else None)
    if op == "broadcast":
        return (lambda: comm.Bcast(x, root=0)), (lambda: x)
    if op == "scatter":
        out = np.empty(count, dtype)
        return (lambda: comm.Scatter(x, out, root=0)), (lambda: out)
    out = {"all_reduce": lambda: np.empty(count, dtype), "reduce": lambda: root_out(count),
           "reduce_scatter": lambda: np.empty(count // W, dtype),
           "all_gather": lambda: np.empty(W * count, dtype),
           "gather": lambda: root_out(W * count), "all_to_all": lambda: np.empty(count, dtype)
           }[op]()
    fn = {"all_reduce": lambda: comm.Allreduce(x, out, op=MPI.SUM),
          "reduce": lambda: comm.Reduce(x, out, op=MPI.SUM, root=0),
          "reduce_scatter": lambda: comm.Reduce_scatter_block(x, out, op=MPI.SUM),
          "all_gather": lambda: comm.Allgather(x, out),
          "gather": lambda: comm.Gather(x, out, root=0),
          "all_to_all": lambda: comm.Alltoall(x, out)}[op]
    return fn, (lambda: out)


def main(argv: list[str] | None = None) -> int:
    """On every MPI rank: time each (op, size); rank 0 prints one JSON line per point."""
    from mpi4py import MPI

    p = CliParser(prog="python -m minidist.bench.mpi_collectives")
    p.add_argument("--ops", required=True)
    p.add_argument("--sizes", required=True, help="comma list of bytes")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=at_least(0), default=0, help="timed repeats (0: by size)")
    a = p.parse_args(argv)
    comm, dt = MPI.COMM_WORLD, np.dtype(a.dtype)
    rank, W = comm.Get_rank(), comm.Get_size()
    for op in a.ops.split(","):
        for size in sorted({counts(op, int(s), W, dt.itemsize)[1] for s in a.sizes.split(",")}):
            count = counts(op, size, W, dt.itemsize)[0]
            fn, result = _call(op, count, comm, MPI, dt)
            warmup, iters = default_iters(size)
            times = []
            for _ in range(warmup + (a.iters or iters)):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            wrong = comm.reduce(count_wrong(op, result(), count, W, rank, dt), op=MPI.SUM)
            every = comm.gather(times[warmup:], root=0)
            if rank == 0:
                slowest = [max(ts) for ts in zip(*every)]
                print(json.dumps({"op": op, "size": size, "count": count, "seconds": slowest,
                                  "wrong": wrong}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
