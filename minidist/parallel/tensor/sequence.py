"""Sequence parallelism (Megatron SP): outside the tensor-parallel regions, split the sequence.

Tensor parallelism (tensor_parallel.py) splits the matmuls, but the LayerNorms, dropouts
and residual adds between them still run on the full activation (B, T, C) on every tp
rank: W_tp identical copies, computed W_tp times and kept W_tp times for the backward.
Korthikanti et al. notice that these operations are independent along the sequence, so
each tp rank can run them on its own T / W_tp positions. The two collectives at the
edges of a tensor-parallel region change to keep the same total volume:

    without SP:  x[B, T, C] --f--> column ... row --g (all-reduce)--> x[B, T, C]
    with SP:     x[B, T_tp, C] --all-gather(T)--> column ... row --reduce-scatter(T)-->
                 x[B, T_tp, C]
An all-reduce is a reduce-scatter followed by an all-gather, so SP moves the same bytes
(Korthikanti et al. 2022, Sec. 4.2.2) and saves the activation memory of everything
outside the regions: per layer 34 B T C / W_tp bytes instead of 10 B T C + 24 B T C / W_tp
(their Table 2, 16-bit activations; parallel/tensor/memory.py gives ours, measured).
The price: the backward all-gathers each column-parallel layer's input once more.

The conjugate pairs, as autograd Functions (forward / backward):
    GatherFromSequenceRegion      all-gather along T   /  reduce-scatter along T
    ReduceScatterToSequenceRegion reduce-scatter along T / all-gather along T
The column-parallel layers fuse the first with their matmul (AllGatherMatmul), so that
they keep only the shard x[B, T_tp, C] for the backward and all-gather it again there
(as Megatron-LM does): without that, each would keep the gathered x[B, T, C] and SP would
not split the memory of the matmul inputs.

The parameters used on sequence shards (LayerNorm gains and shifts, the position
embedding, the bias of each row-parallel layer) are replicated, but each rank computes
their gradient from its T / W_tp positions only: a partial sum. They pass through
Megatron's f (identity forward, all-reduce backward; tensor_parallel.py) on their way
into the computation, so their .grad arrives summed over tp. Forgetting that sum is a
classic SP bug; check mode catches it (parallel/sharding.py compares the replicated
gradients across tp).

One rank's view (tp rank r of W, T = W T_tp):
    1. the embedding's partial sums are reduce-scattered: x[B, T_tp, C], positions
       r T_tp .. (r+1) T_tp - 1;
    2. each block: LN on the shard; all-gather -> attention on H/W heads -> row-parallel
       proj -> reduce-scatter; residual add and dropout on the shard; the same for the MLP;
    3. LN_f on the shard; all-gather before the LM head (column-parallel, vocab shards).
Shapes: x[B, T_tp, C] outside the regions; x[B, T, C] inside.
Communication per collective: B T C (W-1)/W numbers sent per rank (ring), half an
all-reduce; the group is tp.
References: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", arXiv:2205.05198, Sec. 4.2.2 and Fig. 5 (g and g-bar), Table 2.
Read next: parallel/tensor/async_tp.py (these collectives in steps, overlapped with the
matmuls), parallel/tensor/vocab.py.
"""

from __future__ import annotations

import numpy as np

from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.autograd.tensor import gemm, gemm_grads
from minidist.nn.layers import Embedding, LayerNorm
from minidist.parallel import placement as pl


def all_gather_sequence(x: np.ndarray, tp) -> np.ndarray:
    """x[B, T_tp, C] on every rank -> x[B, T, C]: rank r's positions land at r T_tp."""
    parts = C.all_gather(np.ascontiguousarray(x), group=tp.group, algo=tp.gather_algo)
    W, B, Tl = parts.shape[:3]                                # (W, B, T_tp, ...)
    return np.moveaxis(parts, 0, 1).reshape((B, W * Tl) + x.shape[2:])


def reduce_scatter_sequence(x: np.ndarray, tp) -> np.ndarray:
    """x[B, T, C] {U_tp} -> x[B, T_tp, C]: the sum over ranks of positions r T_tp ..."""
    B, T, W = x.shape[0], x.shape[1], tp.group.size
    if T % W:
        raise ValueError(f"sequence parallelism: T={T} positions do not split over tp={W} "
                         f"ranks; use a sequence length that is a multiple of {W}.")
    by_rank = np.moveaxis(x.reshape((B, W, T // W) + x.shape[2:]), 1, 0)   # (W, B, T_tp, C)
    mine = C.reduce_scatter(np.ascontiguousarray(by_rank), group=tp.group, algo=tp.algo)
    return mine.reshape((B, T // W) + x.shape[2:])


def _conjugates(name: str, doc: str, forward, backward) -> type:
    """An autograd Function that moves x by forward(x, tp) and its gradient by
    backward(dy, tp): the four data movements at the edges of the SP regions."""
    def fwd(ctx, x, *, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, dy):
        return (backward(dy, ctx.tp),)
    return type(name, (Function,), {"__doc__": doc, "forward": staticmethod(fwd),
                                    "backward": staticmethod(bwd)})


GatherFromSequenceRegion = _conjugates(
    "GatherFromSequenceRegion", "Forward all-gather along T; backward reduce-scatter along "
    "T (Korthikanti's g).", all_gather_sequence, reduce_scatter_sequence)
ReduceScatterToSequenceRegion = _conjugates(
    "ReduceScatterToSequenceRegion", "Forward reduce-scatter along T; backward all-gather "
    "along T (Korthikanti's g-bar).", reduce_scatter_sequence, all_gather_sequence)



class AllGatherMatmul(Function):
    """y = all_gather_T(x) @ w, keeping only this rank's x[B, T_tp, C] for the backward.

    The column-parallel layers under SP (qkv, fc, the LM head) need the whole sequence in
    their matmul, but saving the gathered x[B, T, C] would keep W times the activation
    that SP set out to split. So, as Megatron-LM does, the backward all-gathers x again:
        forward   x_all = all_gather_T(x);  y = x_all @ w                (B, T, F_tp)
        backward  x_all = all_gather_T(x);  dw = x_all^T dy;  dx = reduce_scatter_T(dy w^T)
    One more all-gather of B T_tp C per call, in exchange for 1/W of the saved input.
    """

    @staticmethod
    def forward(ctx, x, w, *, tp):
        ctx.tp = tp
        ctx.save_for_backward(x, w)
        x_all = all_gather_sequence(x, tp)                              # (B, T, C)
        y, ctx.how = gemm(x_all, w)      # x_all @ w; rounded as MatMul's under autocast
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad
        x_all = all_gather_sequence(x, ctx.tp) if need_w else \
            np.empty(dy.shape[:-1] + x.shape[-1:], x.dtype)             # gathered again
        # dw = x_all^T dy (C, F_tp); dx_all = dy w^T (B, T, C) {U_tp}
        dx_all, dw = gemm_grads(x_all, w, dy, ctx.how, need_x, need_w)
        dx = reduce_scatter_sequence(dx_all, ctx.tp) if need_x else None   # (B, T_tp, C)
        return dx, dw


def all_gather_matmul(x: Tensor, w: Tensor, tp) -> Tensor:
    """x[B, T_tp, C] @ w[C, F_tp] over the whole sequence -> y[B, T, F_tp] Shard(2)."""
    pl.expect(x, "tp", pl.Shard(1), name="x", where="all-gather into the tp region (SP)")
    return pl.tag(AllGatherMatmul.apply(x, w, tp=tp), "tp", pl.Shard(2))


def gather_from_sequence_region(x: Tensor, tp) -> Tensor:
    """x[B, T_tp, C] -> x[B, T, C] Replicate, entering a tensor-parallel region."""
    pl.expect(x, "tp", pl.Shard(1), name="x", where="all-gather into the tp region (SP)")
    return pl.tag(GatherFromSequenceRegion.apply(x, tp=tp), "tp", pl.Replicate())


def reduce_scatter_to_sequence_region(x: Tensor, tp) -> Tensor:
    """x[B, T, C] {U_tp} -> x[B, T_tp, C], leaving a tensor-parallel region."""
    pl.expect(x, "tp", pl.Partial(), name="x", where="reduce-scatter out of the tp region (SP)")
    return pl.tag(ReduceScatterToSequenceRegion.apply(x, tp=tp), "tp", pl.Shard(1))


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on x[B, T_tp, C]; its gain and shift pass through f, so their gradient,
    a partial sum over this rank's positions, is summed over tp in the backward."""

    def __init__(self, full: LayerNorm, tp) -> None:
        self.weight, self.bias, self.eps, self.tp = full.weight, full.bias, full.eps, tp

    def forward(self, x: Tensor) -> Tensor:
        pl.expect(x, "tp", pl.Shard(1), name="x", where="SequenceParallelLayerNorm")
        b = None if self.bias is None else self.tp.sum_grad(self.bias)
        return F.layer_norm(x, self.tp.sum_grad(self.weight), b, eps=self.eps)


class SequenceParallelPositions(Embedding):
    """The position embedding on this rank's positions; its gradient is summed over tp."""

    def __init__(self, full: Embedding, tp) -> None:
        self.weight, self.tp = full.weight, tp

    def forward(self, ids) -> Tensor:
        return F.embedding(self.tp.sum_grad(self.weight), ids)
