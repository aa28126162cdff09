"""Canonical-order reductions: every element summed in rank order 0..W-1, bitwise reproducible.

Floating-point addition is not associative, so a ring or a tree that adds the
same W numbers in a different grouping may round differently, and the order
can even depend on which message arrived first. This module removes every such
choice: element j of the result is always

    ((x_0[j] (op) x_1[j]) (op) x_2[j]) ... (op) x_{W-1}[j]

exactly as NumPy computes `acc = x0; acc = acc + x1; ...` in one process. The
result is the same bits on every rank, on every run, for every arrival order,
and equal to the single-process fold; this is what the determinism goal builds on.

It runs over shared memory without messages. Every rank writes its input into
its own region of a shared buffer, the group synchronises, and then each rank
reads its peers' regions in place (zero-copy) to reduce its own 1/W of the
elements, in rank order. The work is split W ways, like a ring's, but with
two barriers per round instead of 2(W-1) dependent messages.

One rank's view (all_reduce, rank r of W, per round of at most `window` elements):
    1. copy the chunks of my window that my peers fold (every chunk but mine:
       chunk p of np.array_split(window, W) is folded by rank p) into the input
       area of my shared region; my own chunk stays in my private x.
    2. barrier: every input is in place.
    3. fold my share in rank order, taking rank q's operand from q's region (my
       own from x), straight into my result; apply the op's last step; copy the
       finished share to my output area.
    4. barrier: every share is finished (and nobody reads inputs any more).
    5. copy every peer's finished share into my result.
Per rank region of S bytes: input area [0, S_in), output area [S_in, S) with
S_in ~ S W/(W+1). A message larger than the input area is done in rounds.

Why steps are safe without more barriers: a rank writes its input area only
before barrier 2 of a round, when every peer has passed barrier 4 of the
previous round (so stopped reading inputs); it writes its output area only
after barrier 2, when every peer has finished step 5 of the previous round.

Shapes: x identical shape and dtype on every rank.
Communication: group.shared (one buffer per size, reused) and group.barrier.
Reference: the canonical order (rank order, README's "Deterministic mode"); the split of the
    reduction work (each rank finishes 1/W of the elements) is a reduce-scatter
    followed by an all-gather, as in Thakur, Rabenseifner & Gropp 2005,
    IJHPCA 19(1), 49-66, here through shared memory instead of messages.
In place (all_reduce_shared): when x already lives in a group.shared() region,
as data parallelism's gradient buckets do, the copy-in and copy-out are
skipped: every rank folds its share straight from its peers' regions and the
result lands back in its own region, with two barriers per call.

Bytes on the wire. Over shared memory nothing is "sent"; a rank reads. So a
byte of rank q's region that rank p reads counts as sent by q and received by
p, the traffic a network would carry. Every function here counts exactly that
in group.stats (each rank can compute what its peers read from it):
all_reduce and all_reduce_shared (N - n_r) + (W-1) n_r per rank r with share
n_r, on average 2(W-1)/W N like the ring; reduce_scatter N - n_r.

Inputs of at most direct_small.SMALL_BYTES take direct_small.py's path: the same
fold, one wait instead of two barriers.

Read next: direct_small.py, then all_to_all.py.
"""

from __future__ import annotations

import numpy as np

from minidist.collectives import direct_small
from minidist.collectives.reduce_ops import combine, finish

# Bytes of shared memory per rank. Large enough that typical gradients need few rounds,
# small enough that W regions fit in /dev/shm comfortably.
BUFFER_BYTES = 4 << 20
_ALIGN = 64


def _split(buffer_bytes: int, W: int) -> tuple[int, int]:
    """Return (input area bytes, output area bytes) of one rank's region."""
    s_in = (buffer_bytes * W // (W + 1)) // _ALIGN * _ALIGN
    return s_in, buffer_bytes - s_in


def window(itemsize: int, W: int, buffer_bytes: int = BUFFER_BYTES) -> int:
    """Elements of x that one all_reduce round handles: limited by both areas."""
    s_in, s_out = _split(buffer_bytes, W)
    m = min(s_in // itemsize, (s_out // itemsize) * W)
    if m < 1:
        raise ValueError(
            f"direct: a shared region of {buffer_bytes} bytes per rank cannot hold one "
            f"element of {itemsize} bytes for {W} ranks. Use buffer_bytes >= "
            f"{_ALIGN * (W + 2)} (the default is {BUFFER_BYTES}).")
    return m


def _shares(n: int, W: int) -> np.ndarray:
    """offsets[k] = first element of chunk k of np.array_split(range(n), W); offsets[W] = n."""
    base, extra = divmod(n, W)
    return np.array([k * base + min(k, extra) for k in range(W + 1)])


def _fold(operands: list[np.ndarray], op: str, out: np.ndarray) -> np.ndarray:
    """Write operands[0] (op) operands[1] (op) ... (then the op's last step) into `out`,
    in list order (= rank order), and return it. The first combine reads two operands
    straight into `out`, so each input byte is read once."""
    W = len(operands)
    if W == 1:
        out[...] = operands[0]
    else:
        combine(op, operands[0], operands[1], out=out)
        for x in operands[2:]:
            combine(op, out, x, out=out)
    done = finish(op, out, W)
    if done is not out:                                   # avg: the division made a new array
        out[...] = done
    return out


def _peers(buf, dtype: np.dtype, count: int, offset: int, W: int) -> list[np.ndarray]:
    """Views of `count` elements at `offset` in every rank's region, in rank order."""
    return [buf.peer(p, dtype, count, offset) for p in range(W)]


def _count_reads(group, nbytes: int) -> None:
    """Count `nbytes` of this rank's memory read by its peers as sent (and, by symmetry of
    the algorithms here, the same number received): see "Bytes on the wire" above."""
    group.stats["bytes_sent"] += nbytes
    group.stats["bytes_recv"] += nbytes


def all_reduce(x: np.ndarray, group, op: str = "sum",
               buffer_bytes: int = BUFFER_BYTES) -> np.ndarray:
    """Return x_0 (op) x_1 (op) ... (op) x_{W-1}, folded in rank order, on every rank.

    Algorithm: steps 1-5 of the module docstring, once per round of
    window(itemsize, W, buffer_bytes) elements.

    Shapes: x any shape, identical on every rank; returns a new array, same shape.
    Cost (n = x.nbytes, R = ceil(n / window bytes) rounds): 2R barriers, modelled
        as 2R ceil(log2 W) alpha, + 2(W-1)/W n beta (read peers' inputs, then
        their finished shares) + (W-1)/W n gamma + (W-1)/W n beta for the copy-in
        of the chunks the peers fold.
    Numerics: bitwise equal to the sequential rank-order fold on one process,
        on every rank, regardless of timing.
    """
    if x.nbytes <= direct_small.SMALL_BYTES and buffer_bytes == BUFFER_BYTES:
        return direct_small.all_reduce(x, group, op)          # same bits, one wait
    rank, W = group.rank, group.size
    dtype, isz = x.dtype, x.dtype.itemsize
    buf = group.shared(f"direct/{buffer_bytes}", buffer_bytes)
    s_in, _ = _split(buffer_bytes, W)
    flat, out = x.reshape(-1), np.empty(x.size, x.dtype)
    m = window(isz, W, buffer_bytes)
    for start in range(0, x.size, m):
        win = flat[start:start + m]
        offs = _shares(win.size, W)
        lo, hi = offs[rank], offs[rank + 1]
        staged = buf.local(dtype, win.size)
        for p in range(W):                                                 # step 1
            if p != rank:                  # only what peers fold: my own share stays put
                staged[offs[p]:offs[p + 1]] = win[offs[p]:offs[p + 1]]
        group.barrier()                                                    # step 2
        inputs = _peers(buf, dtype, hi - lo, lo * isz, W)
        inputs[rank] = win[lo:hi]                                          # step 3
        share = _fold(inputs, op, out[start + lo:start + hi])
        buf.local(dtype, hi - lo, s_in)[...] = share
        group.barrier()                                                    # step 4
        for p in range(W):                                                 # step 5
            if p != rank:
                count = offs[p + 1] - offs[p]
                out[start + offs[p]:start + offs[p + 1]] = buf.peer(p, dtype, count, s_in)
        _count_reads(group, (win.size - (hi - lo) + (W - 1) * (hi - lo)) * isz)
    return out.reshape(x.shape)


def reduce_scatter(x: np.ndarray, group, op: str = "sum",
                   buffer_bytes: int = BUFFER_BYTES) -> np.ndarray:
    """Return chunk `rank` of np.array_split(x_0 (op) ... (op) x_{W-1}, W), rank-order fold.

    Algorithm (this rank's view): chunk k of x goes to rank k. Per round j, every
    rank writes sub-window j (at most w elements) of each of its peers' chunks
    into its input area, chunk k at element offset k*w (its own chunk stays in
    x); barrier; this rank folds sub-window j of chunk `rank` from ranks 0, 1,
    ..., W-1 in order, straight from their regions (its own from x); barrier
    (inputs free again).

    Shapes: x any shape with N elements; returns a new 1-D array of N//W or
        N//W + 1 elements: exactly all_reduce(x).ravel()[offs[rank]:offs[rank+1]].
    Cost (n = x.nbytes, R rounds): 2R ceil(log2 W) alpha + (W-1)/W n (beta + gamma)
        + (W-1)/W n beta for the copy-in of the peers' chunks.
    Numerics: bitwise equal to the rank-order fold, hence to the corresponding
        chunk of direct.all_reduce: ZeRO-2's sharded gradients match DDP's bits.
    """
    rank, W = group.rank, group.size
    dtype, isz = x.dtype, x.dtype.itemsize
    buf = group.shared(f"direct/{buffer_bytes}", buffer_bytes)
    s_in, _ = _split(buffer_bytes, W)
    w = s_in // isz // W                    # per-chunk sub-window; writes stay in [0, s_in)
    if w < 1:
        raise ValueError(
            f"direct.reduce_scatter: a shared region of {buffer_bytes} bytes per rank "
            f"cannot hold one {isz}-byte element per rank for {W} ranks. Use "
            f"buffer_bytes >= {_ALIGN * (W + 2) * isz}.")
    flat, offs = x.reshape(-1), _shares(x.size, W)
    out = np.empty(offs[rank + 1] - offs[rank], dtype)
    for j in range(0, int(np.max(np.diff(offs), initial=0)), w):
        for k in range(W):             # sub-window j of every chunk my peers fold (not mine)
            if k != rank:
                piece = flat[offs[k] + j:min(offs[k] + j + w, offs[k + 1])]
                buf.local(dtype, piece.size, k * w * isz)[...] = piece
        group.barrier()
        count = max(0, min(w, out.size - j))
        inputs = _peers(buf, dtype, count, rank * w * isz, W)
        inputs[rank] = flat[offs[rank] + j:offs[rank] + j + count]     # mine, from x itself
        _fold(inputs, op, out[j:j + count])
        group.barrier()
    _count_reads(group, (x.size - out.size) * isz)      # peers read all chunks but mine
    return out


def _out_area(group, share_bytes: int):
    """The scratch region where each rank publishes its finished share (grows, never shrinks).

    Rounded up to a power of two so that a run with a few bucket sizes allocates it once or
    twice; every rank asks for the same size because shares are computed the same way."""
    nbytes = max(_ALIGN, 1 << max(0, share_bytes - 1).bit_length())
    return group.shared("direct/in-place-out", nbytes)


def all_reduce_shared(buf, dtype, count: int, group, op: str = "sum",
                      offset: int = 0) -> np.ndarray:
    """In place: set every rank's `count` elements at `offset` of its region of `buf` to
    x_0 (op) x_1 (op) ... (op) x_{W-1}, folded in rank order; return this rank's view.

    `buf` is a group.shared() region (DDP's gradient buckets live in one), and x_r
    is what rank r holds there when it calls. No copy-in, no copy-out.

    Algorithm (this rank's view; share k = chunk k of np.array_split(range(count), W)):
        1. barrier: every rank's x is in place.
        2. fold share `rank` from the regions of ranks 0, 1, ..., W-1, in order, into a
           temporary; write it to my slot of a scratch "out" region AND over share
           `rank` of my own region.
        3. barrier: every share is finished.
        4. copy share p (p != rank) from rank p's out slot into my region.
    Why two barriers are enough (the brief sketch had four):
        - writing share `rank` of my region in step 2 races with nobody: a peer p
          reads only share p of my region, and only in step 2.
        - after barrier 3 nobody reads any data region again in this call (step 4 reads
          out slots), so the caller may overwrite its region as soon as this returns.
        - my out slot is rewritten only in step 2 of the NEXT call, after its barrier 1,
          which every peer reaches only once it has finished step 4 of this call.
    The caller must not write its region while the call runs; x must have the same
    count, dtype and offset on every rank (checked through the call header, if any).

    Shapes: the region holds `count` elements of `dtype` from byte `offset`.
    Bytes (group.stats): a byte of rank q's memory read by rank p is counted as
        sent by q and received by p. Rank r sends (count - n_r) + (W-1) n_r elements
        and receives the same, n_r = size of share r: on average over the ranks
        exactly 2(W-1)/W * count, the ring's figure (with an even split, on every rank).
    Cost (n = count * itemsize): 2 barriers (modelled 2 ceil(log2 W) alpha)
        + 2(W-1)/W n beta + (W-1)/W n gamma: the copy-in and copy-out of all_reduce
        are gone.
    Numerics: bitwise equal to all_reduce above and to the rank-order fold, on every rank.
    """
    rank, W, dtype = group.rank, group.size, np.dtype(dtype)
    isz, offs = dtype.itemsize, _shares(count, W)
    lo, n = int(offs[rank]), int(offs[rank + 1] - offs[rank])
    out = _out_area(group, int(offs[1] - offs[0]) * isz)      # share 0 is the largest
    mine = buf.local(dtype, count, offset)
    group.barrier()                                                        # step 1
    share = _fold(_peers(buf, dtype, n, offset + lo * isz, W), op,         # step 2
                  out.local(dtype, n))
    mine[lo:lo + n] = share
    group.barrier()                                                        # step 3
    for p in range(W):                                                     # step 4
        if p != rank:
            mine[offs[p]:offs[p + 1]] = out.peer(p, dtype, int(offs[p + 1] - offs[p]))
    _count_reads(group, (count - n + (W - 1) * n) * isz)
    return mine
