"""Expert parallelism: the E experts of a MoE layer split over the ep ranks, tokens sent to them.

An ep group of W ranks shares one MoE layer: rank r holds experts r E/W .. (r+1) E/W - 1
(E must divide by W) and a copy of the router. Every rank still routes its OWN tokens,
routing group by routing group exactly as nn/moe.py does (the same capacity, the same
drops), so only the expert computation moves: each kept assignment (token n, choice k)
travels to the rank of its expert and its result travels back.

    dispatch   send buffer = the kept tokens in the unsharded layer's order, expert by
               expert, slot by slot; experts are numbered rank by rank, so the rows for
               rank r are one contiguous block. 1. all_to_all of the per-expert counts
               (E/W numbers to each rank); 2. all_to_all of the token vectors with those
               uneven splits.
    compute    each local expert runs on the rows it received, source rank by source rank
               (a rank may receive none: the expert still runs, on 0 rows, so its gradient
               is zeros on every layout, as in the unsharded layer)
    combine    the reverse all_to_all brings every result back to the sender, which finds
               them in its send order: the unsharded layer's stacked expert outputs, so
               the gate-weighted sum (MoE.combine) is the very same code.
Both all-to-alls are autograd Functions (`AllToAll`) whose backward is the transposed
all-to-all: the gradient of the received rows goes back to where they came from.

Expert parameters are replicated over the ranks with the same ep coordinate (Megatron's
expert-data-parallel group: dp / ep ranks, times cp): their gradients are summed there,
the dense ones over all dp x cp ranks (parallel/compose.py builds both groups).

One rank's view (ep rank r of W, one MoE layer, N local tokens, E/W local experts):
    1. probs = softmax(router(x)) (N, E); routing r = route_groups(...) (nn/moe.py)
    2. order = tokens_of(0) ++ tokens_of(1) ++ ...: the kept assignments, expert-major
    3. counts[e] = len(tokens_of(e)); send_counts[s] = sum of counts of rank s's experts;
       recv_counts = all_to_all(counts) (W, E/W): what each source sends to my experts
    4. received = AllToAll(x[order], send_counts)                (sum recv, C)
    5. for my expert j: rows of j from every source (in source order) -> expert_j
    6. back = AllToAll(outputs in the received layout, recv sizes) (len(order), C)
    7. out = combine(back ++ zero row, probs, r)                  (N, C)
Shapes: x (B, T, C); tokens (N, C); sent (A, C) with A = kept assignments here.
Communication per layer and rank: the counts, (W-1) E/W numbers (forward only); the S kept
assignments whose expert lives elsewhere go out (dispatch) and the R rows other ranks sent
here go back (combine), C numbers each; the backward sends the same rows the other way:
2 (S + R) C numbers per micro-batch (`take_traffic`, checked against the bytes measured).
References: Lepikhin et al. 2020, "GShard", arXiv:2006.16668, Sec. 2.2-3 (experts over
    devices, all-to-all dispatch and combine); Fedus et al. 2021, "Switch Transformers",
    arXiv:2101.03961, Sec. 2.2; Rajbhandari et al. 2022, "DeepSpeed-MoE",
    arXiv:2201.05596 (expert-data-parallel groups).
Read next: nn/moe.py (routing), parallel/compose.py (the ep axis).
"""

from __future__ import annotations

import numpy as np

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.nn.module import ModuleSubset
from minidist.nn.grouped_experts import grouped_mlp
from minidist.nn.moe import MoE
from minidist.nn.routing import Routing


class AllToAll(Function):
    """rows -> the rows every rank addressed to me: forward all_to_all with uneven splits,
    backward the transposed all_to_all (the splits swapped)."""

    @staticmethod
    def forward(ctx, x, *, group, send: list[int], recv: list[int]):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        host = np.ascontiguousarray(backend.to_numpy(x))
        return backend.xp.asarray(C.all_to_all(host, split_sizes=send, group=group,
                                               recv_sizes=recv))

    @staticmethod
    def backward(ctx, dy):
        host = np.ascontiguousarray(backend.to_numpy(dy))
        return (backend.xp.asarray(C.all_to_all(host, split_sizes=ctx.recv, group=ctx.group,
                                                recv_sizes=ctx.send)),)


class ExpertParallelMoE(MoE):
    """A MoE layer whose experts are split over `group`; the same numbers as MoE."""

    def __init__(self, moe: MoE, group) -> None:
        W, E = group.size, moe.n_experts
        if E % W:
            raise ValueError(f"expert parallelism: n_experts={E} does not split over ep={W} "
                             f"ranks; use an ep dividing {E}, or n_experts a multiple of {W}.")
        vars(self).update(vars(moe))                      # router, settings, stats
        self.group, self.per_rank = group, E // W
        first = group.rank * self.per_rank
        self.experts = ModuleSubset({e: moe.experts[e]
                                     for e in range(first, first + self.per_rank)})
        self.last_traffic = {"sent_rows": 0, "own_rows": 0}
        # since take_traffic(): forward calls, token rows sent to / received from other ranks
        self.calls, self.rows_sent, self.rows_received = 0, 0, 0

    def take_traffic(self, itemsize: int) -> int:
        """Bytes this layer's all-to-alls sent since the last call, by the formula. A
        forward sends its counts ((W-1) E/W int64), the S kept tokens whose expert lives
        elsewhere (dispatch) and the results of the R tokens it received from others
        (combine), C numbers each; the backward sends the same rows the other way round:
        2 (S + R) C itemsize + calls (W-1) (E/W) 8."""
        W, C_ = self.group.size, self.router.weight.shape[0]
        rows = self.rows_sent + self.rows_received
        out = 2 * rows * C_ * itemsize + self.calls * (W - 1) * self.per_rank * 8
        self.calls, self.rows_sent, self.rows_received = 0, 0, 0
        return out

    def run_experts(self, tokens: Tensor, r: Routing) -> tuple[Tensor, np.ndarray]:
        """Dispatch, compute, combine-back; returns what MoE.run_experts returns."""
        N, Cm = tokens.shape
        W, per, me = self.group.size, self.per_rank, self.group.rank
        ids = [r.tokens_of(e) for e in range(self.n_experts)]          # slot order each
        counts = np.array([len(i) for i in ids], np.int64)             # (E,)
        send = [int(counts[s * per:(s + 1) * per].sum()) for s in range(W)]
        recv_counts = C.all_to_all(counts, split_sizes=[per] * W, group=self.group,
                                   recv_sizes=[per] * W).reshape(W, per)   # [source, j]
        recv = [int(c) for c in recv_counts.sum(axis=1)]
        order = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        received = AllToAll.apply(tokens[order], group=self.group, send=send, recv=recv)
        outputs = self._compute(received, recv_counts)                 # (sum recv, C)
        back = AllToAll.apply(outputs, group=self.group, send=recv, recv=send)
        self.last_traffic = {"sent_rows": sum(send) - send[me], "own_rows": send[me]}
        self.calls += 1
        self.rows_sent += sum(send) - send[me]
        self.rows_received += sum(recv) - recv[me]
        row_of = _rows_of(r, counts)
        zero_row = Tensor(backend.xp.zeros((1, Cm), dtype=tokens.dtype))
        return F.concatenate([back, zero_row], axis=0), row_of

    def _compute(self, received: Tensor, recv_counts: np.ndarray) -> Tensor:
        """Run each local expert on its rows from every source (source order), and put
        the results back in the received layout: source-major, then expert, then slot."""
        W, per = recv_counts.shape
        blocks = received_blocks(recv_counts)
        if self.grouped:
            return self._compute_grouped(received, recv_counts, blocks)
        pieces: dict[tuple[int, int], Tensor] = {}
        first = self.group.rank * per
        for j in range(per):
            rows = np.concatenate([blocks[s, j] for s in range(W)]).astype(np.int64)
            y = self.experts[first + j](received[rows])                 # (n_j, C)
            at = 0
            for s in range(W):
                n = int(recv_counts[s, j])
                pieces[s, j] = y[at:at + n]
                at += n
        return in_received_order(pieces, received, W, per)


    def _compute_grouped(self, received: Tensor, recv_counts: np.ndarray,
                         blocks: dict) -> Tensor:
        """_compute's fast path (nn/grouped_experts.py), the same bits: the received rows
        sorted expert-major (source order inside), every local expert on its segment in
        one node, the results put back in the received order."""
        W, per = recv_counts.shape
        first = self.group.rank * per
        perm = np.concatenate([blocks[s, j] for j in range(per) for s in range(W)]
                              ).astype(np.int64)
        y = grouped_mlp(received[perm], [self.experts[first + j] for j in range(per)],
                        recv_counts.sum(axis=0))
        back = np.empty_like(perm)
        back[perm] = np.arange(perm.size)
        return y[back]


def received_blocks(recv_counts: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """{(source s, local expert j): the indices of its rows among the received ones},
    which arrive source-major, then expert, then slot; recv_counts (W, E/W)."""
    W, per = recv_counts.shape
    start = np.concatenate([[0], np.cumsum(recv_counts.reshape(-1))])   # (W per + 1,)
    return {(s, j): np.arange(start[s * per + j], start[s * per + j + 1])
            for s in range(W) for j in range(per)}


def in_received_order(pieces: dict, received: Tensor, W: int, per: int) -> Tensor:
    """The outputs {(s, j): rows} stacked as the received rows were (source-major)."""
    ordered = [pieces[s, j] for s in range(W) for j in range(per)]
    return F.concatenate(ordered, axis=0) if ordered else received[:0]


def _rows_of(r: Routing, counts: np.ndarray) -> np.ndarray:
    """row_of[n, k]: where assignment (n, k) sits in the stacked outputs (expert-major, as
    MoE.run_experts stacks them); dropped ones point at the zero row after them."""
    offset = np.concatenate([[0], np.cumsum(counts)])
    row_of = np.where(r.kept, offset[r.choice] + np.maximum(r.slot, 0), int(offset[-1]))
    return row_of.astype(np.int64)


def apply_experts(model, group) -> list[ExpertParallelMoE]:
    """Swap every MoE block of `model` for its expert-parallel twin on `group` (this rank
    keeps its E/W experts under their global names); return the new layers."""
    layers = []
    for block in model.blocks:
        if hasattr(block, "moe"):
            block.moe = ExpertParallelMoE(block.moe, group)
            layers.append(block.moe)
    return layers


def is_expert_parameter(name: str) -> bool:
    """Does the parameter called `name` belong to an expert (replicated over edp only)?"""
    return ".moe.experts." in name
