"""Quantised collectives: send int8 or int4 codes with one scale per block instead of the numbers.

A collective's time across nodes is its bytes over the slow link. ZeRO++ (Wang et al. 2023)
cuts those bytes by sending each block of B numbers as B small integers and one float32
scale, then turning them back into numbers on arrival:

    quantise    s = max_k |x_k| / q          (one scale per block of B; q = 2^(bits-1) - 1:
                c_k = round(x_k / s)          127 for int8, 7 for int4; c_k in [-q, q])
    dequantise  x~_k = c_k s                 |x_k - x~_k| <= s / 2 = max |x| / (2 q)

An all-zero block has s = 0 and codes 0 (exact); a block holding an inf or a NaN
dequantises to NaN, so a non-finite value is never turned into a finite one. Scales are
float32 (4 bytes a block), codes one byte (int8) or half a byte (int4, two to a byte). A
message of n numbers therefore travels as `packed_nbytes(n, bits, block)` bytes: for
B = 256, 1/7.9 (int8) or 1/15.5 (int4) of float64's; int4 with B = 32, 1/12.8.

fp8 codes ("e4m3": torchao's float8 all-gather for FSDP in spirit): block b is multiplied by
the power of two m_b = 2^floor(log2(448 / amax_b)) and rounded to E4M3, one byte a number;
its scale 1 / m_b (|x - x~| <= 2^-4 |x| for a normal x m_b). Same bytes as int8, a relative
instead of an absolute error: small numbers in a block keep their precision.

Blocks restart at `cuts`, the edges of the parameters laid end to end in the vector (and at
the edges of the pieces a message is made of), so that a block never holds two parameters:
under tensor parallelism a replicated parameter (a LayerNorm's gain) must come back the
same on every tp rank, which a scale shared with a tp-sharded weight would not give it.

Two collectives built from the public ones (so every byte is counted, tier by tier):

    all_gather (qwZ)      every rank quantises its x, the codes are all-gathered, every rank
                          dequantises every row: each rank gets the SAME x~_0 .. x~_{W-1}
                          (its own row included). Bytes: (W-1) packed(n) sent per rank (ring).
    reduce_scatter (qgZ)  the sum over a group of N nodes x L ranks, two hops of all-to-all
                          with one quantisation each (never once per ring step, which would
                          add W - 1 rounding errors to a chunk):
        1. inside the node: the message x (W S numbers, chunk c = i' L + j' for rank (i', j'))
           is cut by local destination j': to local rank j' go the N chunks (i', j'), quantised
           as one message; local rank j' dequantises the L messages it gets and sums them in
           local rank order: p[i'] = sum_j x~_(i,j)[i', j'] for every i', my node's partial sum;
        2. across nodes: p[i'] is quantised and sent to rank (i', j') on my rail (the ranks of
           local index j' on every node); it dequantises the N it gets and sums them in node
           order: chunk (i', j') summed over all W ranks, within the rounding below.
        Bytes per rank: (L-1) packed(N S) inside the node, (N-1) packed(S) across nodes: the
        slow tier carries 1/L of the message, quantised (the paper: 1/4 of the data at int4
        from fp16; the flat ring of float64 sends 2 (W-1) S 8 bytes over the edge of a node).
        Error of element k of my chunk: |y~ - y| <= sum_i (sum_j s1_(i,j) / 2 + s2_i / 2), with
        s1, s2 the scales of the blocks holding k in hops 1 and 2: at most
        (W max|x| + N max|p|) / (2 q) over the inputs x and the node partials p.

Every sum is a left fold in rank order, so the result is the same bits on every run and
equals `simulate_reduce_scatter`, the same algorithm on one process (the tests' oracle).
One rank's view, shapes and costs are in each function's docstring.
Reference: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for
    Giant Model Training", arXiv:2306.10209, Sec. 3.1 (qwZ: block-based quantisation),
    Sec. 3.3 (qgZ: hierarchical all-to-all, one quantisation per hop), Table 2 (volumes).
Read next: parallel/zero/zeropp.py (ZeRO-3 with qwZ, hpZ and qgZ).
"""

from __future__ import annotations

from typing import Any, Callable

import ml_dtypes
import numpy as np

from minidist.collectives import api

BLOCK = 256                                   # numbers sharing one scale
BITS = (8, 4, "e4m3")
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)    # 448


def levels(bits) -> int:
    """q = 2^(bits-1) - 1: the largest code of a symmetric signed `bits`-bit integer (for
    "e4m3": 448, the largest fp8 E4M3 value)."""
    if bits not in BITS:
        raise ValueError(f"quantized: bits={bits!r}; use 8 (int8), 4 (int4) or 'e4m3' (fp8).")
    return int(E4M3_MAX) if bits == "e4m3" else 2 ** (bits - 1) - 1


def block_starts(n: int, block: int = BLOCK, cuts=()) -> np.ndarray:
    """Where each block of a vector of n numbers starts: every `block` numbers, restarting
    at each cut (0 < cut < n), so that no block straddles a cut (a parameter's edge)."""
    if not (isinstance(block, int) and block >= 1):
        raise ValueError(f"quantized: block={block!r} must be an int >= 1.")
    edges = sorted({0, *(int(c) for c in cuts if 0 < c < n)})
    if n == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(a, b, block, dtype=np.int64)
                           for a, b in zip(edges, edges[1:] + [n])])


def packed_nbytes(n: int, bits: int, block: int = BLOCK, cuts=(),
                  scale_slots: int | None = None) -> int:
    """Bytes of n numbers quantised: codes (n, or ceil(n/2) for int4) + 4 bytes per scale
    (one a block; scale_slots: room for that many, when messages must be the same size)."""
    levels(bits)
    slots = len(block_starts(n, block, cuts)) if scale_slots is None else scale_slots
    return (-(-n // 2) if bits == 4 else n) + 4 * slots


def quantize(x: np.ndarray, bits, block: int = BLOCK,
             cuts=()) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 (n,), scales float32 (one a block)) of x.ravel() (module docstring);
    "e4m3": fp8 codes, each block scaled by a power of two (e4m3_codes)."""
    q, flat = levels(bits), np.asarray(x).reshape(-1)
    if flat.dtype.kind != "f":                                # bf16 and the like
        flat = flat.astype(np.float32)
    starts = block_starts(flat.size, block, cuts)
    if flat.size == 0:
        return np.zeros(0, E4M3 if bits == "e4m3" else np.int8), np.zeros(0, np.float32)
    amax = np.maximum.reduceat(np.abs(flat), starts)          # NaN stays NaN
    if bits == "e4m3":
        return e4m3_codes(flat, starts, amax)
    scales = (amax / q).astype(np.float32)
    bad = ~np.isfinite(scales)                                # inf or NaN in the block
    safe = np.where((scales > 0) & ~bad, scales, 1.0)
    sizes = np.diff(np.append(starts, flat.size))
    codes = np.rint(np.where(np.repeat(bad, sizes), 0.0, flat) / np.repeat(safe, sizes))
    scales[bad] = np.nan
    return np.clip(codes, -q, q).astype(np.int8), scales


def e4m3_codes(flat: np.ndarray, starts: np.ndarray, amax: np.ndarray) -> tuple:
    """fp8 codes: block b scaled by m_b = 2^floor(log2(448 / amax_b)) (exact: a power of
    two) and rounded to E4M3 (nearest even; |x - x~| <= 2^-4 |x| for normal values);
    its scale 1 / m_b, so that x~ = code * scale as for the integer codes. m_b is kept
    within 2^-126 .. 2^126, so that its inverse is a float32 normal: in a block whose
    amax is below about 2^-117 the error is then absolute, at most half an E4M3 subnormal
    step (2^-10) times 2^-126. An all-zero block: scale 1, codes 0; a block with inf or
    NaN: scale NaN."""
    ok = np.isfinite(amax) & (amax > 0)
    with np.errstate(divide="ignore", over="ignore"):
        exp = np.where(ok, np.floor(np.log2(E4M3_MAX / np.where(ok, amax, 1.0))), 0.0)
    mult = np.exp2(np.clip(exp, -126, 126))          # 1 / m stays a float32 normal
    sizes = np.diff(np.append(starts, flat.size))
    y = np.clip(flat.astype(np.float64) * np.repeat(mult, sizes), -E4M3_MAX, E4M3_MAX)
    codes = np.where(np.repeat(np.isfinite(amax), sizes), y, 0.0).astype(E4M3)
    scales = np.where(np.isfinite(amax), 1.0 / mult, np.nan).astype(np.float32)
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray, block: int = BLOCK,
               dtype=np.float64, cuts=()) -> np.ndarray:
    """x~ = codes * (each code's block scale), in `dtype`, shape (n,)."""
    n = codes.size
    sizes = np.diff(np.append(block_starts(n, block, cuts), n))
    return codes.astype(dtype) * np.repeat(scales.astype(dtype), sizes)


def pack(x: np.ndarray, bits: int, block: int = BLOCK, cuts=(),
         scale_slots: int | None = None) -> np.ndarray:
    """x.ravel() as one uint8 message: codes (int4: two to a byte, low nibble first, each
    stored as code + 8), then the float32 scales (zero-padded to scale_slots).
    Length packed_nbytes(x.size, bits, block, cuts, scale_slots)."""
    codes, scales = quantize(x, bits, block, cuts)
    if scale_slots is not None:
        scales = np.concatenate([scales, np.zeros(scale_slots - scales.size, np.float32)])
    if bits == 4:
        c = (codes.astype(np.int16) + 8).astype(np.uint8)
        if c.size % 2:
            c = np.append(c, np.uint8(8))
        body = c[0::2] | (c[1::2] << 4)
    else:
        body = codes.view(np.uint8)                           # int8 or fp8: one byte
    return np.concatenate([body, scales.view(np.uint8)])


def unpack(msg: np.ndarray, n: int, bits: int, block: int = BLOCK,
           dtype=np.float64, cuts=()) -> np.ndarray:
    """The inverse of pack: x~ (n,) in `dtype` from one uint8 message (padding ignored)."""
    body_n = -(-n // 2) if bits == 4 else n
    blocks = len(block_starts(n, block, cuts))
    body, scales = msg[:body_n], msg[body_n:body_n + 4 * blocks].view(np.float32)
    if bits == 4:
        c = np.empty(2 * body_n, np.int8)
        c[0::2] = (body & 0x0F).astype(np.int8) - 8
        c[1::2] = (body >> 4).astype(np.int8) - 8
        codes = c[:n]
    else:
        codes = body.view(E4M3 if bits == "e4m3" else np.int8)
    if np.dtype(dtype).kind != "f":                           # bf16: computed in fp32
        return dequantize(codes, scales, block, np.float32, cuts).astype(dtype)
    return dequantize(codes, scales, block, dtype, cuts)


def roundtrip(x: np.ndarray, bits: int, block: int = BLOCK, cuts=()) -> np.ndarray:
    """x~ = unpack(pack(x)), x's shape and dtype: what a receiver gets for x."""
    flat = np.asarray(x).reshape(-1)
    return unpack(pack(flat, bits, block, cuts), flat.size, bits, block, flat.dtype,
                  cuts).reshape(np.shape(x))


def piece_cuts(cuts, ranges: list[tuple[int, int]]) -> list[int]:
    """The cuts of a message made of the pieces [a, b) of a vector with `cuts`, laid end to
    end: each piece's own edges, and the vector's cuts inside each piece, shifted."""
    out, at = [], 0
    for a, b in ranges:
        out += [at] + [c - a + at for c in cuts if a < c < b]
        at += b - a
    return out


class Then:
    """The handle of an async call whose result is then transformed: wait() returns
    fn(work.wait()), computed once, on the waiting thread (e.g. dequantising the codes)."""

    def __init__(self, work, fn: Callable[[Any], Any]) -> None:
        self.work, self.fn, self._done, self._value = work, fn, False, None

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._value, self._done = self.fn(self.work.wait(timeout)), True
            self.work = None
        return self._value


def all_gather(x: np.ndarray, group, bits: int = 8, block: int = BLOCK, cuts=(),
               async_op: bool = False):
    """qwZ: np.stack of every rank's x~ (quantised, then dequantised), (W, *x.shape), x.dtype.

    x is rank r's piece [r n, (r+1) n) of a vector with `cuts` (its parameters' edges: a
    block never mixes two parameters). One rank's view: pack my x (scales padded to the
    most any rank's piece needs, so every message has one size), all-gather the W messages
    (ring), unpack each with its piece's cuts. Every rank gets the same W rows, its own row
    the x~ the others see. Cost: (W-1) alpha + (W-1) packed_nbytes beta per rank.
    async_op=True: returns a handle whose wait() gives the rows (unpacked by the waiter)."""
    n, dtype, shape, W = x.size, x.dtype, x.shape, group.size
    own = [piece_cuts(cuts, [(r * n, (r + 1) * n)]) for r in range(W)]
    slots = max(len(block_starts(n, block, c)) for c in own)
    msg = pack(x, bits, block, own[group.rank], slots)
    work = api.all_gather(msg, group=group, algo="ring", async_op=async_op)

    def rows(parts: np.ndarray) -> np.ndarray:
        return np.stack([unpack(p, n, bits, block, dtype, c).reshape(shape)
                         for p, c in zip(parts, own)])
    return Then(work, rows) if async_op else rows(work)


def reduce_scatter(x: np.ndarray, node, rail, bits: int = 4, block: int = BLOCK,
                   cuts=()) -> np.ndarray:
    """qgZ: my chunk (S,) of the sum over W = N L ranks of x (W S,), in two quantised hops.

    node: my node's ranks (size L, my local index j = node.rank); rail: the ranks of local
    index j on every node (size N, my node i = rail.rank). Chunk c of x belongs to the rank
    with c = i L + j (the layout of a dp group made of (rail, node) axes, node fastest).
    cuts: x's parameter edges (no block mixes two parameters). Steps 1-2 of the module
    docstring; sums in rank order; returns a new array, x.dtype.
    Cost: (L-1) alpha_intra + (L-1) packed(N S) beta_intra + (N-1) alpha_inter
          + (N-1) packed(S) beta_inter, per rank."""
    L, N = node.size, rail.size
    flat = np.asarray(x).reshape(-1)
    if flat.size % (L * N):
        raise ValueError(f"quantized.reduce_scatter: {flat.size} numbers do not split into "
                         f"{N} x {L} = {N * L} equal chunks; pad x to a multiple of {N * L}.")
    S, dtype, i, j = flat.size // (L * N), flat.dtype, rail.rank, node.rank
    plan = _Hops(S, N, L, cuts)
    by_place = flat.reshape(N, L, S)                            # [node i', local j', :]
    # 1. inside the node: the N chunks of local rank j' go to j', quantised as one message
    sent = [pack(by_place[:, jj, :], bits, block, plan.column(jj)) for jj in range(L)]
    got = _exchange(sent, node, packed_nbytes(N * S, bits, block, plan.column(j)))
    partial = _fold(unpack(m, N * S, bits, block, dtype, plan.column(j))
                    for m in got).reshape(N, S)
    # 2. across nodes: my node's partial of chunk (i', j) goes to node i' on my rail
    sent = [pack(partial[ii], bits, block, plan.chunk(ii, j)) for ii in range(N)]
    got = _exchange(sent, rail, packed_nbytes(S, bits, block, plan.chunk(i, j)))
    return _fold(unpack(m, S, bits, block, dtype, plan.chunk(i, j)) for m in got)


class _Hops:
    """The cuts of qgZ's messages: local rank j''s column (chunks (0, j) .. (N-1, j) end to
    end) in hop 1, chunk (i, j) in hop 2."""

    def __init__(self, S: int, N: int, L: int, cuts) -> None:
        self.S, self.N, self.L, self.cuts = S, N, L, list(cuts)

    def _range(self, i: int, j: int) -> tuple[int, int]:
        start = (i * self.L + j) * self.S
        return start, start + self.S

    def column(self, j: int) -> list[int]:
        return piece_cuts(self.cuts, [self._range(i, j) for i in range(self.N)])

    def chunk(self, i: int, j: int) -> list[int]:
        return piece_cuts(self.cuts, [self._range(i, j)])


def _exchange(messages: list[np.ndarray], group, recv_nbytes: int) -> list[np.ndarray]:
    """All-to-all of one uint8 message to each rank (sizes may differ by destination);
    returns the message from each rank in rank order (each recv_nbytes long)."""
    got = api.all_to_all(np.concatenate(messages), split_sizes=[m.size for m in messages],
                         group=group, recv_sizes=[recv_nbytes] * group.size)
    return np.split(got, group.size)


def _fold(parts) -> np.ndarray:
    """Left fold in the given (rank) order: ((p_0 + p_1) + p_2) + ..."""
    it = iter(parts)
    acc = next(it).copy()
    for p in it:
        acc += p
    return acc


def simulate_reduce_scatter(xs: list[np.ndarray], L: int, bits: int = 4,
                            block: int = BLOCK, cuts=()) -> list[np.ndarray]:
    """The oracle: reduce_scatter's result for every rank, on one process, from the W
    ranks' inputs xs (rank r = i L + j). The same quantisations and sums, in the same order."""
    W = len(xs)
    N, S = W // L, xs[0].size // W
    dtype, plan = xs[0].dtype, _Hops(S, N, L, cuts)
    by_place = [x.reshape(N, L, S) for x in xs]
    partial = {}                                                 # (node i, local j) -> (N, S)
    for i in range(N):
        for jj in range(L):
            c = plan.column(jj)
            partial[i, jj] = _fold(unpack(pack(by_place[i * L + j][:, jj, :], bits, block, c),
                                          N * S, bits, block, dtype, c)
                                   for j in range(L)).reshape(N, S)
    out = []
    for r in range(W):
        i, j = divmod(r, L)
        c = plan.chunk(i, j)
        out.append(_fold(unpack(pack(partial[k, j][i], bits, block, c), S, bits, block, dtype, c)
                         for k in range(N)))
    return out
