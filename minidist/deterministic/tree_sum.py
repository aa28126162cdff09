"""The aligned tree sum: add per-grain partial results in one fixed order, whoever computes them.

Floating-point addition is not associative: (a + b) + c and a + (b + c) can differ in the
last bit. A gradient is a sum over samples, so the bits of a trained model depend on how
the samples were grouped: one batch of B in one process, B/2 on each of two data-parallel
ranks summed by an all-reduce, or M micro-batches accumulated one after the other all
round differently (within ~1e-16 relative, but not bit for bit). Determinism across
layouts needs a sum whose grouping does not depend on the layout.

The idea: fix a GRAIN (here one sample: every layout computes each sample's gradient with
the same operations on the same shapes) and fix one binary TREE over the grain indices
0..G-1: the aligned tree, whose nodes are the ranges [i 2^j, (i+1) 2^j) cut at G,

    G = 6:               [0, 8)
                    /              \\
               [0, 4)              [4, 8) -> [4, 6)
              /      \\             /      \\
          [0, 2)    [2, 4)     [4, 6)    ([6, 8): empty, no addition)
          /   \\     /   \\      /   \\
         0     1   2     3    4     5

A node's value is left + right (just left when the right child starts at or past G). Any
rank that holds a contiguous range of grains (a dp rank's samples, a micro-batch's) can
sum the complete aligned nodes inside its range without knowing the others: `TreeSum`
does it as grains arrive, keeping a stack and merging two nodes as soon as they are
siblings (the way a binary counter carries). The ranks then exchange their nodes, and
`combine` evaluates the fixed tree from them: every addition of the tree happens once, on
the same two operands, in the same order, whatever the layout. The result is bitwise the
single-process tree sum of the same grains.

One rank's view (rank r of a group, holding grains [a_r, b_r) of G):
    1. for each grain i in increasing order: tree.push(i, value_i)   (no communication)
    2. nodes = tree.nodes(): O(log G) aligned ranges and their sums
    3. exchange the nodes (all_gather of the list; parallel/ decides how) and
       root = combine(all nodes, G): every rank computes the same bits.
Cost: G - 1 additions in all (as a plain sum), plus an exchange of at most 2 log2(G) + 1
values per rank instead of one: a reference's price for exact reproducibility.

Used by the deterministic mode (`--deterministic`, this package): baseline.py sums
per-sample gradients and losses with it, and the layouts do the same over their groups
(deterministic/step.py); every other fixed-order sum of the mode is this tree too.
References: Demmel & Nguyen 2013, "Fast reproducible floating-point summation" (the
    problem and an order-independent alternative); the pairwise (tree) summation of
    Higham 1993, "The accuracy of floating point summation", SIAM J. Sci. Comput. 14(4).
Read next: deterministic/matmul.py, then baseline.py (train_single_process,
deterministic=True).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

Node = tuple[int, int, Any]           # (first grain, end grain, the sum over them)


def is_aligned(lo: int, hi: int) -> bool:
    """True if [lo, hi) is a node of the aligned tree: a power-of-two size dividing lo."""
    size = hi - lo
    return size >= 1 and size & (size - 1) == 0 and lo % size == 0


class TreeSum:
    """The complete aligned nodes over the grains pushed so far (in increasing order)."""

    def __init__(self) -> None:
        self._stack: list[Node] = []

    def push(self, index: int, value: Any) -> None:
        """Add grain `index` (larger than every grain pushed before) with its value."""
        if self._stack and index < self._stack[-1][1]:
            raise ValueError(f"TreeSum.push: grain {index} after grain "
                             f"{self._stack[-1][1] - 1}; push grains in increasing order")
        self._stack.append((index, index + 1, value))
        while len(self._stack) >= 2:
            (a, b, u), (c, d, v) = self._stack[-2], self._stack[-1]
            if b != c or d - c != b - a or not is_aligned(a, d):
                break
            self._stack[-2:] = [(a, d, u + v)]         # two siblings: their parent

    def nodes(self) -> list[Node]:
        """The nodes held, in grain order (each an aligned range and its sum)."""
        return list(self._stack)


def combine(nodes: list[Node], count: int) -> Any:
    """The value of the aligned tree over grains 0..count-1, from disjoint aligned nodes
    that together cover them (each rank's TreeSum.nodes(), gathered). ValueError if a
    grain is missing or a range is not a node of the tree."""
    if count < 1:
        raise ValueError(f"combine: count={count}; a sum needs at least one grain")
    table = {}
    for lo, hi, value in nodes:
        if not is_aligned(lo, hi) or hi > count:
            raise ValueError(f"combine: [{lo}, {hi}) is not a node of the tree over "
                             f"{count} grains")
        table[(lo, hi)] = value
    return _subtree(table, 0, 1 << (count - 1).bit_length(), count)


def _subtree(table: dict, lo: int, size: int, count: int) -> Any:
    """The sum of the aligned node [lo, lo + size) from the nodes in `table`. (A module
    function, not a closure inside combine: a recursive closure is a reference cycle,
    which would keep every node's array alive until the garbage collector runs.)"""
    if (lo, lo + size) in table:
        return table[(lo, lo + size)]
    if size == 1:
        raise ValueError(f"combine: grain {lo} of {count} is in no node; every grain "
                         f"must be pushed by exactly one rank")
    half = size // 2
    left = _subtree(table, lo, half, count)
    return left if lo + half >= count else left + _subtree(table, lo + half, half, count)


def stacked_nodes(values: Any, index: Sequence[int]) -> list[Node]:
    """The aligned nodes of the grains stacked along values' axis 0, grain values[j] having
    the global index index[j] (increasing; runs of consecutive indices, possibly several):
    TreeSum's nodes, computed a level at a time over whole arrays (vectorised) instead of a
    grain at a time. Each node is a perfect subtree, its sum its pairs added level by level."""
    out, j = [], 0
    while j < len(index):
        lo, run = index[j], 1
        while j + run < len(index) and index[j + run] == lo + run:
            run += 1                                       # [lo, lo + run): one run
        hi = lo + run
        while lo < hi:
            size = 1
            while lo % (2 * size) == 0 and lo + 2 * size <= hi:
                size *= 2                                  # the largest aligned node at lo
            part = values[j:j + size]
            while len(part) > 1:
                part = part[0::2] + part[1::2]             # one level of the perfect tree
            out.append((lo, lo + size, part[0]))
            lo, j = lo + size, j + size
    return out


def gather_nodes(nodes: list[Node], shape: tuple, dtype,
                 all_gather: Callable[[np.ndarray], np.ndarray], bound: int) -> list[Node]:
    """Every rank's nodes (values of `shape`), through all_gather(array) -> (W, *shape): a
    collective over the group that holds the other grains (parallel/ passes one, so that
    this module needs no runtime). bound: the most nodes any rank of the group may have
    (the callers' ranks hold equally many grains, and a rank's nodes are at most its
    grains); a rank with more is an error.
    Two collectives: the ranks' node counts (8 B each), then each rank's ranges (int64)
    and values as the bytes of one buffer, padded to the largest count (not to `bound`:
    a tensor-parallel rank's tiles often form fewer nodes than tiles, and every padding
    node would travel and be copied for nothing)."""
    if len(nodes) > bound:
        raise ValueError(f"gather_nodes: {len(nodes)} nodes, more than bound={bound}")
    most = int(all_gather(np.array([len(nodes)], np.int64)).max())
    size, dtype = int(np.prod(shape, dtype=np.int64)), np.dtype(dtype)
    head = 16 * most                                  # (lo, hi) int64 pairs
    buf = np.empty(head + most * size * dtype.itemsize, np.uint8)
    ranges = buf[:head].view(np.int64).reshape(most, 2)
    values = buf[head:].view(dtype).reshape(most, size)
    ranges[...] = -1
    values[len(nodes):] = 0                           # padding: sent, never read
    for j, (lo, hi, v) in enumerate(nodes):
        ranges[j], values[j] = (lo, hi), np.asarray(v).reshape(-1)
    out = []
    for row in all_gather(buf):                                        # (W, bytes)
        theirs = row[:head].view(np.int64).reshape(most, 2)
        vals = row[head:].view(dtype).reshape(most, size)
        out += [(int(lo), int(hi), vals[j].reshape(shape))
                for j, (lo, hi) in enumerate(theirs) if lo >= 0]
    return out
