"""Benchmark: flat against two-level collectives on emulated nodes, measured beside the model.

`python -m minidist bench hierarchical` starts W ranks as W / L nodes of L
(runtime/nodes.py), the link between nodes `--slower` times this machine's calibrated
shared-memory link (alpha and beta, collectives/calibration.py; the defaults when it was
never calibrated), and times all_reduce, reduce_scatter and all_gather of each size with the
flat ring, the two-level algorithm (collectives/hierarchical.py) and "auto". Each call is
timed on every rank between barriers and counts as the slowest rank's time; a run's figure
is the median over `--iters` calls, and the table shows the median over `--repeats` runs
(separate spawns). Beside it: the model, collectives/tiers.py's seconds for that algorithm
on the two tiers, their ratio, and the most bytes any rank sent across nodes per call (the
groups' counters, runtime/p2p.py).

The model's intra-node tier is measured in the same job, as the algorithms meet it: every
node runs a ring all-reduce of FIT bytes inside itself at once (W ranks sharing this
machine's cores, as they do during the two-level steps), and beta follows from its time,
t = 2 (L-1) alpha + 2 (L-1)/L n beta (reductions folded into beta; alpha the calibrated
one). The inter-node tier is the emulated one, exactly.

    python -m minidist bench hierarchical [--world 8 --per-node 4 --slower 10
                                           --sizes 64K,1M,16M --repeats 3 --iters 5]

Read next: collectives/hierarchical.py, collectives/tiers.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from minidist import collectives as C
from minidist.cli import at_least
from minidist.collectives import calibration, tiers
from minidist.runtime.launch import spawn
from minidist.runtime.nodes import Nodes

OPS = ("all_reduce", "reduce_scatter", "all_gather")
ALGOS = ("ring", "hierarchical", "auto")
FIT = 4 << 20                             # bytes of the intra-node fit's all-reduce


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 64K, 16M)") from None


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m minidist bench hierarchical",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=at_least(2), default=8)
    ap.add_argument("--per-node", type=at_least(1), default=4, help="ranks per node (L)")
    ap.add_argument("--slower", type=float, default=10.0,
                    help="the inter-node link's alpha and beta over this machine's")
    ap.add_argument("--sizes", default="64K,1M,16M",
                    help="bytes one rank passes in (all_gather: its piece)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help="runs (spawns); median")
    ap.add_argument("--iters", type=at_least(1), default=5, help="timed calls per run")
    a = ap.parse_args(argv)
    if a.world % a.per_node or a.world == a.per_node:
        ap.error(f"--world {a.world} must be 2 or more nodes of --per-node {a.per_node}")
    if not a.slower > 0:
        ap.error(f"--slower {a.slower} must be > 0")
    try:
        a.sizes = [_bytes(s) for s in a.sizes.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--sizes: {e}")
    return a


def intra_link(L: int, seconds: float, alpha: float) -> tiers.Link:
    """The intra-node tier: `alpha`, and beta from a ring all-reduce of FIT bytes over L
    ranks that took `seconds` (module docstring)."""
    steps, share = 2 * (L - 1), 2 * (L - 1) / L
    return tiers.Link(alpha, max((seconds - steps * alpha) / (share * FIT), 1e-15))


def _timed(fn, iters: int, group) -> float:
    """The median over `iters` calls of fn of the slowest rank's time (after two warm-ups:
    the first touches the mailboxes' pages)."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        group.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    slowest = C.all_gather(np.array(times), group=group, algo="ring").max(axis=0)
    return float(np.median(slowest))


def _run(ctx, sizes, iters, L):
    """({(op, algo, size): (seconds, the algorithm run, the most bytes a rank sent across
    nodes per call)}, the intra fit's two times)."""
    g, out = ctx.world, {}
    nodes = [ctx.new_group(range(k * L, (k + 1) * L), name=f"node{k}")
             for k in range(ctx.world_size // L)]
    node = nodes[ctx.rank // L]
    fit = _timed(lambda: C.all_reduce(np.ones(FIT // 4, np.float32), group=node, algo="ring"),
                 iters, g)
    for op in OPS:
        for n in sizes:
            x = np.ones(n // 4, np.float32)
            for algo in ALGOS:
                took = _timed(lambda: getattr(C, op)(x, group=g, algo=algo), iters, g)
                inter = g.stats["bytes_sent_inter"]
                getattr(C, op)(x, group=g, algo=algo)                # one call, counted
                sent = np.array([g.stats["bytes_sent_inter"] - inter])
                most = int(C.all_gather(sent, group=g, algo="ring").max())
                out[op, algo, n] = (took, C.api._algo(op, algo, x.nbytes, g), most)
    return out, fit


def main(argv=None) -> int:
    a = parse_args(argv)
    c = calibration.constants(a.world)
    nodes = Nodes(a.per_node, alpha=a.slower * c.alpha, beta=a.slower * c.beta)
    print(f"bench hierarchical · {a.world} ranks as {a.world // a.per_node} nodes of "
          f"{a.per_node} · float32 · median of {a.repeats} runs x {a.iters} calls")
    print(f"across nodes (emulated): {a.slower:g} x this machine's link, "
          f"{nodes.alpha * 1e6:.0f} us, {1 / nodes.beta / 1e9:.3f} GB/s")
    done = [spawn(a.world, _run, a.sizes, a.iters, a.per_node, nodes=nodes)[0]
            for _ in range(a.repeats)]
    runs = [r for r, _ in done]
    fit = statistics.median(f for _, f in done)
    intra = intra_link(a.per_node, fit, c.alpha)
    topo = tiers.Topology(a.per_node, intra, tiers.Link(nodes.alpha, nodes.beta))
    print(f"inside a node (measured, {a.world} ranks at once): {intra.alpha * 1e6:.1f} us, "
          f"{1 / intra.beta / 1e9:.2f} GB/s ({_size(FIT)} ring all-reduce per node: "
          f"{fit * 1e3:.2f} ms)")
    print(f"  {'op':<15}{'size':>5} {'algorithm':<19}{'measured ms':>12}{'model ms':>10}"
          f"{'model/meas':>11}{'across B, max':>15}")
    ranks = list(range(a.world))
    for op in OPS:
        for n in a.sizes:
            for algo in ALGOS:
                got = statistics.median(r[op, algo, n][0] for r in runs)
                _, name, sent = runs[0][op, algo, n]
                want = tiers.seconds(op, name, ranks, n, topo)
                label = f"auto: {name}" if algo == "auto" else algo
                print(f"  {op:<15}{_size(n):>5} {label:<19}{got * 1e3:>12.2f}"
                      f"{want * 1e3:>10.2f}{want / got:>11.2f}{sent:>15,}")
    return 0


def _size(n: int) -> str:
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


if __name__ == "__main__":
    raise SystemExit(main())
