"""Two-level collectives: the fast links inside each node first, the slow ones across nodes on
a share of the message.

A group whose W ranks sit L on each of N nodes (W = N L) has two kinds of link: inside a node
(NVLink, or this machine's shared memory) and across nodes (one network port per GPU, about
ten times slower; emulated here by runtime/nodes.py). A flat ring over all W ranks paces every
step at the slow link. The two-level form (Thakur et al.'s, NCCL's rings and trees inside and
across nodes) sends only 1/L of the message over it:

    all_reduce       1. reduce-scatter inside the node: local rank j ends with column j of
                        the message summed over its node (1/L of it);
                     2. all-reduce across nodes among the N ranks of local index j (the
                        "rail" j; the L rails work at once), on column j;
                     3. all-gather inside the node: every rank has the whole sum.
    reduce_scatter   1., then a reduce-scatter across the rail: each rank keeps its own chunk.
    all_gather       across the rail first (my chunk, the N chunks of my column), then inside
                     the node (the L columns).

The layout of the message: the result chunks are np.array_split(x.ravel(), W)'s, chunk r
belonging to group rank r (as the flat algorithms have them). Place the group's ranks on a
grid, grid[i][j] = the j-th member (in group order) on the i-th node (in order of first
appearance); column j is the chunks of grid[0][j], ..., grid[N-1][j], laid end to end. The
intra-node step reduces whole columns, the rail's step splits column j back into its N
chunks, so rank grid[i][j] ends with exactly its own chunk, for any group order.

Every step is a ring (collectives/ring.py's steps, run on `Members`: the group seen through a
subset of its ranks), so the sums and the copies are the ring's; the two levels change which
ranks add which partial sums, so the bits differ from the flat ring's in the last places
(both are within rounding of the rank-order oracle).

One rank's view (all_reduce, rank grid[i][j], message of n bytes):
    intra RS: L-1 steps to and from my node's neighbours, n/L bytes each;
    rail AR:  2(N-1) steps to and from my rail's neighbours, n/(L N) bytes each;
    intra AG: L-1 steps, n/L bytes each.
Bytes sent across nodes: 2 (N-1)/N n/L per rank (the flat ring: 2 (W-1)/W n, of which the
ranks at a node's edge send all across). Cost on two tiers: collectives/tiers.py
(`seconds(op, "hierarchical", ...)`), the model `auto` chooses with.
Needs the same number of the group's ranks on every node (ValueError otherwise).
References: Thakur, Rabenseifner & Gropp 2005, IJHPCA 19(1) (two-level reduction);
    NVIDIA NCCL documentation (NCCL_ALGO: rings and trees across and inside nodes).
Read next: runtime/nodes.py (the tiers), collectives/tiers.py (their cost).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minidist.collectives.reduce_ops import finish
from minidist.collectives.ring import all_gather_steps, reduce_scatter_steps


class Members:
    """`group` seen through `members` (group ranks, in ring order): rank and size in that
    subset, and the point-to-point calls a ring step makes, translated to group ranks."""

    def __init__(self, group, members: list[int]):
        self.group, self.members = group, members
        self.rank, self.size = members.index(group.rank), len(members)

    def sendrecv(self, x: np.ndarray, dst: int, src: int, out: np.ndarray | None = None,
                 combine: Callable | None = None) -> np.ndarray:
        return self.group.sendrecv(x, dst=self.members[dst], src=self.members[src], out=out,
                                   combine=combine)


def grid(group) -> list[list[int]]:
    """grid[i][j]: the group rank of the j-th member on the i-th node the group touches.
    ValueError unless every node holds the same number of the group's ranks."""
    nodes = getattr(group, "nodes", None)
    if nodes is None:
        return [list(range(group.size))]                  # one node: a ring inside it
    rows: dict[int, list[int]] = {}
    for r, g in enumerate(group.ranks):
        rows.setdefault(nodes.node(g), []).append(r)
    out = list(rows.values())
    if len({len(row) for row in out}) != 1:
        raise ValueError(f"hierarchical: group '{group.name}' has {[len(r) for r in out]} "
                         "ranks on its nodes; the two-level algorithms need the same number "
                         "on every node. Use algo='ring' for this group.")
    return out


def _places(group):
    """(grid, my node index i, my local index j, my node's Members, my rail's Members)."""
    g = grid(group)
    i = next(k for k, row in enumerate(g) if group.rank in row)
    j = g[i].index(group.rank)
    return g, i, j, Members(group, g[i]), Members(group, [row[j] for row in g])


def _columns(chunks: list[np.ndarray], g: list[list[int]]):
    """A buffer holding the chunks column by column (module docstring), its L column views,
    and per column the views of its N chunks (in node order)."""
    N, L = len(g), len(g[0])
    order = [g[i][j] for j in range(L) for i in range(N)]
    buf = np.concatenate([chunks[r] for r in order]) if order else np.empty(0)
    sizes = [len(chunks[r]) for r in order]
    bounds = np.cumsum([0, *sizes])
    pieces = [buf[bounds[k]:bounds[k + 1]] for k in range(len(order))]
    columns = [buf[bounds[j * N]:bounds[(j + 1) * N]] for j in range(L)]
    return buf, columns, [pieces[j * N:(j + 1) * N] for j in range(L)], order


def reduce_scatter(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """Chunk `rank` of np.array_split((x_0 (op) ... (op) x_{W-1}).ravel(), W), in two levels.

    Shapes: x any shape, identical on every rank; returns a new 1-D array, as ring's.
    Cost: (L-1) alpha_i + (L-1)/L n beta_i inside, (N-1) alpha_e + (N-1)/(N L) n beta_e
    across (module docstring)."""
    g, i, j, node, rail = _places(group)
    chunks = np.array_split(x.reshape(-1), group.size)
    buf, columns, pieces, _ = _columns(chunks, g)
    reduce_scatter_steps(columns, node, op)             # column j summed over my node
    reduce_scatter_steps(pieces[j], rail, op)           # my chunk summed over every node
    return finish(op, pieces[j][i], group.size).copy()


def all_gather(x: np.ndarray, group) -> np.ndarray:
    """np.stack([x_0, ..., x_{W-1}]) on every rank, shape (W, *x.shape), in two levels:
    across the rail (my column), then inside the node (every column).
    Cost: (N-1) alpha_e + (N-1) m beta_e across, (L-1) alpha_i + (L-1) N m beta_i inside,
    m = x.nbytes."""
    g, i, j, node, rail = _places(group)
    N, L, W = len(g), len(g[0]), group.size
    buf = np.empty((L, N, x.size), x.dtype)               # column-major: column j = buf[j]
    buf[j, i] = x.reshape(-1)
    all_gather_steps(list(buf[j]), rail)
    all_gather_steps([buf[c].reshape(-1) for c in range(L)], node)
    out = np.empty((W, *x.shape), x.dtype)
    rows = out.reshape(W, x.size)
    for c in range(L):
        for k in range(N):
            rows[g[k][c]] = buf[c, k]
    return out


def all_reduce(x: np.ndarray, group, op: str = "sum") -> np.ndarray:
    """x_0 (op) ... (op) x_{W-1} on every rank, same shape: the two-level reduce-scatter,
    the op's last step on my chunk, then the two-level all-gather of the chunks.
    Cost: 2 (L-1) alpha_i + 2 (L-1)/L n beta_i inside, 2 (N-1) alpha_e + 2 (N-1)/(N L) n
    beta_e across."""
    g, i, j, node, rail = _places(group)
    chunks = np.array_split(x.reshape(-1), group.size)
    buf, columns, pieces, order = _columns(chunks, g)
    reduce_scatter_steps(columns, node, op)
    reduce_scatter_steps(pieces[j], rail, op)
    mine = pieces[j][i]
    mine[...] = finish(op, mine, group.size)
    all_gather_steps(pieces[j], rail)                    # column j finished on my rail
    all_gather_steps(columns, node)                      # every column on my node
    out = np.empty(x.size, x.dtype)
    starts = np.cumsum([0, *(len(c) for c in chunks)])
    for piece, r in zip((p for col in pieces for p in col), order):
        out[starts[r]:starts[r + 1]] = piece
    return out.reshape(x.shape)
