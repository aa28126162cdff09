"""Async tensor parallelism (collective matmul): SP's collectives cut into steps and hidden
behind the matmul chunks that need them.

Under sequence parallelism (sequence.py) a column-parallel layer all-gathers x[B, T_tp, C]
along T and then multiplies; a row-parallel layer multiplies and then reduce-scatters its
partial sum along T. While a collective runs nothing is computed: the whole transfer is on
the critical path. But the matmul never needs the whole sequence at once. Rows of x @ w
are independent, so the positions of chunk c (c T_tp .. (c+1) T_tp - 1) need only chunk c
of x. Cut the collective into its W - 1 point-to-point steps and the matmul into W chunk
products, and each step moves one chunk while the main thread multiplies another
(Wang et al. call this "decomposition"; torchtitan's async TP does it on GPUs).

The schedule is pairwise: at step s = 1 .. W-1, tp rank r sends to r + s and receives from
r - s (mod W), one C.sendrecv on the tp group (deadlock-free at any size: the send and the
receive advance together). A ring that forwards what it received would move the same
bytes, but pairwise sends what this rank has from the start, so every step can be queued
at once on the group's worker thread (async_op=True, FIFO), which moves the bytes while
the main thread computes; the main thread waits for a step only when it needs its chunk.

All-gather -> matmul (AllGatherMatmul: qkv, fc, the LM head):
    forward   y[:, chunk r] = x_r @ w at once (my own chunk, while step 1 moves), then
              y[:, chunk r-s] = x_{r-s} @ w as x_{r-s} arrives at step s
    backward  dx = reduce-scatter_T(dy w^T), decomposed as below; dw = x_all^T dy as ONE
              matmul on x gathered again (only the shard x[B, T_tp, C] is saved, as
              sequence.AllGatherMatmul does), the gather queued first so that it moves
              while the dx partials are computed, and those move while dw is computed
Matmul -> reduce-scatter (MatmulReduceScatter: attention's proj, the MLP's proj):
    forward   p_d = x[:, chunk d] @ w, my summand of rank d's positions (B, T_tp, C), for
              d = r+1, r+2, ..., r+W-1: p_{r+s} leaves at step s while the next partial is
              computed; my own p_r last; then the W summands of my chunk are folded in
              rank order, ((p^0 + p^1) + p^2) + ... (p^q: rank q's summand)
    backward  dy gathered along T step by step; dx[:, chunk c] = dy_c @ w^T as dy_c
              arrives; dw = x^T dy_all as one matmul

One rank's view (tp rank r of W, AllGatherMatmul forward):
    1. queue steps 1 .. W-1, each a sendrecv of my x[B, T_tp, C] (to r+s, from r-s);
    2. y[:, chunk r] = x @ w, while the worker runs step 1;
    3. for s = 1 .. W-1: wait for x_{r-s}; y[:, chunk r-s] = x_{r-s} @ w, while step s+1
       moves.
Shapes and sharding: as sequence.py's. In x[B, T_tp, C] -> out y[B, T, F_tp] (column);
    in x[B, T, F_tp] -> out y[B, T_tp, C] (row). A message is one chunk of the residual
    stream, (B, T_tp, C): x or dx of a column layer, y or dy of a row layer.

Numerics. Gathered chunks are copies, so their arrival order changes no bit, and the
reduce-scatter folds in rank order 0..W-1 as collectives/direct.py does: with tp algo
"direct" (the default on shared memory) the fold is the plain path's bit for bit. What is
left is the chunk products: is x[rows] @ w equal to (x @ w)[rows] bit for bit? In exact
arithmetic yes; in a BLAS, only if it computes those rows with the same kernel and the
same order of additions in both calls, which depends on the call's shape (M rows, K, N,
w's layout), not only on the numbers. Measured on the OpenBLAS NumPy ships here (0.3.31,
x86-64, float64, one thread; chunks of M = 1..128 rows of W = 2 and 4, K 16-256, N 5-256):
with N a multiple of 4 and w as stored every chunk of M >= 2 rows matched; with w
transposed (the backward's w^T) 84-92 % did; with N not a multiple of 4, 25-91 %; a single
row (M = 1, a matrix-vector kernel) never did. So async TP equals the plain SP path bit for
bit where the BLAS computes rows independently of their count for the shapes in use
(tests/parallel/tensor/test_async_tp.py checks that first, then demands the bits), and
within rounding (~1e-16 relative, float64) elsewhere, or with tp algo "ring", whose
reduce-scatter adds in another order.

Communication per call (tp group): W - 1 messages of one chunk each way per collective,
(W-1)/W B T C numbers sent per rank: the same bytes as the plain SP collective (ring
all-gather, direct or ring reduce-scatter), only cut into steps that overlap compute.
AllGatherMatmul's backward gathers x once more, exactly as the plain path does.
What is hidden (m: one chunk's matmul, t = alpha + n beta: one step's transfer):
    plain    W m + (W-1) t          every transfer exposed
    async    m + (W-1) max(m, t)    each step behind a chunk matmul; exposed (W-1)(t - m)+
The reduce-scatter also exposes the rank-order fold ((W-1) B T_tp C additions); the
backward hides the gather of x behind the dx partials and their transfers behind dw.
In this runtime the worker thread shares the interpreter lock with the main thread; a
BLAS call and a copy release it, and a transfer to an emulated node (runtime/nodes.py)
waits while holding no lock, so that is where overlap shows (bench/async_tp.py measures
it). On MPI (runtime/mpi.py) the worker runs each step inline: correct, nothing hidden.
References: Wang et al. 2023, "Overlap Communication with Dependent Computation via
    Decomposition in Large Deep Learning Models", ASPLOS 2023, pp. 93-106;
    Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2 (the SP collectives decomposed
    here); torchtitan's async tensor parallelism (fused all-gather matmul and matmul
    reduce-scatter, PyTorch symmetric memory).
Read next: parallel/tensor/vocab.py.
"""

from __future__ import annotations

import numpy as np

from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd.tensor import mm
from minidist.parallel import placement as pl


def _step(x: np.ndarray, s: int, tp):
    """Queue step s of the pairwise schedule on the tp group's worker: send x to rank r + s,
    receive rank r - s's chunk (same shape). Returns its Work; wait() gives the chunk."""
    r, W = tp.group.rank, tp.group.size
    return C.sendrecv(x, (r + s) % W, (r - s) % W, group=tp.group, tag=s, async_op=True)


class Gather:
    """all_gather_T(x) in flight: the W - 1 steps are queued when it is made. Iterating
    yields (c, x_c) for every chunk c of the sequence: mine (c = r) at once, then
    c = r-1, r-2, ... as each step completes; the caller computes on one chunk while the
    next moves."""

    def __init__(self, x: np.ndarray, tp):
        self.x, self.r, self.W = np.ascontiguousarray(x), tp.group.rank, tp.group.size
        self.steps = [_step(self.x, s, tp) for s in range(1, self.W)]

    def __iter__(self):
        yield self.r, self.x
        for s, work in enumerate(self.steps, start=1):
            yield (self.r - s) % self.W, work.wait()


class ReduceScatter:
    """reduce_scatter_T of a partial sum that is computed chunk by chunk: `summand(d)` is
    this rank's term for rank d's positions (B, T_tp, ...). Made: computes the term for
    r + s and queues step s, for s = 1 .. W-1, then its own; `result()` waits for the
    others' terms and folds the W of them in rank order 0..W-1 (direct.py's order)."""

    def __init__(self, summand, tp):
        r, W = tp.group.rank, tp.group.size
        self.steps = {(r - s) % W: _step(summand((r + s) % W), s, tp) for s in range(1, W)}
        self.terms = {r: summand(r)}                  # mine: computed while the last moves

    def result(self) -> np.ndarray:
        terms = self.terms
        terms.update((q, work.wait()) for q, work in self.steps.items())
        W = len(terms)
        out = terms[0] + terms[1] if W > 1 else terms[0]       # (a new array either way)
        for q in range(2, W):
            out += terms[q]                           # ((t0 + t1) + t2) + ...: rank order
        return out


def chunk(c: int, T_tp: int) -> slice:
    """Chunk c of the sequence: positions c T_tp .. (c+1) T_tp - 1 (tp rank c's under SP)."""
    return slice(c * T_tp, (c + 1) * T_tp)


def check_length(T: int, W: int) -> int:
    """T_tp = T / W, or ValueError when the sequence does not split over the tp ranks."""
    if T % W:
        raise ValueError(f"async tensor parallelism: T={T} positions do not split over tp={W} "
                         f"ranks; use a sequence length that is a multiple of {W}.")
    return T // W


class AllGatherMatmul(Function):
    """y[B, T, F_tp] = all_gather_T(x)[B, T, C] @ w[C, F_tp], the gather decomposed into
    steps hidden behind the chunk products; keeps only x[B, T_tp, C] for the backward.
    Cost per rank: forward W-1 steps of B T_tp C numbers; backward 2(W-1) (x again, dx)."""

    @staticmethod
    def forward(ctx, x, w, *, tp):
        ctx.tp = tp
        ctx.save_for_backward(x, w)
        B, T_tp, W = x.shape[0], x.shape[1], tp.group.size
        y = np.empty((B, W * T_tp, w.shape[1]), np.result_type(x, w))
        for c, x_c in Gather(x, tp):
            y[:, chunk(c, T_tp)] = mm(x_c, w)                  # (B, T_tp, C) @ (C, F_tp)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad
        tp, T_tp = ctx.tp, x.shape[1]
        gather = Gather(x, tp) if need_w else None                # moves while dx is made
        scatter = ReduceScatter(lambda d: mm(dy[:, chunk(d, T_tp)], w.T), tp) \
            if need_x else None                                     # (B, T_tp, F_tp) @ w^T
        dw = None
        if need_w:
            x_all = np.empty(dy.shape[:2] + x.shape[2:], x.dtype)  # (B, T, C)
            for c, x_c in gather:
                x_all[:, chunk(c, T_tp)] = x_c
            dw = x_all.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])   # (C, F_tp)
        return (scatter.result() if need_x else None), dw


class MatmulReduceScatter(Function):
    """y[B, T_tp, C] = reduce_scatter_T(x[B, T, F_tp] @ w[F_tp, C]), the product computed
    one destination chunk at a time, each sent while the next is computed.
    Cost per rank: forward W-1 steps of B T_tp C numbers (y's terms); backward W-1 (dy)."""

    @staticmethod
    def forward(ctx, x, w, *, tp):
        ctx.tp = tp
        ctx.save_for_backward(x, w)
        T_tp = check_length(x.shape[1], tp.group.size)
        return ReduceScatter(lambda d: mm(x[:, chunk(d, T_tp)], w), tp).result()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad
        T_tp = dy.shape[1]
        dy_all = np.empty(x.shape[:2] + dy.shape[2:], dy.dtype)    # (B, T, C)
        dx = np.empty(x.shape, np.result_type(dy, w)) if need_x else None
        for c, dy_c in Gather(dy, ctx.tp):
            dy_all[:, chunk(c, T_tp)] = dy_c
            if need_x:
                dx[:, chunk(c, T_tp)] = mm(dy_c, w.T)          # (B, T_tp, C) @ w^T
        dw = x.reshape(-1, x.shape[-1]).T @ dy_all.reshape(-1, dy.shape[-1]) if need_w \
            else None                                               # (F_tp, C)
        return dx, dw


def all_gather_matmul(x: Tensor, w: Tensor, tp) -> Tensor:
    """x[B, T_tp, C] @ w[C, F_tp] over the whole sequence -> y[B, T, F_tp] Shard(2)."""
    pl.expect(x, "tp", pl.Shard(1), name="x", where="all-gather matmul into the tp region "
              "(async TP)")
    return pl.tag(AllGatherMatmul.apply(x, w, tp=tp), "tp", pl.Shard(2))


def matmul_reduce_scatter(x: Tensor, w: Tensor, tp) -> Tensor:
    """x[B, T, F_tp] @ w[F_tp, C], summed over tp -> y[B, T_tp, C] Shard(1): this rank's
    positions, leaving the tensor-parallel region."""
    pl.expect(x, "tp", pl.Shard(2), name="x", where="matmul reduce-scatter out of the tp "
              "region (async TP)")
    return pl.tag(MatmulReduceScatter.apply(x, w, tp=tp), "tp", pl.Shard(1))
