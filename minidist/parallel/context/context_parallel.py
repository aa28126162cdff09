"""Context parallelism: every layer runs on a slice of the sequence; attention crosses slices.

Sequence parallelism (parallel/tensor/sequence.py) splits T only OUTSIDE attention; inside, every
tp rank still sees all T positions. For long sequences attention's activations (scores of
T x T per head) are what outgrow a device, so context parallelism splits T for the whole
model: cp rank r holds its positions of every activation, and only attention, where each
query needs every earlier key, talks to the other cp ranks, by one of two algorithms:

    ring     K/V blocks travel round the cp ring while each rank keeps its queries; an
             online softmax merges the blocks (parallel/context/ring_attention.py; Liu et al.
             2023): cp-1 sends of a K/V block forward, and K/V + dK/dV blocks backward.
    ulysses  an all-to-all swaps the sequence shards for head shards, attention runs on
             whole sequences of H/cp heads, and a second all-to-all swaps back
             (parallel/context/ulysses.py; Jacobs et al. 2023): needs H/tp divisible by cp.

Which positions a rank holds: with a causal mask, contiguous slices give the last rank
about 2cp-1 times the attention work of the first. The zig-zag layout cuts T into 2 cp
chunks and gives rank r chunks r and 2cp-1-r, so every rank has the same work (Megatron
CP, ring-flash-attention). Everything outside attention (embeddings, LayerNorm, MLP, the
loss) is position-wise, so it just runs on the rank's positions: the position embedding
and the dropout masks use the true global positions, the loss is divided by the global
token count, and the gradients of the (replicated) parameters are partial sums over the cp
ranks' tokens, so they are summed by the gradient sync over dp x cp (compose.py), like
data parallelism's.

One rank's view (cp rank r of W; layout zig-zag; the data rows of its dp coordinate):
    1. x, y = my positions of the rows: P_r = chunks r and 2W-1-r of T;
    2. embed: wte[x] + wpe[P_r]; blocks: LN, MLP on my positions; attention by the ring
       or Ulysses over the cp group; head and loss on my positions;
    3. backward; the engine sums every gradient over dp x cp.
Shapes: x[B, T_cp, C] everywhere, T_cp = T / cp (under SP further split over tp).
Communication: attention only, on the cp group (see the two algorithms' modules).
References: Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889;
    Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509; Megatron-LM's context
    parallelism (zig-zag load balancing).
Read next: parallel/context/ring_attention.py, parallel/context/ulysses.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist.autograd import Tensor
from minidist.nn.gpt import GPTLayout
from minidist.parallel.context.ring_attention import LAYOUTS, ring_attention, sequence_layout
from minidist.parallel.context.ulysses import ulysses_attention

__all__ = ["ALGOS", "LAYOUTS", "ContextParallel", "ContextParallelLayout",
           "apply_context", "sequence_positions"]
ALGOS = ("ring", "ulysses")


@dataclass(frozen=True)
class ContextParallel:
    """The cp group, the attention algorithm and the sequence layout."""

    group: object
    algo: str = "ring"
    layout: str = "zigzag"

    def all_positions(self, T: int) -> list[np.ndarray]:
        """Every cp rank's global positions of a sequence of T, in rank order."""
        return sequence_layout(T, self.group.size, self.layout)

    def positions(self, T: int) -> np.ndarray:
        """This rank's global positions of a sequence of T."""
        return self.all_positions(T)[self.group.rank]

    def attention(self, q: Tensor, k: Tensor, v: Tensor, drop, key, first_head: int,
                  n_head: int) -> Tensor:
        """Attention of my queries q (B, h, T_cp, D) over every rank's keys: (B, h, T_cp, D)."""
        T = q.shape[2] * self.group.size
        kw = dict(positions=self.all_positions(T), T=T, drop=drop, key=key,
                  first_head=first_head, n_head=n_head)
        if self.algo == "ring":
            return ring_attention(q, k, v, self.group, **kw)
        return ulysses_attention(q, k, v, self.group, **kw)


def sequence_positions(rows: int, sp_rank: int = 0, sp_size: int = 1,
                       context: ContextParallel | None = None) -> tuple[np.ndarray, int]:
    """(global positions, T) of an activation of `rows` positions on this rank: my slice
    sp_rank of sp_size (sequence parallelism) of my context-parallel tokens."""
    T_cp = rows * sp_size
    T = T_cp * (context.group.size if context is not None else 1)
    mine = context.positions(T) if context is not None else np.arange(T)
    return mine[sp_rank * rows:(sp_rank + 1) * rows], T


class ContextParallelLayout(GPTLayout):
    """The GPT's activations under context parallelism alone (tp = 1): my positions."""

    def __init__(self, context: ContextParallel) -> None:
        self.context = context

    def positions(self, T: int):
        return self.context.positions(T * self.context.group.size)

    def sequence_shards(self, rows: int) -> dict:
        return {1: sequence_positions(rows, context=self.context)}


def apply_context(model, context: ContextParallel):
    """Make every attention of `model` run over the cp group, and (tp = 1) give the model a
    layout that puts its tokens at their global positions. Under tensor parallelism the
    TensorParallel must carry the same context (compose.build does both): ValueError if
    it does not, as its position embeddings would use local positions and attention
    global ones."""
    tp = getattr(model.layout, "tp", None)
    if tp is not None and tp.context is not context:
        raise ValueError("context parallelism of a tensor-parallel model: its TensorParallel "
                         "was built without this context, so its position embeddings would "
                         "use local positions and attention global ones; build it as "
                         "TensorParallel(group, ..., context=context) before apply_tensor.")
    for block in model.blocks:
        if getattr(block.attn.core, "selective", False):
            raise ValueError("context parallelism: selective recomputation wraps the "
                             "single-rank attention core; ring attention already rebuilds "
                             "its probabilities block by block and Ulysses is not wrapped. "
                             "Use recompute='full' or 'none' with cp > 1.")
        block.attn.core = context            # its `attention` runs over the cp group
    if type(model.layout) is GPTLayout:
        model.layout = ContextParallelLayout(context)
    return model
