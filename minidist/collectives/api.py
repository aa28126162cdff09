"""The public collectives: torch.distributed-shaped calls that validate, pick and run an algorithm.

Every function here is called by every rank of a group, SPMD, with matching
arguments. Each one
    1. resolves group=None to the world group of the running job;
    2. validates its input and raises ValueError saying what is wrong and how to
       fix it (nothing is sent before validation passes);
    3. picks the algorithm: algo="auto" asks cost.choose(op, nbytes, W), any other
       name must be one of the algorithms listed for that collective;
    4. opens exactly one header scope, `group.collective(op, x, ...)`, so the call
       is numbered, recorded in the flight recorder and stamped on every message;
    5. runs the algorithm, or with async_op=True hands it to the group's FIFO
       worker and returns its Work (wait() gives the result). An async send that
       cannot have to wait runs at once instead (the eager send, see send()).
The lean path: a synchronous call whose signature (op, dtype, shape, root, reduce
op, algo) was validated before runs steps 3-5 prepared (collectives/prepared.py): after one
dict lookup, straight into its header scope and algorithm. A small all_reduce costs
a few microseconds of Python this way (bench/collectives.py measures it against MPI).

Contract shared by all calls:
    x            a NumPy array (a NumPy scalar is taken as 0-d). A non-C-contiguous x
                 is copied into a contiguous one first (the algorithms slice flat views
                 of it); object dtypes are refused (pointers mean nothing elsewhere).
    results      always new arrays; the input is never modified. With async_op=True
                 do not modify x until wait() has returned (as in torch.distributed).
    root         a GROUP rank in 0..W-1 (for a subgroup, not the global rank).
    op           "sum", "avg", "max", "min", "prod" (reduce_ops.py); avg on integers
                 is refused: use "sum" and divide.
    ordering     a synchronous call first waits for this group's queued async calls,
                 so calls run in program order on every rank.

    broadcast(x, root)        -> x of the root, on every rank
    reduce(x, root, op)       -> reduction on the root; None elsewhere
    all_reduce(x, op)         -> reduction on every rank
    reduce_scatter(x, op)     -> chunk `rank` of np.array_split(reduction.ravel(), W)
    all_gather(x)             -> np.stack of every rank's x: (W, *x.shape)
    gather(x, root)           -> np.stack on the root; None elsewhere
    scatter(xs, root)         -> xs[rank] of the root's (W, ...) array
    all_to_all(x, split_sizes)-> rows addressed to this rank, in source-rank order
    barrier()                 -> None, once every rank has arrived
    send(x, dst, tag)         -> None (or a Work): x goes to group rank dst
    recv(out, src, tag)       -> out, filled with the message of the matching send
    isend(x, dst, tag)        -> Work: send with async_op=True (wait() gives None)
    irecv(out, src, tag)      -> Work: recv with async_op=True (wait() gives out)
    sendrecv(x, dst, src, tag)-> out: x goes to dst while src's x arrives (a shift)

Algorithms (cost.ALGOS): ring.py, tree.py, halving_doubling.py ("halving"),
direct.py (canonical rank order, bitwise reproducible), all_to_all.py ("pairwise").
Read next: the algorithm modules, starting with ring.py.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from minidist.collectives import all_to_all as a2a
from minidist.collectives import calibration, cost, direct, halving_doubling, hierarchical
from minidist.collectives import prepared, ring, tiers, tree
from minidist.collectives.reduce_ops import check_op
from minidist.runtime.group import Work
from minidist.runtime.world import world

_ALGOS: dict[str, dict[str, Callable]] = {
    "all_reduce": {"ring": ring.all_reduce, "tree": tree.all_reduce,
                   "halving": halving_doubling.all_reduce, "direct": direct.all_reduce,
                   "hierarchical": hierarchical.all_reduce},
    "reduce_scatter": {"ring": ring.reduce_scatter, "halving": halving_doubling.reduce_scatter,
                       "direct": direct.reduce_scatter,
                       "hierarchical": hierarchical.reduce_scatter},
    "all_gather": {"ring": ring.all_gather, "halving": halving_doubling.all_gather,
                   "hierarchical": hierarchical.all_gather},
    "broadcast": {"tree": tree.broadcast, "ring": ring.broadcast},
    "reduce": {"tree": tree.reduce, "ring": ring.reduce},
    "gather": {"tree": tree.gather},
    "scatter": {"tree": tree.scatter},
    "all_to_all": {"pairwise": a2a.all_to_all},
}


# --- validation -------------------------------------------------------------------------

def _group(group):
    """The group to use: the given one, or the world group of the running job."""
    return group if group is not None else world()


def _array(x: Any, what: str) -> np.ndarray:
    """x as a C-contiguous ndarray (copied only if it is not contiguous), or ValueError."""
    if isinstance(x, np.generic):                 # a NumPy scalar, e.g. loss.sum(): 0-d array
        x = np.asarray(x)
    if not isinstance(x, np.ndarray):
        hint = " (a CuPy array? use cupy.asnumpy(x))" if hasattr(x, "__cuda_array_interface__") \
            else ""
        raise ValueError(f"{what}: x must be a NumPy array, got {type(x).__name__}{hint}. "
                         "Wrap it with np.asarray(x).")
    if x.dtype.hasobject:
        raise ValueError(f"{what}: x has dtype {x.dtype}, which holds Python object pointers "
                         "that mean nothing in another process. Use a numeric dtype.")
    # (np.ascontiguousarray would turn a 0-d array into shape (1,); 0-d is always contiguous)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _root(root: Any, group, what: str) -> int:
    W = group.size
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < W:
        raise ValueError(
            f"{what}: root={root!r} is not a rank of group '{getattr(group, 'name', '?')}', "
            f"which has ranks 0..{W - 1}. Pass a group rank in that range (for a subgroup, "
            "its rank inside the group, not its global rank).")
    return int(root)


def _algo(op: str, algo: Any, nbytes: int, group) -> str:
    if algo == "auto":
        nodes = getattr(group, "nodes", None)
        if nodes is not None and nodes.count(group.ranks) > 1 and op in tiers.ALGOS:
            return _across_nodes(op, nbytes, group)
        return cost.choose(op, nbytes, group.size,
                           shared_memory=getattr(group, "supports_shared", False))
    if not isinstance(algo, str) or algo not in _ALGOS[op]:
        raise ValueError(f"{op}: unknown algo {algo!r}. Use 'auto' or one of "
                         f"{', '.join(map(repr, _ALGOS[op]))}.")
    return algo


def _across_nodes(op: str, nbytes: int, group) -> str:
    """"auto" for a group spanning emulated nodes (runtime/nodes.py): the algorithm
    collectives/tiers.py prices cheapest with this machine's calibrated link inside a node
    and the nodes' link across (the hierarchical one only when every node holds as many of
    the group's ranks)."""
    nodes, c = group.nodes, calibration.constants(group.size)
    topo = tiers.Topology(nodes.ranks_per_node, tiers.Link(c.alpha, max(c.beta, 1e-15), c.gamma),
                          tiers.Link(nodes.alpha, max(nodes.beta, 1e-15), c.gamma))
    even = _even(group)
    best = [(tiers.seconds(op, a, group.ranks, nbytes, topo), a) for a in tiers.ALGOS[op]
            if a != "hierarchical" or even]
    return min(best)[1]


def _even(group) -> bool:
    """True if every node the group touches holds as many of its ranks."""
    try:
        hierarchical.grid(group)
        return True
    except ValueError:
        return False


def _sizes(sizes: Any, W: int, what: str, total: int | None = None) -> list[int]:
    """A list of W non-negative ints (summing to `total` when given), or ValueError."""
    try:
        out = [int(s) for s in sizes]
        ok = len(out) == W and all(s >= 0 and s == v for s, v in zip(out, sizes))
    except (TypeError, ValueError):
        ok = False
    if not ok or (total is not None and sum(out) != total):
        need = f" summing to x.shape[0] = {total}" if total is not None else ""
        raise ValueError(f"all_to_all: {what}={sizes!r} must be {W} non-negative integers"
                         f"{need}, one per rank of the group.")
    return out


def _run(group, op: str, header_x, body: Callable[[], Any], async_op: bool, *,
         root: int | None = None, reduce_op: str | None = None, algo: str = "",
         p2p: tuple[int, int, int] | None = None):
    """Run body() inside the one header scope of this call, now or on the async worker."""
    if not isinstance(async_op, bool):
        raise ValueError(f"{op}: async_op must be True or False, got {async_op!r}.")

    def call():
        with group.collective(op, header_x, root=root, reduce_op=reduce_op, algo=algo,
                              p2p=p2p):
            return body()

    if async_op:
        return group.submit(call)
    drain = getattr(group, "drain", None)       # queued async calls on this group go first
    if drain is not None:                       # (a transport that runs submit() inline,
        drain()                                 # like runtime/mpi.py, has nothing queued)
    return call()


# --- the collectives --------------------------------------------------------------------

def broadcast(x: np.ndarray, root: int = 0, group=None, algo: str = "auto",
              async_op: bool = False):
    """Return a copy of the root's x on every rank (x: same shape and dtype everywhere)."""
    g = _group(group)
    x, root = _array(x, "broadcast"), _root(root, g, "broadcast")
    name = _algo("broadcast", algo, x.nbytes, g)
    fn = _ALGOS["broadcast"][name]
    return _run(g, "broadcast", x, lambda: fn(x, g, root), async_op, root=root, algo=name)


def reduce(x: np.ndarray, root: int = 0, op: str = "sum", group=None, algo: str = "auto",
           async_op: bool = False):
    """Return x_0 (op) ... (op) x_{W-1} on the root and None on every other rank."""
    g = _group(group)
    x, root = _array(x, "reduce"), _root(root, g, "reduce")
    check_op(op, x.dtype, "reduce")
    name = _algo("reduce", algo, x.nbytes, g)
    fn = _ALGOS["reduce"][name]
    return _run(g, "reduce", x, lambda: fn(x, g, root, op), async_op, root=root,
                reduce_op=op, algo=name)


def all_reduce(x: np.ndarray, op: str = "sum", group=None, algo: str = "auto",
               async_op: bool = False):
    """Return x_0 (op) ... (op) x_{W-1} on every rank, same shape as x.

    algo="direct" folds in rank order 0..W-1: bitwise reproducible and equal to
    the single-process sum; the others are equal up to rounding.
    """
    g = _group(group)
    if async_op is False and type(x) is np.ndarray:
        key = ("all_reduce", op, algo, x.dtype, x.shape)
        run = prepared.lookup(g, key, x)
        if run is not None:
            return run(x)
    x = _array(x, "all_reduce")
    check_op(op, x.dtype, "all_reduce")
    name = _algo("all_reduce", algo, x.nbytes, g)
    fn = _ALGOS["all_reduce"][name]
    prepared.remember(g, ("all_reduce", op, algo, x.dtype, x.shape), async_op, algo, x.nbytes,
              lambda x: fn(x, g, op), "all_reduce", x, reduce_op=op, name=name)
    return _run(g, "all_reduce", x, lambda: fn(x, g, op), async_op, reduce_op=op, algo=name)


def reduce_scatter(x: np.ndarray, op: str = "sum", group=None, algo: str = "auto",
                   async_op: bool = False):
    """Return chunk `rank` of np.array_split((x_0 (op) ... (op) x_{W-1}).ravel(), W).

    Any number of elements N works: chunks have N // W or N // W + 1 elements,
    the longer ones first (np.array_split's rule).
    """
    g = _group(group)
    x = _array(x, "reduce_scatter")
    check_op(op, x.dtype, "reduce_scatter")
    name = _algo("reduce_scatter", algo, x.nbytes, g)
    fn = _ALGOS["reduce_scatter"][name]
    return _run(g, "reduce_scatter", x, lambda: fn(x, g, op), async_op, reduce_op=op,
                algo=name)


def all_gather(x: np.ndarray, group=None, algo: str = "auto", async_op: bool = False):
    """Return np.stack of every rank's x, shape (W, *x.shape), on every rank."""
    g = _group(group)
    x = _array(x, "all_gather")
    name = _algo("all_gather", algo, x.nbytes, g)
    fn = _ALGOS["all_gather"][name]
    return _run(g, "all_gather", x, lambda: fn(x, g), async_op, algo=name)


def gather(x: np.ndarray, root: int = 0, group=None, algo: str = "auto",
           async_op: bool = False):
    """Return np.stack of every rank's x, shape (W, *x.shape), on the root; None elsewhere."""
    g = _group(group)
    x, root = _array(x, "gather"), _root(root, g, "gather")
    name = _algo("gather", algo, x.nbytes, g)
    fn = _ALGOS["gather"][name]
    return _run(g, "gather", x, lambda: fn(x, g, root), async_op, root=root, algo=name)


def scatter(xs: np.ndarray | None, root: int = 0, group=None, algo: str = "auto",
            async_op: bool = False):
    """Return row `rank` of the root's xs (shape (W, ...)); other ranks may pass xs=None.

    The row shape and dtype travel from the root first, so only the root needs xs.
    """
    g = _group(group)
    root = _root(root, g, "scatter")
    if g.rank == root:
        xs = _array(xs, "scatter")
        if xs.ndim == 0 or xs.shape[0] != g.size:
            raise ValueError(f"scatter: the root's xs has shape {xs.shape}; it needs one row "
                             f"per rank, shape ({g.size}, ...). Stack the {g.size} pieces "
                             "with np.stack.")
    row_bytes = xs.nbytes // g.size if g.rank == root else 0     # only one algorithm anyway
    name = _algo("scatter", algo, row_bytes, g)
    fn = _ALGOS["scatter"][name]
    return _run(g, "scatter", None, lambda: fn(xs if g.rank == root else None, g, root),
                async_op, root=root, algo=name)


def all_to_all(x: np.ndarray, split_sizes: Sequence[int] | None = None, group=None,
               algo: str = "auto", async_op: bool = False,
               recv_sizes: Sequence[int] | None = None):
    """Return the rows every rank addressed to this rank, stacked in source-rank order.

    x (N, *rest): rows [sum(split_sizes[:r]), sum(split_sizes[:r+1])) go to rank r.
    split_sizes=None splits evenly (N must divide by W, same N on every rank).
    recv_sizes, when known, saves the exchange of counts; otherwise it is
    all_to_all(np.array(split_sizes)). rest and dtype must agree on every rank.
    """
    g = _group(group)
    x = _array(x, "all_to_all")
    W = g.size
    if x.ndim == 0:
        raise ValueError("all_to_all: x is 0-d; it needs a leading axis of rows to split. "
                         "Use x.reshape(1) or x[None].")
    if split_sizes is None and x.shape[0] % W:
        raise ValueError(f"all_to_all: x has {x.shape[0]} rows, which do not split evenly "
                         f"over the {W} ranks of group '{getattr(g, 'name', '?')}'. Pass "
                         "split_sizes (one row count per rank), e.g. "
                         f"{[len(c) for c in np.array_split(np.empty(x.shape[0]), W)]}.")
    sizes = None if split_sizes is None else _sizes(split_sizes, W, "split_sizes", x.shape[0])
    recv = None if recv_sizes is None else _sizes(recv_sizes, W, "recv_sizes")
    name = _algo("all_to_all", algo, x.nbytes, g)
    fn = _ALGOS["all_to_all"][name]
    # header: rows differ per rank, so stamp a 0-row view (checks dtype and trailing dims)
    return _run(g, "all_to_all", x[:0], lambda: fn(x, g, sizes, recv), async_op, algo=name)


def barrier(group=None, async_op: bool = False):
    """Return None once every rank of the group has called barrier."""
    g = _group(group)
    return _run(g, "barrier", None, g.barrier, async_op)


# --- point to point ---------------------------------------------------------------------
#
# send and recv are called by two ranks of a group, not by all of them. Each is numbered
# in the group like a collective (its own sequence number, its record in the flight
# recorder, "send #4 on 'pp.act0>1' (float64 (2, 8, 16), group rank 0 -> 1, tag 3)"),
# so a hung receive names the message it waits for. The k-th send to a rank must match
# that rank's k-th recv from this one: same tag, dtype and shape, or CollectiveMismatch.
# Use them on a group whose other ranks make no calls in between (e.g. a 2-rank group
# per direction, as parallel/pipeline/stage.py does): sequence numbers count every call.
# isend/irecv (torch.distributed's names) are send/recv with async_op=True: they run on
# the group's worker in program order, under the same rule. So, unlike torch, two ranks
# that swap messages write it as rank 0: isend then irecv, rank 1: irecv then isend (both
# posting isend first is a CollectiveMismatch naming both sends, at once, never a hang).
# Or both call sendrecv, which moves the two messages together, chunk by chunk: a shift
# around a ring of any number of ranks, with messages of any size, cannot deadlock.

def _tag(tag: Any, what: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0:
        raise ValueError(f"{what}: tag={tag!r} must be an int >= 0 (it labels the message, "
                         "e.g. a micro-batch index).")
    return int(tag)


def _other_rank(peer: Any, group, what: str, name: str) -> int:
    W, gname = group.size, getattr(group, "name", "?")
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) \
            or not 0 <= peer < W or peer == group.rank:
        raise ValueError(f"{what}: {name}={peer!r} must be another rank of group '{gname}' "
                         f"(group ranks 0..{W - 1}; this rank is {group.rank}).")
    return int(peer)


def send(x: np.ndarray, dst: int, group=None, tag: int = 0, async_op: bool = False):
    """Send x to group rank `dst`, whose matching recv(out, src=this rank, tag) gets a copy.

    Blocks until x has left this rank's buffer (the receiver's mailbox may hold a few
    slots: runtime/p2p.py); async_op=True returns at once with a Work, sends on this
    group's worker in program order (do not modify x before wait()).
    Cost: x.nbytes sent, one copy in and one out.

    The eager send (MPI's eager protocol, in one line): with async_op=True, if nothing is
    queued on the group's worker and x fits in the free slots of the mailbox to dst, the
    copy-in cannot wait for the receiver, so it is done here, now, and the Work returned
    is already complete. Handing it to the worker instead costs the receiver the worker's
    wake-up and its turn at the interpreter lock while this thread computes on: measured
    on a pipeline's messages here, a median of 290 us from send to receive (up to 4 ms)
    against 30 us eager (bench/pipeline.py). Program order is kept: a send queued behind
    another goes to the worker.
    """
    g = _group(group)
    x = _array(x, "send")
    dst = _other_rank(dst, g, "send", "dst")
    tag = _tag(tag, "send")
    eager = getattr(g, "sends_eagerly", None)   # (runtime/mpi.py runs every call inline)
    if async_op and eager is not None and eager(x, dst):
        _run(g, "send", x, lambda: g.send(x, dst), False, p2p=(g.rank, dst, tag))
        return Work.completed()
    return _run(g, "send", x, lambda: g.send(x, dst), async_op, p2p=(g.rank, dst, tag))


def recv(out: np.ndarray, src: int | None = None, group=None, tag: int = 0,
         async_op: bool = False):
    """Fill `out` (and return it) with the message of group rank src's matching send.

    Blocks until it has arrived or the group's timeout passes (CollectiveTimeout naming
    this recv and the flight recorder); a different tag, dtype or shape is a
    CollectiveMismatch naming both calls. async_op=True returns a Work at once; its
    wait() returns out. Unlike torch.distributed (whose recv returns the sender's rank
    and takes src=None for any sender), src is required: every message is matched to a
    numbered call on both ranks, so the receiver names its sender.
    """
    g = _group(group)
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous:
        raise ValueError("recv: out must be a C-contiguous NumPy array to receive into "
                         f"(got {type(out).__name__}); make one with np.empty(shape, dtype).")
    if src is None:
        raise ValueError("recv: src=None (receive from any rank) is not supported: minidist "
                         "matches each message to a numbered call on both ranks, so the "
                         "receiver must name its sender. Pass src=<the sender's group rank>.")
    src = _other_rank(src, g, "recv", "src")
    tag = _tag(tag, "recv")
    return _run(g, "recv", out, lambda: g.recv(src, out), async_op, p2p=(src, g.rank, tag))


def isend(x: np.ndarray, dst: int, group=None, tag: int = 0):
    """Start sending x to group rank `dst`; return its Work (wait() returns None).

    send(x, dst, group, tag, async_op=True), named as in torch.distributed. Do not
    modify x before wait(). Matching rule: see this section's comment above.
    """
    return send(x, dst, group=group, tag=tag, async_op=True)


def irecv(out: np.ndarray, src: int | None = None, group=None, tag: int = 0):
    """Start receiving src's matching send into `out`; return its Work (wait() returns out).

    recv(out, src, group, tag, async_op=True), named as in torch.distributed. Read out
    only after wait() (or once is_completed() is True). src is required (see recv).
    """
    return recv(out, src, group=group, tag=tag, async_op=True)


def sendrecv(x: np.ndarray, dst: int, src: int, out: np.ndarray | None = None, group=None,
             tag: int = 0, async_op: bool = False):
    """Send x to group rank `dst` and, at the same time, receive src's x; return it (in
    `out` when given: C-contiguous, x's shape and dtype).

    Every rank taking part calls sendrecv at the same point of its calls on the group,
    each naming its own peers; the usual case is a shift of the whole group (dst = rank
    + s, src = rank - s, mod W), which the pairwise schedules of parallel/tensor/async_tp.py
    use. The two messages advance together chunk by chunk (runtime/p2p.py), so a shift is
    deadlock-free at any size, where an isend queued before an irecv on the group's FIFO
    worker waits for a peer that waits too once a message outgrows the mailbox.
    The call is numbered in the group like any other; its header is checked by the
    receiver (same sequence number, tag, dtype and shape: call.identity, which leaves out
    the two ranks each end names), or CollectiveMismatch naming both calls.
    async_op=True runs it on the group's worker in program order and returns a Work
    (wait() gives out); do not touch x or out before then. On MPI (runtime/mpi.py) it runs
    inline: correct, with nothing overlapped.
    Cost: x.nbytes sent and received, one copy in and one out each way.
    """
    g = _group(group)
    x = _array(x, "sendrecv")
    dst = _other_rank(dst, g, "sendrecv", "dst")
    src = _other_rank(src, g, "sendrecv", "src")
    tag = _tag(tag, "sendrecv")
    if out is None:
        out = np.empty_like(x)
    elif not isinstance(out, np.ndarray) or not out.flags.c_contiguous \
            or out.shape != x.shape or out.dtype != x.dtype:
        what = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"sendrecv: out must be a C-contiguous NumPy array of x's dtype and "
                         f"shape, {x.dtype} {x.shape} (got {what}); every rank of a shift "
                         "sends and receives the same shape. Pass out=None for a new one.")
    return _run(g, "sendrecv", x, lambda: g.sendrecv(x, dst, src, out), async_op,
                p2p=(src, dst, tag))
