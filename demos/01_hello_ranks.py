"""Hello, ranks: W operating-system processes that know who they are and can talk.

What you will see: each rank's number, its process id and its place in the world
group; the same ranks laid out as a 2-D mesh (dp x tp) with the dp group and the tp
group each rank belongs to; one message passed round a ring (every rank sends its
number to the right and receives from the left); and one all_reduce inside each tp
group. Every rank returns its lines; the launcher prints them in rank order and
checks them: separate processes, groups equal to the rows and columns of
np.arange(W).reshape(dp, tp), every message from the expected neighbour.

Run:       python demos/01_hello_ranks.py [--world-size 4] [--dp 2]
Read with: minidist/runtime/launch.py, minidist/runtime/group.py, minidist/runtime/mesh.py,
           minidist/runtime/p2p.py
Paper:     MPI Forum, "MPI: A Message-Passing Interface Standard" 4.0 (2021), ch. 7
           (groups and communicators); Shoeybi et al. 2019, arXiv:1909.08053, Sec. 4
           (data x tensor parallel groups)
"""

import os

import numpy as np

from minidist.cli import CliParser, at_least
from minidist.collectives import api
from minidist.runtime.launch import spawn
from minidist.runtime.mesh import DeviceMesh

# --- settings (each can be overridden on the command line) ---
WORLD_SIZE, DP = 4, 2


def rank_main(ctx, dp: int, tp: int) -> dict:
    """Everything here runs on every rank; ctx.rank says which one we are."""
    rank, W, world = ctx.rank, ctx.world_size, ctx.world
    mesh = DeviceMesh(ctx.job, ("dp", "tp"), (dp, tp))           # every rank, same order
    dpg, tpg = mesh.group("dp"), mesh.group("tp")
    right, left = (rank + 1) % W, (rank - 1) % W
    me = np.array([rank], np.int64)
    got = world.sendrecv(me, dst=right, src=left) if W > 1 else me.copy()
    tp_sum = api.all_reduce(me, group=tpg)                        # sum of global ranks in my row
    return {"rank": rank, "pid": os.getpid(), "world": (world.name, world.ranks, world.rank),
            "coords": (mesh.coord("dp"), mesh.coord("tp")),
            "dp": (dpg.name, dpg.ranks), "tp": (tpg.name, tpg.ranks),
            "right": right, "got": int(got[0]), "tp_sum": int(tp_sum[0])}


def parse_args(argv=None):
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=at_least(1), default=WORLD_SIZE, help="ranks (1..8)")
    ap.add_argument("--dp", type=at_least(1), default=DP,
                    help="size of the dp axis; tp = W // dp")
    args = ap.parse_args(argv)
    if args.world_size > 8 or args.world_size % args.dp:
        ap.error(f"--world-size {args.world_size} must be 1..8 and divisible by --dp "
                 f"{args.dp}; e.g. --world-size 6 --dp 2 (tp = 3)")
    return args


def check(out: list[dict], W: int, dp: int, tp: int) -> list[str]:
    """Separate processes, groups = rows/columns of the grid, messages from the left."""
    grid = np.arange(W).reshape(dp, tp)
    problems = []
    pids = {o["pid"] for o in out}
    if len(pids) != W or os.getpid() in pids:
        problems.append(f"{len(pids)} distinct pids for {W} ranks")
    for o in out:
        r, (d, t) = o["rank"], o["coords"]
        if tuple(o["dp"][1]) != tuple(grid[:, t]) or tuple(o["tp"][1]) != tuple(grid[d, :]):
            problems.append(f"rank {r}: groups {o['dp'][1]}, {o['tp'][1]} != grid column/row")
        if o["got"] != (r - 1) % W or o["tp_sum"] != int(grid[d].sum()):
            problems.append(f"rank {r}: received {o['got']}, tp sum {o['tp_sum']}")
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    W, dp = args.world_size, args.dp
    tp = W // dp
    print(f"demo 01 · hello ranks · world_size={W} · mesh dp={dp} x tp={tp}")
    print(f"launcher pid {os.getpid()} forks {W} rank processes\n")
    out = spawn(W, rank_main, dp, tp)

    for o in out:
        name, ranks, grank = o["world"]
        print(f"rank {o['rank']}  pid {o['pid']}  group '{name}' ranks {list(ranks)}, "
              f"group rank {grank}")
    grid = np.arange(W).reshape(dp, tp)                            # the reference layout
    print(f"\nmesh: rank = grid[dp, tp], grid = np.arange({W}).reshape({dp}, {tp})")
    print(("        " + "".join(f"tp={t:<3}" for t in range(tp))).rstrip())
    for d in range(dp):
        print((f"  dp={d:<3}" + "".join(f"{r:<6}" for r in grid[d])).rstrip())
    for o in out:
        print(f"rank {o['rank']}  at (dp={o['coords'][0]}, tp={o['coords'][1]})  dp group "
              f"'{o['dp'][0]}' ranks {list(o['dp'][1])}  tp group '{o['tp'][0]}' ranks "
              f"{list(o['tp'][1])}")
    print("\nring exchange: send my rank to the right, receive from the left")
    for o in out:
        print(f"rank {o['rank']}  sent {o['rank']} -> rank {o['right']}   received {o['got']}"
              f"   all_reduce(my rank) over {o['tp'][0]}: {o['tp_sum']}")

    problems = check(out, W, dp, tp)
    if problems:
        print(f"\nMISMATCH: {'; '.join(problems)}")
        return 1
    print(f"\nOK: {W} ranks in {W} processes; groups = the grid's columns and rows; every rank "
          "heard its left")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
