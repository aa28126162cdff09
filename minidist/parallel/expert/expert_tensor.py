"""Expert tensor parallelism: each expert's MLP split over an expert-tp group of its own.

Megatron-core's "MoE parallel folding" gives the experts a mesh of their own on the same
ranks as the attention's: attention uses tp x cp x dp, the experts etp x ep x edp, with
etp ep edp = the ranks of one attention tp shard's dp group. Here the expert axes are
carved out of dp (parallel/compose.py: dp = (edp, ep, etp), etp the fastest), so the
attention is as before and the ranks of an etp group hold DIFFERENT tokens. An ep rank
holds experts r E/ep .. (r+1) E/ep - 1 (parallel/expert/expert_parallel.py), and the etp
ranks of its group each hold 1/etp of every one of them, Megatron's column/row split:

    fc    W1 (C, F) -> W1[:, F_j] (Shard(1) over etp), b1 -> b1[F_j]
    proj  W2 (F, C) -> W2[F_j, :] (Shard(0) over etp), b2 whole (Replicate over etp)

One rank's view of a MoE layer (etp rank j of T, ep rank r; N local tokens):
    1. route my tokens and dispatch the kept ones over ep, exactly as expert parallelism
       does: `received` (R, C), the rows my ep position's experts must run, from my
       tokens' ep group;
    2. all-gather the received rows over etp (uneven: member m has R_m rows; the counts
       first): X (R_0 + ... + R_{T-1}, C), member-major, every etp rank the same X;
    3. for my local expert e: rows of e in X -> H = GELU(X_e W1[:, F_j] + b1[F_j]) and the
       PARTIAL output P_e = H W2[F_j, :] (n_e, C): summed over j it is the expert's
       output without b2;
    4. reduce-scatter over etp: member m gets the sum over j of the partials of ITS rows,
       added in rank order j = 0 .. T-1: (R, C); then + b2 of each row's expert;
    5. send the results back over ep and combine, as expert parallelism does.
The backward of step 2 is a reduce-scatter (each member's rows get the sum of the etp
ranks' input gradients) and of step 4 an all-gather; b2 is added to my rows only, so its
gradient is summed over etp (`SumOverGroup`, the f of Megatron's tp). Gradients of my
expert pieces are then summed over the expert-data-parallel group (edp x cp: the ranks
with my ep and etp coordinates), the dense model's over dp x cp as always.

Communication per layer and rank (C numbers per row, itemsize s): forward, the counts
((T-1) W E/ep int64, W = ep), my R rows to T-1 members, and the partials of the other
members' rows to them, (R_all - R) rows; the backward the same the other way, and the b2
gradients (E/ep C numbers) to T-1 members: 2 ((T-1) R + R_all - R) C s + (T-1) (E/ep) C s
bytes (`take_etp_traffic`, checked against the bytes measured), besides ep's all-to-alls.
Memory: each rank holds 1/(ep etp) of every MoE layer's expert weights.
References: Liu et al. 2025, "MoE Parallel Folding: Heterogeneous Parallelism Mappings for
    Efficient Large-Scale MoE Model Training with Megatron Core", arXiv:2504.14960;
    Shoeybi et al. 2019, Megatron-LM, arXiv:1909.08053 (the column/row split).
Read next: parallel/expert/expert_parallel.py (steps 1 and 5), parallel/sharding.py.
"""

from __future__ import annotations

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.nn.module import Parameter
from minidist.parallel import placement as pl
from minidist.parallel.expert.expert_parallel import ExpertParallelMoE, received_blocks


class AllGatherRows(Function):
    """x (R, C) -> every member's rows, member-major (sum sizes, C); backward: each member
    gets the sum over members of its rows' gradients (rank order)."""

    @staticmethod
    def forward(ctx, x, *, group, sizes: list[int]):
        ctx.group, ctx.sizes = group, sizes
        host = np.ascontiguousarray(backend.to_numpy(x))
        W = group.size
        out = C.all_to_all(np.concatenate([host] * W), split_sizes=[len(host)] * W,
                           group=group, recv_sizes=sizes)
        return backend.xp.asarray(out)

    @staticmethod
    def backward(ctx, dy):
        return (backend.xp.asarray(_sum_mine(backend.to_numpy(dy), ctx.group, ctx.sizes)),)


class ReduceScatterRows(Function):
    """y (sum sizes, C), member-major partial sums -> my rows summed over the members
    (rank order) (R, C); backward: every member's rows' gradients gathered."""

    @staticmethod
    def forward(ctx, y, *, group, sizes: list[int]):
        ctx.group, ctx.sizes = group, sizes
        return backend.xp.asarray(_sum_mine(backend.to_numpy(y), group, sizes))

    @staticmethod
    def backward(ctx, dy):
        gathered = AllGatherRows.forward(ctx, dy, group=ctx.group, sizes=ctx.sizes)
        return (gathered,)


def _sum_mine(y: np.ndarray, group, sizes: list[int]) -> np.ndarray:
    """Member m's block of y goes to member m; mine from every member, added in rank order."""
    W, mine = group.size, sizes[group.rank]
    parts = C.all_to_all(np.ascontiguousarray(y), split_sizes=sizes, group=group,
                         recv_sizes=[mine] * W).reshape(W, mine, *y.shape[1:])
    return _in_rank_order(parts)


def _in_rank_order(parts: np.ndarray) -> np.ndarray:
    """parts[0] + parts[1] + ... in that order: the same bits on every member."""
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total


class SumOverGroup(Function):
    """Identity forward; backward, the gradient summed over the group in rank order (an
    all-gather, then the adds: the same bits on every member), for a parameter each member
    uses with other rows, whose copies must stay equal."""

    @staticmethod
    def forward(ctx, x, *, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dy):
        parts = C.all_gather(np.ascontiguousarray(backend.to_numpy(dy)), group=ctx.group)
        return (backend.xp.asarray(_in_rank_order(parts)),)


def shard_expert(mlp, etp) -> None:
    """Replace an expert MLP's parameters by this etp rank's pieces (module docstring)."""
    T, j = etp.size, etp.rank
    for lin, dims in ((mlp.fc, {"weight": 1, "bias": 0}), (mlp.proj, {"weight": 0})):
        for name, dim in dims.items():
            full = getattr(lin, name)
            if full is None:
                continue
            place = pl.Shard(dim)
            values = pl.shard(full.data, place, T, j)
            p = Parameter(values.shape, full.init, str(full.dtype),
                          full_shape=tuple(full.shape))
            p.data[...] = values
            p.placements = {**(getattr(full, "placements", None) or {}), "etp": place}
            setattr(lin, name, p)


class ExpertTensorParallelMoE(ExpertParallelMoE):
    """Expert parallelism over `group` with each local expert split over `etp`."""

    def __init__(self, moe, group, etp) -> None:
        F_ = moe.experts[0].fc.weight.shape[1]
        if F_ % etp.size:
            raise ValueError(f"expert tensor parallelism: an expert's hidden width "
                             f"{F_} does not split over expert_tp={etp.size}; use an "
                             f"expert_hidden that is a multiple of {etp.size}.")
        super().__init__(moe, group)
        self.etp = etp
        first = group.rank * self.per_rank
        for e in range(first, first + self.per_rank):
            shard_expert(self.experts[e], etp)
        self.etp_rows = {"mine": 0, "all": 0, "calls": 0}

    def _compute(self, received: Tensor, recv_counts: np.ndarray) -> Tensor:
        """Steps 2-4 of the module docstring: (R, C) outputs in the received layout."""
        W, per = recv_counts.shape
        T, me = self.etp.size, self.etp.rank
        counts = C.all_gather(np.ascontiguousarray(recv_counts.astype(np.int64)),
                              group=self.etp).reshape(T, W, per)       # [member, src, j]
        sizes = [int(c) for c in counts.sum(axis=(1, 2))]
        X = AllGatherRows.apply(received, group=self.etp, sizes=sizes)  # (R_all, C)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        blocks = [received_blocks(counts[m]) for m in range(T)]
        first = self.group.rank * per
        partial = [None] * per
        rows = []
        for j in range(per):
            ids = np.concatenate([starts[m] + blocks[m][s, j]
                                  for m in range(T) for s in range(W)]).astype(np.int64)
            ex = self.experts[first + j]
            h = F.gelu(F.linear(X[ids], ex.fc.weight, ex.fc.bias), approximate="tanh")
            partial[j] = F.matmul(h, ex.proj.weight)                     # (n_j, C), partial
            rows.append(ids)
        order = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        back = np.empty_like(order)
        back[order] = np.arange(order.size)
        P = F.concatenate(partial, axis=0)[back] if partial else X[:0]    # member-major
        mine = ReduceScatterRows.apply(P, group=self.etp, sizes=sizes)  # (R, C)
        self.etp_rows["mine"] += sizes[me]
        self.etp_rows["all"] += sum(sizes)
        self.etp_rows["calls"] += 1
        return mine + self._output_bias(counts[me], per, first)

    def _output_bias(self, recv_counts: np.ndarray, per: int, first: int):
        """(R, C): b2 of each received row's expert, its gradient summed over etp."""
        own = received_blocks(recv_counts)
        W = recv_counts.shape[0]
        which = np.zeros(int(recv_counts.sum()), np.int64)
        for s in range(W):
            for j in range(per):
                which[own[s, j]] = j
        b2 = [self.experts[first + j].proj.bias for j in range(per)]
        if b2[0] is None:
            return 0.0
        stacked = F.concatenate([b.reshape(1, -1) for b in b2], axis=0)   # (per, C)
        return SumOverGroup.apply(stacked, group=self.etp)[which]

    def take_etp_traffic(self, itemsize: int) -> int:
        """Bytes this layer's etp collectives sent since the last call, by the formula of
        the module docstring (forward and backward, the counts included)."""
        T, W, per = self.etp.size, self.group.size, self.per_rank
        C_ = self.router.weight.shape[0]
        rows = (T - 1) * self.etp_rows["mine"] + self.etp_rows["all"] - self.etp_rows["mine"]
        bias = (T - 1) * per * C_ * itemsize if self.experts[
            self.group.rank * per].proj.bias is not None else 0
        out = 2 * rows * C_ * itemsize + self.etp_rows["calls"] * ((T - 1) * W * per * 8
                                                                  + bias)
        self.etp_rows = {"mine": 0, "all": 0, "calls": 0}
        return out


def apply_expert_tensor(model, ep_group, etp_group) -> list[ExpertTensorParallelMoE]:
    """Swap every MoE block of `model` for its expert-tensor-parallel twin: my ep rank's
    experts, each split over etp; return the new layers."""
    layers = []
    for block in model.blocks:
        if hasattr(block, "moe"):
            block.moe = ExpertTensorParallelMoE(block.moe, ep_group, etp_group)
            layers.append(block.moe)
    return layers
