"""Nodes: 8 ranks as 2 nodes of 4, the link between them 10 x slower, and what it changes.

What you will see: part 1, an all-reduce of 16 MiB by the flat ring and by the two-level
algorithm (inside each node, across on a quarter, inside again): each one's time, the
two-tier cost model's, and the bytes all ranks together sent across nodes. Part 2, the
main job's GPT trained on the same 8 ranks with DDP, ZeRO-3 over all 8, HSDP (ZeRO-3
inside each node, replicated across) and ZeRO++ (ZeRO-3 over all 8 with int8 weight
gathers, the backward's gather inside the node, int4 two-hop gradient reduce-scatter): per
step the bytes sent inside and across nodes and the median step time. The OK line checks
the bytes, never a time.

Run:       python demos/32_nodes.py [--slower 10]   (or python -m minidist demo nodes)
Read with: minidist/runtime/nodes.py, minidist/collectives/hierarchical.py,
           minidist/collectives/tiers.py, minidist/parallel/zero/engine.py (HSDP),
           minidist/parallel/zero/zeropp.py, minidist/collectives/quantized.py (ZeRO++)
Paper:     Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (two-level collectives);
           Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277, Sec. 3.2.2 (hybrid sharding);
           Wang et al. 2023, "ZeRO++", arXiv:2306.10209, Sec. 3
"""

import argparse
import statistics
import time

import numpy as np

from minidist import collectives as C
from minidist.bench.hierarchical import FIT, intra_link
from minidist.cli import CliParser
from minidist.collectives import calibration, tiers
from minidist.data import DataConfig, model_config_for
from minidist.runtime.launch import spawn
from minidist.runtime.nodes import Nodes
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

W, L, N_BYTES, REPEATS = 8, 4, 16 << 20, 3


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slower", type=float, default=10.0,
                    help="the inter-node link's alpha and beta over this machine's")
    a = ap.parse_args(argv)
    if not a.slower > 0:
        ap.error(f"--slower {a.slower} must be > 0")
    return a


def _all_reduces(ctx):
    """Per algorithm: (median seconds of the slowest rank, bytes this rank sent across
    nodes in one call); and the intra-node fit's time (bench/hierarchical.py)."""
    g, out = ctx.world, {}
    node = [ctx.new_group(range(k * L, (k + 1) * L), name=f"node{k}") for k in range(W // L)]
    x = np.ones(N_BYTES // 4, np.float32)
    fit_x = np.ones(FIT // 4, np.float32)
    for name, group, data in (("fit", node[ctx.rank // L], fit_x), ("ring", g, x),
                              ("hierarchical", g, x)):
        algo = "ring" if name == "fit" else name
        inter = g.stats["bytes_sent_inter"]
        C.all_reduce(data, group=group, algo=algo)                  # warm-up, counted
        inter = g.stats["bytes_sent_inter"] - inter
        times = []
        for _ in range(REPEATS):
            g.barrier()
            t = time.perf_counter()
            C.all_reduce(data, group=group, algo=algo)
            times.append(time.perf_counter() - t)
        slowest = C.all_gather(np.array(times), group=g, algo="ring").max(axis=0)
        out[name] = (float(np.median(slowest)), inter)
    return out


def part1(nodes: Nodes) -> dict:
    print(f"part 1: all-reduce of {N_BYTES >> 20} MiB on {W} ranks as {W // L} nodes of {L}; "
          f"across nodes {nodes.alpha * 1e6:.0f} us, {1 / nodes.beta / 1e9:.2f} GB/s")
    runs = spawn(W, _all_reduces, nodes=nodes)
    intra = intra_link(L, runs[0]["fit"][0], calibration.constants(W).alpha)
    topo = tiers.Topology(L, intra, tiers.Link(nodes.alpha, nodes.beta))
    print(f"  inside a node (measured: {W} ranks on this machine's cores): "
          f"{1 / intra.beta / 1e9:.2f} GB/s")
    print(f"  {'algorithm':<14}{'measured ms':>12}{'model ms':>10}{'across, all ranks':>19}"
          f"{'busiest rank':>14}")
    across = {}
    for algo in ("ring", "hierarchical"):
        across[algo] = max(r[algo][1] for r in runs)
        model = tiers.seconds("all_reduce", algo, list(range(W)), N_BYTES, topo)
        print(f"  {algo:<14}{runs[0][algo][0] * 1e3:>12.1f}{model * 1e3:>10.1f}"
              f"{sum(r[algo][1] for r in runs):>19,}{across[algo]:>14,}")
    print("  (the flat ring's two ranks at a node's edge send everything across; the "
          "two-level one\n  sends a quarter from every rank, each over its own port)")
    return across


def _step(ctx, plan):
    data = DataConfig(task="sort")
    cfg = model_config_for(data, n_embd=64, n_layer=2, dtype="float32")
    r = train_on_rank(ctx, cfg, data, plan, RunConfig(steps=4, global_batch=32),
                      OptimizerConfig(lr=3e-3))
    last = len(r.bytes_by_axis) - 1
    return (sum(r.bytes_by_axis[last].values()), sum(r.inter_by_axis[last].values()),
            statistics.median(r.timing["step"][1:]))


def part2(nodes: Nodes) -> dict:
    print("part 2: one training step of the GPT (2 layers, C=64, batch 32), the same 8 ranks")
    print(f"  {'layout':<32}{'step ms':>9}{'sent inside':>14}{'sent across':>14}"
          f"{'across':>8}")
    out = {}
    for name, plan in (("DDP", Plan(dp=W)), ("ZeRO-3 over all 8", Plan(dp=W, zero=3)),
                       ("HSDP: ZeRO-3 x 4, replicas x 2", Plan(dp=W, zero=3, hsdp=L)),
                       ("ZeRO++ (qwZ, hpZ, qgZ)", Plan(dp=W, zero=3, zeropp=L))):
        runs = spawn(W, _step, plan, nodes=nodes)
        sent, across = sum(r[0] for r in runs), sum(r[1] for r in runs)
        step = max(r[2] for r in runs)
        out[name] = across
        print(f"  {name:<32}{step * 1e3:>9.1f}{sent - across:>14,}{across:>14,}"
              f"{across / sent:>8.1%}")
    print("  (bytes: all ranks together, one step; step: the slowest rank's median)")
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    c = calibration.constants(W)
    nodes = Nodes(L, alpha=a.slower * c.alpha, beta=a.slower * c.beta)
    print(f"demo 32 · nodes: {W} ranks as {W // L} nodes of {L}, the link between nodes "
          f"{a.slower:g} x slower (emulated)")
    across = part1(nodes)
    train = part2(nodes)
    # every rank sends 2 (N-1)/N of its quarter across: 2 nodes, 8 ranks, n = 16 MiB
    want = 2 * (W // L - 1) * N_BYTES // (W // L) // L
    ok = across["hierarchical"] == want and across["hierarchical"] * 4 < across["ring"] \
        and train["HSDP: ZeRO-3 x 4, replicas x 2"] < train["ZeRO-3 over all 8"] \
        and train["ZeRO++ (qwZ, hpZ, qgZ)"] * 4 <= train["ZeRO-3 over all 8"]
    zero3 = train["ZeRO-3 over all 8"]
    print(f"{'OK' if ok else 'MISMATCH'}: the two-level all-reduce's busiest rank sent "
          f"{across['hierarchical']:,} B across nodes (the formula: {want:,}),\n"
          f"{across['ring'] / max(across['hierarchical'], 1):.1f} x less than the flat ring's; "
          f"across nodes HSDP sent {train['HSDP: ZeRO-3 x 4, replicas x 2'] / zero3:.0%} and "
          f"ZeRO++ {train['ZeRO++ (qwZ, hpZ, qgZ)'] / zero3:.0%} of ZeRO-3's bytes")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
