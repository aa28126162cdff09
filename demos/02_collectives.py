"""Every collective on W ranks: what each rank holds before and after, and what it sent.

What you will see: broadcast, reduce, all_reduce, reduce_scatter, all_gather, gather,
scatter and all_to_all (with uneven split sizes), each as a block of per-rank BEFORE /
AFTER lines in rank order, every result checked against the one-process oracle
(collectives/simulated.py), and the bytes each rank sent next to the closed-form count
for the algorithm that ran (ring: 2(W-1)/W n for all_reduce, binomial tree: one copy
per child, ...). Inputs are small integers in float64, so every sum is exact.

Run:       python demos/02_collectives.py [--world-size 4] [--n 4]
Read with: minidist/collectives/simulated.py, minidist/collectives/api.py, ring.py,
           tree.py, all_to_all.py
Paper:     Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
           operations in MPICH", IJHPCA 19(1), 49-66
"""

import numpy as np

from minidist.cli import CliParser, at_least
from minidist.collectives import api, simulated
from minidist.runtime.launch import spawn

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, N = 4, 4
MAX_N, WIDTH = 16, 100  # WIDTH: characters a line; longer arrays are shown by their ends
ALGO = {"broadcast": "tree", "reduce": "tree", "all_reduce": "ring", "reduce_scatter": "ring",
        "all_gather": "ring", "gather": "tree", "scatter": "tree", "all_to_all": "pairwise"}
HEADER = 96            # scatter first sends the row shape and dtype: 12 int64 (tree.py)


def inputs(W: int, n: int) -> dict:
    """What every rank passes in; rank r's numbers start at 10 r, so you can trace them."""
    xs = [10.0 * r + np.arange(n) for r in range(W)]
    splits = [[(r + d) % 3 for d in range(W)] for r in range(W)]       # uneven, some 0
    a2a = [10.0 * r + np.arange(sum(s)) for r, s in enumerate(splits)]
    return {"xs": xs, "root_rows": 100.0 + np.arange(W * n).reshape(W, n), "splits": splits,
            "a2a": a2a}


def rank_main(ctx, data: dict) -> list:
    """Everything here runs on every rank: each collective once; returns (in, out, bytes)."""
    r, g = ctx.rank, ctx.world
    x, root_rows = data["xs"][r], data["root_rows"] if r == 0 else None
    calls = {"broadcast": lambda: api.broadcast(x, 0, algo=ALGO["broadcast"]),
             "reduce": lambda: api.reduce(x, 0, algo=ALGO["reduce"]),
             "all_reduce": lambda: api.all_reduce(x, algo=ALGO["all_reduce"]),
             "reduce_scatter": lambda: api.reduce_scatter(x, algo=ALGO["reduce_scatter"]),
             "all_gather": lambda: api.all_gather(x, algo=ALGO["all_gather"]),
             "gather": lambda: api.gather(x, 0, algo=ALGO["gather"]),
             "scatter": lambda: api.scatter(root_rows, 0, algo=ALGO["scatter"]),
             "all_to_all": lambda: api.all_to_all(data["a2a"][r], data["splits"][r])}
    out = []
    for name, call in calls.items():
        before = g.stats["bytes_sent"]
        result = call()
        out.append((name, result, g.stats["bytes_sent"] - before))
    return out


def tree_children(v: int, W: int) -> list[int]:
    """Binomial tree rooted at 0 (tree.py's docstring): v + 2^j for 2^j below v's lowest
    set bit (below W for the root), if < W. Re-derived here to predict the bytes."""
    span = 1 << max(W - 1, 1).bit_length() if v == 0 else v & -v
    return [v + m for m in (1 << j for j in range(span.bit_length() - 1)) if v + m < W]


def subtree(v: int, W: int) -> int:
    return 1 + sum(subtree(c, W) for c in tree_children(v, W))


def predicted_bytes(name: str, W: int, n: int, data: dict) -> tuple[list[int], str]:
    """Closed-form bytes sent by each rank for the algorithm in ALGO, and the formula."""
    nb, ch = 8 * n, [8 * len(c) for c in np.array_split(np.arange(n), W)]
    kids = [tree_children(v, W) for v in range(W)]
    table = {
        "broadcast": ([nb * len(k) for k in kids], "n per tree child (total (W-1) n)"),
        "reduce": ([0] + [nb] * (W - 1), "n from every rank but the root"),
        "all_reduce": ([2 * nb - ch[r] - ch[(r + 1) % W] for r in range(W)],
                       "2(W-1)/W n: all chunks but one, twice"),
        "reduce_scatter": ([nb - ch[r] for r in range(W)], "(W-1)/W n"),
        "all_gather": ([(W - 1) * nb] * W, "(W-1) n"),
        "gather": ([0] + [nb * subtree(v, W) for v in range(1, W)],
                   "n per rank in my subtree, to my parent"),
        "scatter": ([sum(nb * subtree(c, W) + HEADER for c in k) for k in kids],
                    f"per child: n per rank in its subtree + a {HEADER} B shape header"),
        "all_to_all": ([8 * (sum(s) - s[r]) + 8 * (W - 1) for r, s in enumerate(data["splits"])],
                       "8 B per row sent to others + (W-1) x 8 B of row counts"),
    }
    return table[name]


def oracle(data: dict, W: int) -> dict:
    xs = data["xs"]
    return {"broadcast": simulated.broadcast(xs, 0), "reduce": simulated.reduce(xs, 0),
            "all_reduce": simulated.all_reduce(xs), "reduce_scatter": simulated.reduce_scatter(xs),
            "all_gather": simulated.all_gather(xs), "gather": simulated.gather(xs, 0),
            "scatter": simulated.scatter(data["root_rows"], W),
            "all_to_all": simulated.all_to_all(data["a2a"], data["splits"])}


def fmt(a, width: int = WIDTH) -> str:
    """'[0 1 2 3]', rows as '[[0 1] [2 3]]'; past `width` characters, the first and last
    values around '...' and the shape: '[0 1 ... 32 33] (4, 4)'."""
    if a is None:
        return "None"
    full = ("[" + " ".join(fmt(row) for row in a) + "]" if a.ndim == 2
            else "[" + " ".join(f"{v:g}" for v in a) + "]")
    values = [f"{v:g}" for v in a.reshape(-1)]
    for k in range(len(values) // 2, 0, -1):
        if len(full) <= width:
            break
        full = f"[{' '.join(values[:k] + ['...'] + values[-k:])}] {a.shape}"
    return full


def parse_args(argv=None):
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=at_least(1), default=WORLD_SIZE, help="ranks (1..8)")
    ap.add_argument("--n", type=at_least(1), default=N,
                    help=f"float64 elements per rank (1..{MAX_N})")
    args = ap.parse_args(argv)
    if args.world_size > 8 or args.n > MAX_N:
        ap.error(f"need --world-size <= 8 and --n <= {MAX_N}, got {args.world_size} and "
                 f"{args.n}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    W, n = args.world_size, args.n
    data = inputs(W, n)
    print(f"demo 02 · collectives · {W} ranks · {n} float64 per rank · root 0")
    runs, expect = spawn(W, rank_main, data), oracle(data, W)
    worst, problems = 0.0, []
    for i, name in enumerate(ALGO):
        print(f"\n== {name} ({ALGO[name]}) ==")
        splits = [f" split {data['splits'][r]}" if name == "all_to_all" else ""
                  for r in range(W)]
        befores = [fmt({"scatter": data["root_rows"] if r == 0 else None,
                        "all_to_all": data["a2a"][r]}.get(name, data["xs"][r]),
                       40 - len(splits[r])) + splits[r] for r in range(W)]
        width = max(map(len, befores))
        for r in range(W):
            got = runs[r][i][1]
            print(f"rank {r}  before {befores[r]:<{width}}   after "
                  f"{fmt(got, WIDTH - 24 - width)}")
            want = expect[name][r]
            if (got is None) != (want is None) or (got is not None and got.shape != want.shape):
                problems.append(f"{name} rank {r}: got {fmt(got)}, oracle {fmt(want)}")
            elif got is not None and got.size:
                worst = max(worst, float(np.max(np.abs(got - want))))
        sent = [runs[r][i][2] for r in range(W)]
        pred, formula = predicted_bytes(name, W, n, data)
        print(f"bytes sent per rank: {sent}" + ("   = predicted" if sent == pred else
                                                 f"\npredicted:           {pred}"))
        print(f"  predicted by {formula}, n = {8 * n} B")
        if sent != pred:
            problems.append(f"{name}: bytes sent {sent} != predicted {pred}")
    if worst > 0 or problems:
        print(f"\nMISMATCH: {'; '.join(problems) or f'max |Δ| = {worst:.1e}'}")
        return 1
    print(f"\nOK: every collective matches the oracle on {W} ranks (max |Δ| = {worst:.1e}); "
          "bytes sent as predicted")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
