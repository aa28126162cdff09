"""Benchmark: the hand-written collectives, timed and reported the way nccl-tests reports NCCL.

For every collective, algorithm (and algo="auto"), world size W and size: the time of one
call through the public API (minidist.collectives), copying the caller's array in and the
result out included. Each repeat is timed on every rank between barriers and counts as the
slowest rank's time; the table shows the median over repeats. As in nccl-tests:

    algbw = size / time;   busbw = algbw * factor (what each link must sustain), factor =
        2(W-1)/W  all_reduce        (W-1)/W  reduce_scatter, all_gather, all_to_all,
        1         broadcast, reduce          gather, scatter
    size  = bytes one rank passes in (all_reduce, reduce_scatter, all_to_all, broadcast,
            reduce), or of the whole gathered/scattered array (all_gather, gather, scatter).
"model" is cost.predict(op, algo, W, n), n = bytes of one rank's input, with the constants
the header names (calibrated, or the defaults); each table ends with the worst model/measured
ratio per algorithm. "#wrong" counts result elements unequal to the closed form (inputs
x_r = r + 1: sums are exact in float32).

--shared   inputs live in a group.shared(...) region, as DDP's buckets do. The API calls
           run on that shared-resident array (they still copy it), plus "direct-shm":
           direct.all_reduce_shared, the zero-copy path (peers' inputs are read where they
           lie and the sum is written back into the region; not exposed by api.py).
--mpi      also time MPI's own collectives (bench/mpi_collectives.py under mpiexec) on the
           same sizes: columns mpi(us), mpi_busbw, ratio = minidist time / MPI time.
--calibrate  first fit the cost model (see `calibrate`): time every algorithm of every
           collective alone (W = 1) and over the sizes at each W, fit cost.fit per W, print
           model against measured for every point, write the JSON algo="auto" reads
           (--cost-file, default cost.cost_file()). 1-2 minutes for 8 B..64 MiB, W = 2,4.

Run:  python -m minidist bench collectives [--world-sizes 2,4] [--ops all_reduce,...] [--algos
      ring,...] [--min-bytes 8] [--max-bytes 64M] [--factor 8] [--iters N] [--dtype float32]
      [--shared] [--mpi] [--calibrate [--cost-file PATH]]   (default: under a minute)
Reference: NVIDIA nccl-tests, doc/PERFORMANCE.md (algbw, busbw and their factors);
    Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (the alpha-beta model in cost.py).
Read next: bench/mpi_collectives.py
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import argparse                                # noqa: E402
import shlex                                   # noqa: E402
import statistics                              # noqa: E402
import sys                                     # noqa: E402
import time                                    # noqa: E402
from dataclasses import dataclass, replace     # noqa: E402

import numpy as np                             # noqa: E402

from minidist.cli import CliParser, at_least, cli_error, file_path  # noqa: E402
from minidist.bench.collective_inputs import (count_wrong, counts, default_iters,  # noqa: E402,F401
                                              make_input)
from minidist.bench.mpi_collectives import mpi_times     # noqa: E402
from minidist.collectives import api, cost, direct      # noqa: E402
from minidist.runtime.launch import spawn      # noqa: E402

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
       "scatter", "all_to_all")
SHM_ALGO = "direct-shm"
MAX_RANKS = 8
TARGET = 0.30                  # issue 15: the model within ±30 % of every measured time
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def bus_factor(op: str, W: int) -> float:
    """busbw / algbw for `op` on W ranks (see the module docstring)."""
    return {"all_reduce": 2 * (W - 1) / W, "broadcast": 1.0, "reduce": 1.0}.get(op, (W - 1) / W)


def parse_bytes(text: str) -> int:
    """'8' -> 8, '4K' -> 4096, '64M' -> 64 MiB (binary units; a trailing B or iB is allowed)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = int(float(t[:len(t) - len(unit)]) * _UNITS[unit])
    except (ValueError, OverflowError):           # not a number, or not a finite one
        value = 0
    if value < 1:
        raise ValueError(f"cannot read {text!r} as a byte count >= 1; write e.g. 8, 4K, 64M")
    return value


def sweep_sizes(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo*factor, lo*factor^2, ... below hi, then hi itself."""
    if factor < 2 or lo > hi:
        raise ValueError(f"sizes: need factor >= 2 and min <= max, got {factor}, {lo}, {hi}")
    k = next(k for k in range(64) if lo * factor ** (k + 1) >= hi)
    return [lo * factor ** i for i in range(k + 1)] + ([hi] if lo * factor ** k != hi else [])


@dataclass(frozen=True)
class Plan:
    """What to measure: every (op, algo) pair over every size, on one world size."""
    ops: tuple[str, ...]
    algos: dict
    sizes: tuple[int, ...]
    dtype: str
    iters: int
    shared: bool


@dataclass(frozen=True)
class Point:
    """One row of a table: the median time of `algo` (which ran `ran`) for `op` at `size`."""
    op: str
    W: int
    algo: str
    ran: str
    size: int
    count: int
    seconds: float
    wrong: int
    model_bytes: int

    @property
    def algbw(self) -> float:                 # GB/s
        return self.size / self.seconds / 1e9

    busbw = property(lambda self: self.algbw * bus_factor(self.op, self.W), doc="GB/s")


def _api_call(op: str, algo: str, x, g):
    """A zero-argument callable running one `op` through the public API (root 0)."""
    kw = {"root": 0} if op in ("broadcast", "reduce", "gather", "scatter") else {}
    return lambda: getattr(api, op)(x, group=g, algo=algo, **kw)


def _repeat(g, fns: dict, warmup: int, iters: int, refill=None) -> tuple[dict, dict]:
    """Round robin over fns (drift on a busy machine hits each alike): refill, barrier, time
    fn() on this rank. Returns the times after the warm-up and each fn's last result."""
    times, outs = {k: [] for k in fns}, {}
    for _ in range(warmup + iters):
        for k, fn in fns.items():
            if refill is not None:
                refill()
            g.barrier()
            t0 = time.perf_counter()
            outs[k] = fn()
            times[k].append(time.perf_counter() - t0)
    return {k: t[warmup:] for k, t in times.items()}, outs


def _warm_up(g) -> None:
    """Touch every mailbox and settle the ranks before anything is timed."""
    for algo in cost.ALGOS["all_reduce"] * 10:
        api.all_reduce(np.zeros(256, np.float32), group=g, algo=algo)


def _rank_sweep(ctx, plan: Plan) -> list[tuple]:
    """Runs on every rank: time every (op, size, algo) of the plan; return raw times."""
    g, W, dt = ctx.world, ctx.world_size, np.dtype(plan.dtype)
    if plan.shared:                        # one region, big enough for the largest input
        buf = g.shared("bench/shared", max(counts(op, s, W, dt.itemsize)[1]
                                            for op in plan.ops for s in plan.sizes))
    _warm_up(g)
    rows = []
    for op in plan.ops:
        for size in sorted({counts(op, s, W, dt.itemsize)[1] for s in plan.sizes}):
            count = counts(op, size, W, dt.itemsize)[0]
            x0 = x = make_input(op, count, W, g.rank, dt)
            refill = None
            if plan.shared and x0 is not None:        # direct-shm overwrites it: refill
                x = buf.local(dt, x0.size).reshape(x0.shape)
                refill = lambda: np.copyto(x, x0)          # noqa: E731
            fns = {a: (lambda: direct.all_reduce_shared(buf, dt, count, g)) if a == SHM_ALGO
                   else _api_call(op, a, x, g) for a in plan.algos[op]}
            warmup, iters = default_iters(size)
            times, outs = _repeat(g, fns, warmup, plan.iters or iters, refill)
            for a in fns:                  # direct-shm runs last: its result is still there
                ran = (cost.choose(op, count * dt.itemsize, W, shared_memory=g.supports_shared)
                       if a == "auto" else a)
                rows.append((op, a, ran, size, count, times[a],
                             count_wrong(op, outs[a], count, W, g.rank, dt)))
    return rows


def run(W: int, plan: Plan) -> list[Point]:
    """Spawn W ranks, run the plan, and reduce the raw times: max over ranks, median."""
    per_rank = spawn(W, _rank_sweep, plan)
    points = []
    for rows in zip(*per_rank):
        op, algo, ran, size, count = rows[0][:5]
        slowest = [max(ts) for ts in zip(*(r[5] for r in rows))]       # per repeat
        points.append(Point(op, W, algo, ran, size, count, statistics.median(slowest),
                            sum(r[6] for r in rows), count * np.dtype(plan.dtype).itemsize))
    return points


def format_table(points: list[Point], mpi: dict | str | None, note: str) -> str:
    """nccl-tests-style table of one (op, W), with MPI side by side when given."""
    head = (f"\n# {points[0].op} · W={points[0].W} · {note}\n# {'size(B)':>10} {'count':>9}  "
            f"{'algo':<16}{'time(us)':>11}{'algbw':>9}{'busbw':>9}{'model(us)':>11}{'#wrong':>7}")
    if isinstance(mpi, dict):
        head += f" |{'mpi(us)':>10}{'mpi_busbw':>10}{'ratio':>8}"
    lines = [head + "\n#" + " " * 52 + "(GB/s)   (GB/s)"]
    for p in points:
        name = p.algo if p.algo == p.ran else f"{p.algo}:{p.ran}"
        model = ("-" if p.ran == SHM_ALGO else
                 f"{cost.predict(p.op, p.ran, p.W, p.model_bytes) * 1e6:.1f}")
        row = (f"  {p.size:>10} {p.count:>9}  {name:<16}{p.seconds * 1e6:>11.1f}"
               f"{p.algbw:>9.3f}{p.busbw:>9.3f}{model:>11}{p.wrong:>7}")
        if isinstance(mpi, dict) and (p.op, p.size) in mpi:
            t, wrong = mpi[(p.op, p.size)]
            bus = p.size / t / 1e9 * bus_factor(p.op, p.W)
            row += f" |{t * 1e6:>10.1f}{bus:>10.3f}{p.seconds / t:>8.2f}"
            row += f"  (MPI #wrong {wrong})" if wrong else ""
        lines.append(row)
    lines += [_model_summary(points)] + ([f"# {mpi}"] if isinstance(mpi, str) else [])
    return "\n".join(lines)


def _model_summary(points: list[Point]) -> str:
    """One line: the worst model/measured ratio of the table, per algorithm that ran."""
    worst: dict[str, float] = {}
    for p in points:
        if p.ran != SHM_ALGO:
            r = cost.predict(p.op, p.ran, p.W, p.model_bytes) / p.seconds
            worst[p.ran] = max(worst.get(p.ran, r), r, key=lambda v: abs(v - 1))
    return ("# model/measured, worst per algorithm: " + ", ".join(
        f"{a} {r:.2f}" for a, r in worst.items()) + f" (target 1 ± {TARGET:.2f})")


# --- calibration: fit the cost model's constants on this machine ------------------------

CAL_PASSES = 5                 # sweeps per world size; each point keeps its middle one


def calibrate(Ws: list[int], sizes: list[int], iters: int, path: str,
              passes: int = CAL_PASSES) -> cost.Table:
    """Fit the cost model on this machine and save it; print every point and the fit.

    1. Set-up times: every algorithm of every collective alone (W = 1) on the smallest
       size, and all_reduce's direct beyond direct_small's sizes (cost.setup_key).
    2. For each W > 1: every algorithm of every collective over `sizes`, `passes` times
       (interleaved, so a burst of load from other jobs hits one pass, not one W); each
       point keeps the median of its passes: robust to such a burst, and what one run of
       the bench typically measures.
    3. cost.fit per W: least squares on relative error; then the table is saved.
    """
    if len(sizes) < 3 or not any(w > 1 for w in Ws):
        raise ValueError(f"calibrate: needs at least 3 sizes and a world size > 1, got sizes "
                         f"{sizes} and W = {Ws}; widen --min-bytes/--max-bytes or lower "
                         "--factor, and pass e.g. --world-sizes 2,4.")
    plan = Plan(OPS, {op: cost.ALGOS[op] for op in OPS}, tuple(sizes), "float32", iters, False)
    alone = replace(plan, sizes=(sizes[0], 2 * cost.SMALL_BYTES))
    Ws, cores = sorted({w for w in Ws if w > 1}), len(os.sched_getaffinity(0))
    runs: dict[int, list[list[Point]]] = {W: [] for W in (1, *Ws)}
    for _ in range(passes):
        runs[1].append(run(1, alone))
        for W in Ws:
            runs[W].append(run(W, plan))
    middle = {W: [sorted(same, key=lambda q: q.seconds)[len(same) // 2] for same in zip(*r)]
              for W, r in runs.items()}
    setup: dict[str, float] = {}
    for q in sorted(middle[1], key=lambda q: q.size):        # each key at its smallest size
        setup.setdefault(cost.setup_key(q.op, q.ran, q.model_bytes), q.seconds)
    sets, report = [], {}
    for W in Ws:
        c = cost.fit([(q.op, q.ran, W, q.model_bytes, q.seconds) for q in middle[W]],
                     setup, cores)
        sets.append((W, c))
        report[str(W)] = _print_fit(W, c, middle[W], passes)
    table = cost.Table(tuple(sets), fitted=time.strftime("%Y-%m-%d %H:%M"))
    print("# set-up per call alone (W=1, us): " + ", ".join(
        f"{k} {v * 1e6:.1f}" for k, v in setup.items()))
    print(f"# wrote {cost.save(table, path, report)} (read by algo='auto' via "
          "cost.constants())", flush=True)
    return table


def _print_fit(W: int, c: cost.Constants, points: list[Point], passes: int) -> dict:
    """Print predicted against measured for every point and the fit; return its summary."""
    print(f"\n# calibration · W={W} · every algorithm of every collective · float32 · median "
          f"of {passes} passes (each a median of repeats)\n# {'op':<15}{'algo':<10}"
          f"{'size(B)':>10}{'measured(us)':>14}{'model(us)':>11}{'model/measured':>16}")
    ratios = []
    for q in points:
        model = cost.predict(q.op, q.ran, W, q.model_bytes, c)
        ratios.append(model / q.seconds)
        print(f"  {q.op:<15}{q.ran:<10}{q.size:>10}{q.seconds * 1e6:>14.1f}"
              f"{model * 1e6:>11.1f}{ratios[-1]:>16.2f}")
    worst = max(range(len(points)), key=lambda i: abs(ratios[i] - 1))
    inside = sum(abs(r - 1) <= TARGET for r in ratios)
    print(f"# fitted W={W}: {format_constants(c)}\n# W={W}: worst model/measured "
          f"{ratios[worst]:.2f} ({points[worst].op} {points[worst].ran} {points[worst].size} "
          f"B); within ±{TARGET:.0%}: {inside} of {len(points)} points", flush=True)
    return {"points": len(points), "within_30_percent": inside,
            "worst_ratio": round(ratios[worst], 3)}


def _kib(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def format_constants(c: cost.Constants) -> str:
    """The constants in readable units (set-ups: their median, as `call`)."""
    return (f"call {c.call * 1e6:.2f} us, alpha {c.alpha * 1e6:.2f} us, barrier "
            f"{c.barrier * 1e6:.2f} us, beta {c.beta * 1e9:.4f} ns/B, gamma "
            f"{c.gamma * 1e9:.4f} ns/B, copy {c.copy * 1e9:.4f} ns/B, dram "
            f"{c.dram * 1e9:.4f} ns/B beyond {_kib(c.cache)}"
            + (f", {c.cores} cores" if c.cores else ""))


def _parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m minidist bench collectives",
                                description="Time the collectives (see the module docstring).")
    p.add_argument("--world-sizes", default="2,4", help="comma list, each 1..8 (default 2,4)")
    p.add_argument("--ops", default="all_reduce", help=f"comma list of {','.join(OPS)}")
    p.add_argument("--algos", default="", help="comma list (default: auto and every algorithm)")
    p.add_argument("--min-bytes", default="8")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--factor", type=at_least(1), default=8, help="size step (default x8)")
    p.add_argument("--iters", type=at_least(0), default=0, help="timed repeats (default: by size)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shared", action="store_true", help="inputs live in group.shared()")
    p.add_argument("--mpi", action="store_true", help="also time MPI (mpi4py + mpiexec)")
    p.add_argument("--calibrate", action="store_true", help="fit and save cost constants first")
    p.add_argument("--cost-file", type=file_path, default=None,
                   help="calibration JSON (default: cost.py's)")
    return p


def _plan(a, p: argparse.ArgumentParser) -> tuple[list[int], Plan]:
    try:
        Ws = [int(w) for w in a.world_sizes.split(",")]
        sizes = sweep_sizes(parse_bytes(a.min_bytes), parse_bytes(a.max_bytes), a.factor)
        dtype = np.dtype(a.dtype)
    except (ValueError, TypeError) as e:
        p.error(str(e))
    ops = a.ops.split(",")
    if not all(1 <= w <= MAX_RANKS for w in Ws) or dtype.kind not in "iuf" or a.iters < 0 \
            or any(op not in OPS for op in ops):
        p.error(f"world sizes must be 1..{MAX_RANKS} (got {Ws}), dtype an int or float type "
                f"(got {dtype}), --iters >= 0 (got {a.iters}), --ops among {', '.join(OPS)}")
    shm = (SHM_ALGO,) if a.shared else ()                 # direct-shm: all_reduce only
    known = {op: ("auto", *cost.ALGOS[op], *(shm if op == "all_reduce" else ())) for op in ops}
    wanted = a.algos.split(",") if a.algos else None
    if wanted and any(w not in sum(known.values(), ()) for w in wanted):
        p.error(f"--algos {a.algos!r}: known for these ops: {known}")
    algos = {op: tuple(x for x in known[op] if wanted is None or x in wanted) for op in ops}
    return Ws, Plan(tuple(ops), algos, tuple(sizes), dtype.name, a.iters, a.shared)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _parser()
    Ws, plan = _plan(a := p.parse_args(argv), p)
    if a.cost_file:
        os.environ["MINIDIST_COST_FILE"] = os.path.abspath(a.cost_file)   # ranks inherit it
    if not a.calibrate:                           # a calibration file to read: check it first
        try:
            cost.load_table()
        except ValueError as e:
            return cli_error(str(e).removeprefix("cost: "))
    print(f"# command: python -m minidist bench collectives {shlex.join(argv)}".rstrip())
    print(f"# machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other "
          "jobs may share it: every time is a median); numpy", np.__version__, flush=True)
    if a.calibrate:
        try:
            calibrate(Ws, list(plan.sizes), a.iters, a.cost_file or str(cost.cost_file()))
        except ValueError as e:
            print(f"# {e}")
            return 1
    try:
        print(f"# cost model: {cost.describe()}")
        table = cost.load_table()
    except ValueError as e:                       # a broken calibration file: say so, stop
        print(f"# {e}")
        return 1
    for w, c in table.sets:
        print(f"#   {f'W={w}' if w else 'every W'}: {format_constants(c)}", flush=True)
    note = (f"{plan.dtype} · inputs in " + ("group.shared() regions" if plan.shared else
            "private arrays (the normal API: copy in, copy out)") + " · median of repeats")
    for W in Ws:
        points, mpi = run(W, plan), (mpi_times(W, plan) if a.mpi else None)
        for op in plan.ops:
            print(format_table([q for q in points if q.op == op], mpi, note), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
