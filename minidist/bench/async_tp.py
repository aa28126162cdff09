"""Benchmark: async TP against plain sequence parallelism, on 2 ranks, with the time it hides.

`python -m minidist bench async_tp` runs a transformer MLP (fc C -> 4C column-parallel,
GELU, proj 4C -> C row-parallel, no biases) on 2 ranks with tp = 2 and sequence
parallelism, forward and backward on x[B, T_tp, C], once the plain way (sequence.py: each
collective whole, then the matmul, or the matmul, then the collective) and once with
async TP (parallel/tensor/async_tp.py: the collectives in steps on the tp group's worker
thread, behind the chunk products). A step is timed on both ranks between barriers and
counts as the slower rank's time; the two modes alternate step by step; a run's figure is
the median over `--iters` steps, and the table shows the median over `--repeats` runs
(separate spawns). Both links: this machine's shared memory, and an emulated slower link
between the two ranks (runtime/nodes.py: each message takes alpha + n beta, the ranks on
two nodes of one).

What is hidden is read from the tp group's counter of the main thread's time in
communication (group.stats["seconds"], runtime/group.py): in the plain mode every
collective runs on the main thread, so it is all the communication, exposed; in the async
mode the main thread only waits for transfers it needs now (Work.wait). So

    hidden = 1 - comm_async / comm_plain

with both per step (comm_async: the main thread's waits), and beside it the step-time
view, (step_plain - step_async) / comm_plain, which also counts what the worker thread
costs the compute (its copies, the interpreter lock).
The bytes each rank sends per step are the same in both modes (counted), 5 collectives
of B T_tp C numbers: the fc input gathered, gathered again in the backward, dx
reduce-scattered; the proj output reduce-scattered, its gradient gathered.

    python -m minidist bench async_tp [--batch 4 --seq 256 --width 512 --link both
                                       --latency-us 100 --gbs 0.25 --repeats 3 --iters 5]

Read next: parallel/tensor/async_tp.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from minidist import collectives as C
from minidist.autograd import Tensor
from minidist.autograd import functional as F
from minidist.cli import at_least
from minidist.nn.layers import Linear
from minidist.parallel import placement as pl
from minidist.parallel.tensor.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                      TensorParallel)
from minidist.runtime.launch import spawn
from minidist.runtime.nodes import INTER_ALPHA, INTER_BETA, Nodes
from minidist.seed import init_parameters

MODES = ("plain", "async")
LINKS = {"local": "shared memory", "slow": "emulated"}


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m minidist bench async_tp",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=at_least(1), default=4, help="B")
    ap.add_argument("--seq", type=at_least(2), default=256, help="T (even: tp = 2)")
    ap.add_argument("--width", type=at_least(2), default=512, help="C (even: 4C / tp)")
    ap.add_argument("--link", choices=("local", "slow", "both"), default="both")
    ap.add_argument("--latency-us", type=at_least(0.0, float), default=INTER_ALPHA * 1e6,
                    help="the emulated link's alpha, in microseconds")
    ap.add_argument("--gbs", type=at_least(1e-6, float), default=1e-9 / INTER_BETA,
                    help="the emulated link's bandwidth, GB/s (1 / beta)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="runs (spawns); median")
    ap.add_argument("--iters", type=at_least(1), default=5, help="timed steps per mode and run")
    a = ap.parse_args(argv)
    if a.seq % 2:
        ap.error(f"--seq {a.seq} must be even: sequence parallelism splits it over tp = 2")
    return a


def _layers(ctx, C_: int, async_on: bool):
    """The MLP's two tensor-parallel linears on this rank (the same seed in both modes)."""
    g = ctx.world
    algo = "direct" if g.supports_shared else "ring"       # as compose.parallelize picks
    tp = TensorParallel(g, True, algo=algo, async_tp=async_on)
    fc, proj = Linear(C_, 4 * C_, bias=False), Linear(4 * C_, C_, bias=False)
    init_parameters(fc, 0, "fc.")
    init_parameters(proj, 0, "proj.")
    return ColumnParallelLinear(fc, tp), RowParallelLinear(proj, tp)


def _run(ctx, B: int, T: int, C_: int, iters: int):
    """{mode: [(step seconds, tp seconds of the main thread, bytes sent)] per step, the
    slower rank's}, and whether the two modes' numbers agree bit for bit (or max |Δ|)."""
    g, r = ctx.world, ctx.rank
    rng = np.random.default_rng(0)
    x_all, dy_all = rng.standard_normal((B, T, C_)), rng.standard_normal((B, T, C_))
    rows = slice(r * T // 2, (r + 1) * T // 2)                 # my positions, T_tp of them
    x_mine, dy_mine = x_all[:, rows].copy(), dy_all[:, rows].copy()
    layers = {m: _layers(ctx, C_, m == "async") for m in MODES}

    def step(mode):
        col, row = layers[mode]
        col.weight.grad = row.weight.grad = None
        x = pl.tag(Tensor(x_mine, requires_grad=True), "tp", pl.Shard(1))
        y = row(F.gelu(col(x), approximate="tanh"))            # (B, T_tp, C)
        y.backward(dy_mine)
        return [y.data, x.grad, col.weight.grad, row.weight.grad]

    outs = {m: step(m) for m in MODES}                          # warm-up, and the numbers
    stats, seen = g.stats, {m: [] for m in MODES}
    for _ in range(iters):
        for mode in MODES:
            g.barrier()
            sent, comm, t = stats["bytes_sent"], stats["seconds"], time.perf_counter()
            step(mode)
            seen[mode].append((time.perf_counter() - t, stats["seconds"] - comm,
                               stats["bytes_sent"] - sent))
    slowest = {m: C.all_gather(np.array(v), group=g, algo="ring").max(axis=0).tolist()
               for m, v in seen.items()}
    same = all(np.array_equal(a, b) for a, b in zip(outs["plain"], outs["async"]))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(outs["plain"], outs["async"]))
    return slowest, same, worst


def measure(a, link: str):
    """[(median step s, median comm s, bytes) per mode], over the runs; agreement."""
    nodes = Nodes(1, alpha=a.latency_us * 1e-6, beta=1e-9 / a.gbs) if link == "slow" else None
    runs = [spawn(2, _run, a.batch, a.seq, a.width, a.iters, nodes=nodes)[0]
            for _ in range(a.repeats)]
    table = {}
    for mode in MODES:
        steps = [statistics.median(s[0] for s in run[0][mode]) for run in runs]
        comms = [statistics.median(s[1] for s in run[0][mode]) for run in runs]
        table[mode] = (statistics.median(steps), statistics.median(comms),
                       int(runs[0][0][mode][0][2]))
    return table, all(run[1] for run in runs), max(run[2] for run in runs)


def main(argv=None) -> int:
    a = parse_args(argv)
    B, T, C_ = a.batch, a.seq, a.width
    print(f"bench async_tp · 2 ranks, tp=2 with SP · MLP {C_} -> {4 * C_} -> {C_} on "
          f"x[{B}, {T}, {C_}] · float64")
    print(f"median of {a.repeats} runs x {a.iters} steps (forward + backward) per mode; a "
          "step: the slower rank's")
    print("comm: the main thread's seconds in tp communication per step (group.stats"
          "['seconds']):")
    print("  plain SP: inside its collectives (all exposed); async TP: in Work.wait (left "
          "exposed)")
    print("hidden = 1 - comm_async / comm_plain;  step view = (step_plain - step_async) / "
          "comm_plain")
    print(f"  {'link':<31}{'mode':<10}{'step ms':>9}{'comm ms':>9}{'B sent/step':>13}"
          f"{'hidden':>8}{'step view':>11}")
    links = ("local", "slow") if a.link == "both" else (a.link,)
    agree = []
    for link in links:
        table, same, worst = measure(a, link)
        agree.append((link, same, worst))
        name = LINKS[link] if link == "local" else \
            f"{LINKS[link]} {a.latency_us:g} us, {a.gbs:g} GB/s"
        (tp_, cp, sent_p), (ta, wa, sent_a) = table["plain"], table["async"]
        print(f"  {name:<31}{'plain SP':<10}{tp_ * 1e3:>9.1f}{cp * 1e3:>9.2f}{sent_p:>13,}")
        hidden = 1 - wa / cp if cp > 0 else float("nan")
        view = (tp_ - ta) / cp if cp > 0 else float("nan")
        print(f"  {'':<31}{'async TP':<10}{ta * 1e3:>9.1f}{wa * 1e3:>9.2f}{sent_a:>13,}"
              f"{hidden:>8.0%}{view:>11.0%}")
    want = 5 * B * (T // 2) * C_ * 8
    print(f"bytes per rank per step, predicted: 5 collectives x B T_tp C x 8 B = {want:,}")
    for link, same, worst in agree:
        verdict = "bit for bit" if same else f"within rounding (max |Δ| = {worst:.1e})"
        print(f"{LINKS[link]}: async TP's y, dx, dW equal plain SP's {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
