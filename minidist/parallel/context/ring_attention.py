"""Ring attention: the sequence is split over the cp group and K/V blocks travel round a ring.

Every rank of the context-parallel (cp) group holds the queries, keys and values of its own
T/W positions. Attention needs every query against every key, so the key/value blocks go
round the ring: in W steps each rank sees every block once, computes the scores of its
queries against the block it holds, and passes the block to its right neighbour. The
softmax over all T keys is assembled block by block with the online softmax: keep per
query row the running max m, the running sum l = sum_j exp(s_j - m) and the running output
acc = sum_j exp(s_j - m) v_j, and rescale them by exp(m_old - m_new) when a block raises the
max. The result is exactly softmax(q k^T / sqrt(D) + M) v, never an approximation.

The pass of the next block is started (on the group's worker thread) before the compute on
the current one, so communication hides behind compute; RING_TIMES records, per pass, the
worker's sendrecv time and how long compute then waited for it (1 - wait/send is the share
hidden; `python -m minidist bench train --cp 2` prints it). The backward is a second ring:
p is recomputed per block from the saved log-sum-exp, dQ accumulates here, and the dK/dV
accumulator of each block travels with it and arrives back at its owner after W steps.

Causal masking is by GLOBAL positions. Only query rows that see a key of the block and keys
that some query sees are computed, so a block wholly in the future is skipped. With the
contiguous layout rank r computes r + 1 blocks (rank W-1 W times rank 0's); the zig-zag
layout cuts T into 2W chunks and gives rank r chunks r and 2W-1-r, so every rank computes
the same (`attention_work`, `imbalance`). Dropout draws the single process's masks by
global (head, query, key) index and applies them to the numerator only (y = sum_j mask_ij
p_ij v_j / l_i), which is exactly dropout(softmax(s)) @ v.

One rank's view (rank r of W, my queries at positions P_r, K/V block of rank src):
    forward
    1. m = -inf, l = 0, acc = 0 for my T_loc query rows; kv = my (K, V) block.
    2. step s = 0..W-1, src = (r - s) % W: start passing kv to rank r+1 (not at s = W-1);
    3. on the rows/keys of the block that can see each other: s = q k^T / sqrt(D) (masked),
       m' = max(m, rowmax s), a = exp(m - m'), p = exp(s - m'),
       l = a l + rowsum p, acc = a acc + (p * mask) v, m = m';
    4. wait for the block from rank r-1. At the end y = acc / l, lse = m + log l (kept).
    backward (dy given)
    5. delta_i = dy_i . y_i; dQ = 0; dkv = 0 (the accumulator of my own block).
    6. step s: start passing kv right; recompute p = exp(s - lse), dp = (dy v^T) * mask,
       dS = p (dp - delta); dQ += dS K / sqrt(D); dK_blk = dS^T Q / sqrt(D),
       dV_blk = (p * mask)^T dy; take block src's accumulator from rank r-1 (s > 0),
       add dK_blk, dV_blk and pass it right.
    7. after W steps the accumulator arriving from rank r-1 is my own block's: dK, dV.

Shapes and sharding (h heads here, T_loc = T / W):
    q, k, v, y[B, h, T_cp, D]: rank r holds positions P_r (layout order), lse (B, h, T_loc)
Communication (cp group, ring neighbours only, N = B h T_loc D numbers per K or V block):
    forward   W-1 sendrecv of 2N (K, V) per rank
    backward  W-1 sendrecv of 2N (K, V) and W of 2N (dK, dV; the last one brings each
              accumulator home), each overlapping the compute of a block. W = 1: none.

References:
    Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
        Near-Infinite Context", arXiv:2310.01889, Sec. 3 and Algorithm 1.
    Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867.
    Dao et al. 2022, "FlashAttention", arXiv:2205.14135, Sec. 3.1 (online softmax) and
        App. B.2 (backward from the saved statistics: delta_i = dO_i . O_i).
    Zig-zag layout: Megatron-Core context parallelism; zhuzilin/ring-flash-attention
        (GitHub). Brandon et al. 2023, "Striped Attention", arXiv:2311.09431, balances
        the same causal work with a different layout.
Read next: parallel/tensor/sequence.py (Megatron sequence parallelism), nn/attention.py.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minidist import backend
from minidist.autograd import Tensor
from minidist.autograd.tensor import Function
from minidist.nn.layers import Dropout, DropoutKey

LAYOUTS = ("zigzag", "contiguous")


# --- layouts: which global positions each rank holds --------------------------------------

def _check_split(T: int, W: int, r: int, parts: int, what: str) -> int:
    """T // parts, or ValueError naming the lengths that work."""
    if W < 1 or not 0 <= r < W:
        raise ValueError(f"{what}: rank r={r} is not in a group of W={W} ranks (need 0 <= r < W).")
    if T < 0 or T % parts:
        near = " or ".join(str(n) for n in (parts * (T // parts), parts * (T // parts + 1)) if n)
        raise ValueError(f"{what}: T={T} positions do not split into {parts} equal pieces for "
                         f"W={W} ranks. Use T a multiple of {parts} ({near}), e.g. by padding "
                         "the sequence.")
    return T // parts


def contiguous_positions(T: int, W: int, r: int) -> np.ndarray:
    """Rank r's global positions [r T/W, (r+1) T/W); T must be a multiple of W."""
    n = _check_split(T, W, r, W, "contiguous layout")
    return np.arange(r * n, (r + 1) * n)


def zigzag_positions(T: int, W: int, r: int) -> np.ndarray:
    """Rank r's global positions: chunks r and 2W-1-r of the 2W chunks of T, in that order."""
    n = _check_split(T, W, r, 2 * W, "zig-zag layout")
    late = 2 * W - 1 - r
    return np.concatenate([np.arange(r * n, (r + 1) * n), np.arange(late * n, (late + 1) * n)])


def sequence_layout(T: int, W: int, layout: str = "zigzag") -> list[np.ndarray]:
    """[P_0, ..., P_{W-1}]: every rank's global positions under `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"ring attention: unknown layout {layout!r}; use one of {LAYOUTS}.")
    fn = zigzag_positions if layout == "zigzag" else contiguous_positions
    return [fn(T, W, r) for r in range(W)]


def _visible(q_pos: np.ndarray, k_pos: np.ndarray, causal: bool):
    """(rows, cols): my query rows that see at least one key of the block, and the keys that
    at least one of them sees. Everything else is masked for every pair: not computed."""
    if not causal or not (len(q_pos) and len(k_pos)):
        return _compact(np.arange(len(q_pos))), _compact(np.arange(len(k_pos)))
    rows = np.nonzero(q_pos >= k_pos.min())[0]
    cols = np.nonzero(k_pos <= q_pos.max())[0]
    return _compact(rows), _compact(cols)


def _compact(idx: np.ndarray):
    """A slice when idx is a run of consecutive indices (a view, no copy), else idx."""
    if len(idx) and idx[-1] - idx[0] + 1 == len(idx):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _count(idx, n: int) -> int:
    return len(range(n)[idx]) if isinstance(idx, slice) else len(idx)


def attention_work(T: int, W: int, layout: str = "zigzag", causal: bool = True) -> list[int]:
    """Per rank, the number of (query, key) scores ring attention computes: sum over the W
    blocks of |visible rows| x |visible keys|. Blocks wholly in the future are skipped (0);
    a block only partly in the future (the diagonal one) counts whole, masked scores
    included, because that is what the code computes."""
    P = sequence_layout(T, W, layout)
    work = []
    for r in range(W):
        total = 0
        for src in range(W):
            rows, cols = _visible(P[r], P[src], causal)
            total += _count(rows, len(P[r])) * _count(cols, len(P[src]))
        work.append(total)
    return work


def imbalance(work: list[int]) -> float:
    """max(work) / mean(work): 1.0 is perfect balance (and what an idle group returns)."""
    mean = sum(work) / len(work)
    return 1.0 if mean == 0 else max(work) / mean


# --- one ring step: pass a block to the right neighbour -----------------------------------

def _pass_right(group, block: np.ndarray, step: int, phase: str) -> np.ndarray:
    """Send `block` to rank r+1 and return the one rank r-1 sends: one call, named with its
    phase and ring step, so a failure report says where in the ring it happened."""
    rank, W = group.rank, group.size
    with group.collective("ring_attention", block, algo=f"{phase}, step {step}"):
        return group.sendrecv(block, dst=(rank + 1) % W, src=(rank - 1) % W)


@dataclass
class RingTimes:
    """This process's ring passes: per pass, the seconds the worker spent in the sendrecv
    (`send`, measured on the worker) and the seconds the compute thread then waited for it
    in wait() (`wait`). Totals since reset(), and the last 4096 passes as
    (phase, ring step, send, wait). hidden() = 1 - wait / send: the share of the send time
    that compute covered. Timing only: it never touches the numbers of the ring."""

    send_s: float = 0.0
    wait_s: float = 0.0
    passes: int = 0
    last: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, phase: str, step: int, send: float, wait: float) -> None:
        self.send_s, self.wait_s, self.passes = self.send_s + send, self.wait_s + wait, \
            self.passes + 1
        self.last.append((phase, step, send, wait))

    def hidden(self) -> float:
        """1 - wait/send over the passes since reset() (nan before any pass)."""
        return 1.0 - self.wait_s / self.send_s if self.send_s > 0 else float("nan")

    def reset(self) -> None:
        self.send_s, self.wait_s, self.passes = 0.0, 0.0, 0
        self.last.clear()


RING_TIMES = RingTimes()         # per process: every rank is a process (bench/train.py reads it)


class _TimedPass:
    """The handle _start_pass returns: wait() gives the received block and records the
    pass's send and wait seconds in RING_TIMES."""

    __slots__ = ("work", "step", "phase")

    def __init__(self, work, step: int, phase: str) -> None:
        self.work, self.step, self.phase = work, step, phase

    def wait(self) -> np.ndarray:
        t0 = time.perf_counter()
        block, send = self.work.wait()
        RING_TIMES.add(self.phase, self.step, send, time.perf_counter() - t0)
        return block


def _start_pass(group, block: np.ndarray, step: int, phase: str) -> _TimedPass:
    """Work whose wait() is _pass_right(...): runs on the group's worker, overlapping compute.
    (Looked up at call time, so a test can replace _pass_right.)"""
    def timed():
        t0 = time.perf_counter()
        got = _pass_right(group, block, step, phase)
        return got, time.perf_counter() - t0
    return _TimedPass(group.submit(timed), step, phase)


# --- the blocks -----------------------------------------------------------------------------

def _scores(q, k, q_pos, k_pos, causal: bool):
    """q k^T / sqrt(D), -inf where a key is after the query: (B, h, Tq, Tk)."""
    xp = backend.xp
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(q.shape[-1]))   # (B, h, Tq, Tk)
    if causal:
        future = xp.asarray(k_pos[None, :] > q_pos[:, None])
        s = xp.where(future, -xp.inf, s)
    return s


def _mask(a, shape, dtype, q_pos, k_pos):
    """Dropout's mask / (1-p) for these global (head, query, key) indices, or None."""
    if a.drop is None:
        return None
    shards = {1: (a.first_head, a.n_head), 2: (q_pos, a.T), 3: (k_pos, a.T)}
    return backend.xp.asarray(a.drop.scale(shape, dtype, a.key, shards))


@dataclass(frozen=True)
class _Args:
    """What both rings need besides arrays (kept on ctx)."""
    group: Any
    positions: list
    T: int
    drop: Dropout | None
    key: DropoutKey | None
    first_head: int
    n_head: int
    causal: bool


class RingAttention(Function):
    """y = softmax(q k^T / sqrt(D) + M) v over the whole sequence, for this rank's queries."""

    @staticmethod
    def forward(ctx, q, k, v, *, args: _Args):
        xp = backend.xp
        g, P = args.group, args.positions
        rank, W = g.rank, g.size
        B, h, Tl, D = q.shape
        m = xp.full((B, h, Tl), -xp.inf, dtype=q.dtype)           # running max
        l = xp.zeros((B, h, Tl), dtype=q.dtype)                   # running sum of exp
        acc = xp.zeros_like(q)                                    # running numerator (B, h, Tl, D)
        kv = np.stack([backend.to_numpy(k), backend.to_numpy(v)])  # (2, B, h, Tl, D)
        for s in range(W):
            src = (rank - s) % W                                  # whose block I hold
            nxt = _start_pass(g, kv, s, "forward K/V") if s < W - 1 else None
            R, C = _visible(P[rank], P[src], args.causal)
            if _count(R, Tl) and _count(C, Tl):                   # else: all in my future
                kb, vb = xp.asarray(kv[0][:, :, C]), xp.asarray(kv[1][:, :, C])
                sc = _scores(q[:, :, R], kb, P[rank][R], P[src][C], args.causal)
                m_new = xp.maximum(m[:, :, R], sc.max(axis=-1))   # finite: each row sees a key
                alpha = xp.exp(m[:, :, R] - m_new)                # rescales the old sums
                p = xp.exp(sc - m_new[..., None])                 # (B, h, |R|, |C|)
                l[:, :, R] = alpha * l[:, :, R] + p.sum(axis=-1)
                mask = _mask(args, p.shape, p.dtype, P[rank][R], P[src][C])
                pv = (p if mask is None else p * mask) @ vb       # (B, h, |R|, D)
                acc[:, :, R] = alpha[..., None] * acc[:, :, R] + pv
                m[:, :, R] = m_new
            if nxt is not None:
                kv = nxt.wait()
        y = acc / l[..., None]                                    # (B, h, Tl, D)
        ctx.args = args
        ctx.save_for_backward(q, k, v, y, m + xp.log(l))          # lse (B, h, Tl)
        return y

    @staticmethod
    def backward(ctx, dy):
        xp = backend.xp
        q, k, v, y, lse = ctx.saved_tensors
        args = ctx.args
        g, P = args.group, args.positions
        rank, W = g.rank, g.size
        Tl, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        delta = (dy * y).sum(axis=-1)                             # delta_i = dy_i . y_i
        dq = xp.zeros_like(q)
        kv = np.stack([backend.to_numpy(k), backend.to_numpy(v)])  # (2, B, h, Tl, D)
        dkv, sent = np.zeros_like(kv), None                      # my block's accumulator
        for s in range(W):
            src = (rank - s) % W
            nxt = _start_pass(g, kv, s, "backward K/V") if s < W - 1 else None
            R, C = _visible(P[rank], P[src], args.causal)
            blk = None
            if _count(R, Tl) and _count(C, Tl):
                qb, dyb = q[:, :, R], dy[:, :, R]
                kb, vb = xp.asarray(kv[0][:, :, C]), xp.asarray(kv[1][:, :, C])
                p = xp.exp(_scores(qb, kb, P[rank][R], P[src][C], args.causal)
                           - lse[:, :, R, None])                  # (B, h, |R|, |C|)
                dp = dyb @ vb.transpose(0, 1, 3, 2)               # (B, h, |R|, |C|)
                mask = _mask(args, p.shape, p.dtype, P[rank][R], P[src][C])
                pm = p if mask is None else p * mask
                dp = dp if mask is None else dp * mask
                ds = p * (dp - delta[:, :, R, None])              # d(scores)
                dq[:, :, R] += (ds @ kb) * scale                  # (B, h, |R|, D)
                blk = ((ds.transpose(0, 1, 3, 2) @ qb) * scale,   # dK of the block (|C| keys)
                       pm.transpose(0, 1, 3, 2) @ dyb)            # dV of the block
            if sent is not None:
                dkv = sent.wait()                                 # block src's, from rank r-1
            if blk is not None:
                dkv[0][:, :, C] += backend.to_numpy(blk[0])
                dkv[1][:, :, C] += backend.to_numpy(blk[1])
            if W > 1:
                sent = _start_pass(g, dkv, s, "backward dK/dV")
            if nxt is not None:
                kv = nxt.wait()
        if sent is not None:
            dkv = sent.wait()                                     # my own block, home again
        need = ctx.needs_input_grad
        return (dq if need[0] else None, xp.asarray(dkv[0]) if need[1] else None,
                xp.asarray(dkv[1]) if need[2] else None)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group, *, positions: list[np.ndarray],
                   T: int, drop: Dropout | None = None, key: DropoutKey | None = None,
                   first_head: int = 0, n_head: int | None = None,
                   causal: bool = True) -> Tensor:
    """y = softmax(q k^T / sqrt(D) + M) v over all T positions, rows P_r: y (B, h, T_loc, D).

    q, k, v (B, h, T_loc, D): this rank's positions P_r = positions[group.rank]; positions:
    every rank's global positions (`sequence_layout`), M: the causal mask by global position;
    drop/key: attention dropout, the single process's masks (heads first_head ..
    first_head + h - 1 of n_head, None: h). Equals nn.attention.attention_core on the whole
    sequence restricted to P_r. Cost: see the module docstring (2(W-1) + W sendrecv of 2N).
    """
    rank, W = group.rank, group.size
    where = f"{getattr(group, 'prefix', f'[rank {rank}/{W}]')} ring_attention"
    shape = tuple(q.shape)
    if len(shape) != 4 or tuple(k.shape) != shape or tuple(v.shape) != shape:
        raise ValueError(f"{where}: q, k, v must all be (B, h, T_loc, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
    positions = [np.asarray(p, dtype=np.int64) for p in positions]
    if len(positions) != W or any(p.shape != (shape[2],) for p in positions):
        raise ValueError(f"{where}: need {W} position arrays of T_loc={shape[2]} each (one per "
                         f"rank, all equal in length), got {[p.shape for p in positions]}. "
                         f"Build them with sequence_layout(T, {W}, layout).")
    if not np.array_equal(np.sort(np.concatenate(positions)), np.arange(T)):
        raise ValueError(f"{where}: the ranks' positions are not a split of 0..T-1 (T={T}); "
                         f"use sequence_layout(T, {W}, layout) with the global T.")
    n_head = shape[1] if n_head is None else n_head
    if first_head < 0 or first_head + shape[1] > n_head:
        raise ValueError(f"{where}: heads {first_head}..{first_head + shape[1] - 1} do not fit "
                         f"in n_head={n_head}; pass the global head count and first head.")
    active = drop is not None and drop.p > 0 and drop.training
    if active and (key is None or len(key.sample_ids) != shape[0]):
        raise ValueError(f"{where}: attention dropout p={drop.p} needs a DropoutKey with one "
                         f"sample id per row ({shape[0]} rows). Pass key= or call model.eval().")
    args = _Args(group, positions, int(T), drop if active else None, key, first_head, n_head,
                 causal)
    return RingAttention.apply(q, k, v, args=args)
