"""Tensor parallelism (Megatron-LM): split every weight matrix of a block over the tp group.

A transformer block is two matmul pairs: attention (qkv, then proj) and the MLP (fc, then
proj). Megatron splits the FIRST matmul of a pair by columns and the SECOND by rows:

    x[B, T, C] --f--> x @ W1[C, F_tp] = h[B, T, F_tp] --act--> h @ W2[F_tp, C] = y {U_tp}
               --g--> y[B, T, C]
Each rank computes F/W of the hidden features from the full input, applies the
elementwise activation to them (no communication: a column split keeps whole features),
and the row-parallel matmul gives a partial sum over its features; one all-reduce (g)
finishes it. Attention splits the same way by HEADS: heads are independent until the
output projection, so rank r runs heads r H_tp .. (r+1) H_tp - 1 whole.

The two conjugate operators, as autograd Functions named as in the paper (Fig. 3):
    f   forward identity,     backward all-reduce   (in front of a column-parallel layer)
    g   forward all-reduce,   backward identity     (behind a row-parallel layer)
In the backward, each rank's dx of a column-parallel layer only accounts for its columns
(a partial sum), hence f's all-reduce; g's forward all-reduce makes y whole, and whole
dy needs nothing more. Under sequence parallelism (parallel/tensor/sequence.py) f becomes an
all-gather along T and g a reduce-scatter along T.

One rank's view of one block (tp rank r of W; H heads, F = 4C hidden features):
    1. a = f(LN1(x));  qkv = a @ Wqkv[C, 3 C_tp]: q, k, v of my H/W heads (fused, see below)
    2. y = attention of my heads: [B, T, C_tp];  o = y @ Wproj[C_tp, C] {U_tp};  x += g(o)
    3. a = f(LN2(x));  h = gelu(a @ Wfc[C, F_tp]);  o = h @ Wproj2[F_tp, C] {U_tp};  x += g(o)
Sharding: qkv, fc: Shard(1) (columns; qkv as Shard(1, blocks=3): rank r holds columns
r C_tp .. of EACH of q, k and v, the "shard expression" of the fused weight); their biases
Shard(0); proj weights Shard(0) (rows), proj biases Replicate (added once, after g);
LayerNorms and wpe Replicate; wte and the LM head split by vocabulary (parallel/tensor/vocab.py).
Communication per layer and micro-batch (without SP): 2 all-reduces of B T C forward (the
two g) and 2 backward (the two f): 4 x 2(W-1)/W B T C numbers sent per rank (ring).
References: Shoeybi et al. 2019, "Megatron-LM", arXiv:1909.08053, Sec. 3, Fig. 3 (f, g);
    Narayanan et al. 2021, arXiv:2104.04473, Sec. 2.3.
Read next: parallel/tensor/sequence.py (sequence parallelism), parallel/tensor/async_tp.py
(its collectives overlapped with the matmuls), parallel/tensor/vocab.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist import backend
from minidist import collectives as C
from minidist.autograd import Function, Tensor
from minidist.autograd import functional as F
from minidist.nn.attention import CausalSelfAttention
from minidist.nn.gpt import GPTLayout
from minidist.nn.layers import MLP, Linear
from minidist.nn.module import Module
from minidist.parallel import placement as pl
from minidist.parallel.context.context_parallel import sequence_positions
from minidist.parallel.tensor import async_tp
from minidist.parallel.tensor import sequence as sp
from minidist.parallel.tensor.vocab import VocabParallelEmbedding, shard_parameter, vocab_range
from minidist.parallel.tensor.vocab import vocab_parallel_cross_entropy


class f(Function):  # noqa: N801  (the paper's name)
    """Megatron's f: y = x forward; dx = all_reduce(dy) over tp backward."""

    @staticmethod
    def forward(ctx, x, *, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, dy):
        return (C.all_reduce(dy, group=ctx.tp.group, algo=ctx.tp.algo),)


class g(Function):  # noqa: N801  (the paper's name)
    """Megatron's g: y = all_reduce(x) over tp forward; dx = dy backward."""

    @staticmethod
    def forward(ctx, x, *, tp):
        return C.all_reduce(x, group=tp.group, algo=tp.algo)

    @staticmethod
    def backward(ctx, dy):
        return (dy,)


def copy_to_tensor_region(x: Tensor, tp) -> Tensor:
    """f, checked: x must be Replicate over tp; returns it Replicate."""
    pl.expect(x, "tp", pl.Replicate(), name="x", where="f (copy to the tp region)")
    return pl.tag(f.apply(x, tp=tp), "tp", pl.Replicate())


def reduce_from_tensor_region(x: Tensor, tp) -> Tensor:
    """g, checked: x must be Partial over tp (a row-parallel output); returns it Replicate."""
    pl.expect(x, "tp", pl.Partial(), name="x", where="g (reduce from the tp region)")
    return pl.tag(g.apply(x, tp=tp), "tp", pl.Replicate())


@dataclass(frozen=True)
class TensorParallel:
    """What a tensor-parallel layer needs: the tp group, SP on or off, the algorithms, and
    async TP (SP's collectives cut into steps hidden behind the matmuls: async_tp.py)."""

    group: object
    sequence_parallel: bool = False
    algo: str = "auto"              # all-reduce / reduce-scatter ("direct": rank order)
    gather_algo: str = "auto"
    context: object = None          # parallel/context.ContextParallel when cp > 1
    async_tp: bool = False          # SP only: the column matmuls and row exits overlapped

    def __post_init__(self) -> None:
        if self.async_tp and not self.sequence_parallel:
            raise ValueError(f"{self.prefix} async tensor parallelism overlaps the all-gather "
                             "and reduce-scatter of sequence parallelism with the matmuls; "
                             "without SP there are none. Pass sequence_parallel=True too.")

    @property
    def prefix(self) -> str:
        return getattr(self.group, "prefix", "")

    def enter(self, x: Tensor) -> Tensor:
        """Into a tensor-parallel region: f, or the all-gather along T under SP (which the
        column-parallel layers fuse with their matmul instead: see `matmul`)."""
        return sp.gather_from_sequence_region(x, self) if self.sequence_parallel \
            else copy_to_tensor_region(x, self)

    def matmul(self, x: Tensor, w: Tensor) -> Tensor:
        """A column-parallel matmul: f(x) @ w, or under SP the all-gather along T fused with
        the matmul (sequence.AllGatherMatmul keeps only the shard for the backward; async TP:
        the same, its gather in steps behind the chunk products, async_tp.py)."""
        if self.sequence_parallel:
            fused = async_tp.all_gather_matmul if self.async_tp else sp.all_gather_matmul
            return fused(x, w, self)
        return pl.tag(self.enter(x) @ w, "tp", pl.Shard(2))

    def matmul_exit(self, x: Tensor, w: Tensor) -> Tensor:
        """A row-parallel matmul, a partial sum {U_tp}, and the way out of the region: exit
        (async TP: the reduce-scatter in steps, each sent while the next chunk is computed)."""
        if not self.async_tp:
            return self.exit(pl.tag(x @ w, "tp", pl.Partial()))
        return async_tp.matmul_reduce_scatter(x, w, self)                  # async_tp.py

    def exit(self, y: Tensor) -> Tensor:
        """Out of a row-parallel layer: g, or the reduce-scatter along T under SP."""
        return sp.reduce_scatter_to_sequence_region(y, self) if self.sequence_parallel \
            else reduce_from_tensor_region(y, self)

    def sum_grad(self, p: Tensor) -> Tensor:
        """A replicated parameter used on sequence shards: f, so its grad is summed over tp."""
        return f.apply(p, tp=self) if self.sequence_parallel else p

    def sequence_shards(self, rows: int) -> dict:
        """For dropout on this rank's x[B, rows, C] outside the tp regions: {1: (global
        positions, T)} under SP or context parallelism, else {} (the whole sequence)."""
        if not self.sequence_parallel and self.context is None:
            return {}
        return {1: self.positions(rows)}

    def positions(self, rows: int) -> tuple:
        """(global positions, T) of the `rows` positions this rank holds outside the tp
        regions: its SP slice of its context-parallel tokens."""
        W, r = (self.group.size, self.group.rank) if self.sequence_parallel else (1, 0)
        return sequence_positions(rows, r, W, self.context)


class ColumnParallelLinear(Module):
    """y[B, T, F_tp] = f(x)[B, T, C] @ W[C, F_tp] + b[F_tp]: output features split over tp.

    backward: dx {U_tp} --f: all-reduce--> dx; dW, db local. `blocks` = 3 for the fused
    qkv weight (Shard(1, blocks=3)). Built from the full layer: the values are its slice.
    """

    def __init__(self, full: Linear, tp: TensorParallel, blocks: int = 1) -> None:
        self.tp = tp
        self.weight = shard_parameter(full.weight, pl.Shard(1, blocks), tp)
        self.bias = None if full.bias is None else shard_parameter(full.bias,
                                                                   pl.Shard(0, blocks), tp)

    def forward(self, x: Tensor) -> Tensor:
        y = self.tp.matmul(x, self.weight)                          # (B, T, C) @ (C, F_tp)
        y = y if self.bias is None else y + self.bias
        return pl.tag(y, "tp", pl.Shard(2))


class RowParallelLinear(Module):
    """y[B, T, C] = g(x[B, T, F_tp] @ W[F_tp, C]) + b: input features split over tp.

    The matmul gives a partial sum {U_tp}; g all-reduces it (SP: reduce-scatter along T;
    async TP: the matmul and the reduce-scatter in overlapped steps, see tp.matmul_exit);
    the replicated bias is added once, after the reduction.
    """

    def __init__(self, full: Linear, tp: TensorParallel) -> None:
        self.tp = tp
        self.weight = shard_parameter(full.weight, pl.Shard(0), tp)
        self.bias = full.bias

    def forward(self, x: Tensor) -> Tensor:
        pl.expect(x, "tp", pl.Shard(2), name="x", where="RowParallelLinear")
        y = self.tp.matmul_exit(x, self.weight)          # exit(x @ W): (B, T, C) or T_tp
        return y if self.bias is None else y + self.tp.sum_grad(self.bias)


class TensorParallelAttention(CausalSelfAttention):
    """Causal self-attention on this rank's H / W heads (nn/attention.py's `attend`)."""

    def __init__(self, full: CausalSelfAttention, tp: TensorParallel) -> None:
        W = tp.group.size
        if full.n_head % W:
            raise ValueError(f"{tp.prefix} tensor parallelism splits attention by heads: "
                             f"n_head={full.n_head} is not divisible by tp={W}. Use n_head "
                             f"a multiple of {W}, or a tp that divides {full.n_head}.")
        self.n_head, self.head_dim, self.tp = full.n_head, full.head_dim, tp
        self.qkv = ColumnParallelLinear(full.qkv, tp, blocks=3)    # [C, 3 C_tp]
        self.proj = RowParallelLinear(full.proj, tp)               # [C_tp, C]
        self.attn_drop, self.resid_drop = full.attn_drop, full.resid_drop
        self.core = full.core                # the attention of my heads (nn/attention.py)

    def forward(self, x: Tensor, key=None) -> Tensor:
        first = self.tp.group.rank * (self.n_head // self.tp.group.size)
        y = self.attend(self.qkv(x), key, first_head=first)        # (B, T, C_tp)
        y = self.proj(pl.tag(y, "tp", pl.Shard(2)))                 # (B, T, C) or T_tp
        return self.resid_drop(y, key)


class TensorParallelMLP(MLP):
    """fc column-parallel [C, F_tp] -> GELU on my features -> proj row-parallel [F_tp, C]."""

    def __init__(self, full: MLP, tp: TensorParallel) -> None:
        hidden, W = full.fc.weight.shape[1], tp.group.size
        if hidden % W:
            raise ValueError(f"{tp.prefix} tensor parallelism splits the MLP's hidden "
                             f"features: {hidden} is not divisible by tp={W}.")
        self.tp = tp
        self.fc = ColumnParallelLinear(full.fc, tp)
        self.proj = RowParallelLinear(full.proj, tp)
        self.drop = full.drop

    def forward(self, x: Tensor, key=None) -> Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")                 # (B, T, F_tp)
        y = self.proj(h)                                            # (B, T, C) or T_tp
        return self.drop(y, key)


class TensorParallelLayout(GPTLayout):
    """The GPT's activations under tp (and SP): nn/gpt.py asks, this answers."""

    def __init__(self, model, tp: TensorParallel) -> None:
        self.tp, self.vocab_size, self.model = tp, model.cfg.vocab_size, model

    @property
    def head_param(self):
        """The LM head's weight parameter as the model holds it now (wte when tied)."""
        m = self.model
        return m.wte.weight if m.cfg.tie_weights else m.lm_head.weight

    def positions(self, T: int):
        """Global positions of the embedded tokens: T input tokens, my SP slice of them."""
        rows = T // self.tp.group.size if self.tp.sequence_parallel else T
        return backend.xp.asarray(self.tp.positions(rows)[0])

    def sequence_shards(self, rows: int) -> dict:
        return self.tp.sequence_shards(rows)

    def logits(self, x: Tensor, w: Tensor) -> Tensor:
        """Column-parallel LM head: logits[B, T, V_tp] (SP: after the all-gather along T)."""
        self.check_head()
        return self.tp.matmul(x, w)                                 # (B, T, C) @ (C, V_tp)

    def check_head(self) -> None:
        """In check mode, PlacementError unless the LM head is sharded by vocabulary."""
        if pl.checking() and not isinstance(pl.placement_of(self.head_param, "tp"), pl.Shard):
            raise pl.PlacementError(
                f"{self.tp.prefix} the LM head weight is {pl.placement_of(self.head_param, 'tp')}"
                " over tp, but a tensor-parallel GPT must shard it by vocabulary (Shard); an "
                "unsharded head computes all V logits on every rank (picotron #23).")

    def loss_sum(self, logits: Tensor, targets) -> Tensor:
        """The same scalar on every tp rank (the vocabulary-parallel loss all-reduces):
        Replicate, so that a MoE's auxiliary losses (Replicate too) may be added to it."""
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp, self.vocab_size)
        return pl.tag(loss, "tp", pl.Replicate())


def expected_placement(name: str) -> pl.Placement:
    """Megatron's layout: the tp placement every GPT parameter must have."""
    table = {"wte.weight": pl.Shard(0), "lm_head.weight": pl.Shard(1),
             "attn.qkv.weight": pl.Shard(1, 3), "attn.qkv.bias": pl.Shard(0, 3),
             "attn.proj.weight": pl.Shard(0), "mlp.fc.weight": pl.Shard(1),
             "mlp.fc.bias": pl.Shard(0), "mlp.proj.weight": pl.Shard(0)}
    for suffix, placement in table.items():
        if name == suffix or name.endswith("." + suffix):
            return placement
    return pl.Replicate()


def apply_tensor(model, tp: TensorParallel):
    """Turn a full GPT (drawn from (seed, name)) into this rank's tensor-parallel shard.

    Modules are replaced in place, so every parameter keeps its name and its position in
    model.parameters(); each sharded parameter holds the exact slice of the full one.
    """
    cfg = model.cfg
    context = getattr(model.layout, "context", None)     # apply_context ran first
    if context is not None and tp.context is not context:
        raise ValueError(f"{tp.prefix} tensor parallelism of a context-parallel model: build "
                         "the TensorParallel with the model's context (TensorParallel(group, "
                         "..., context=context)), or its position embeddings would use "
                         "local positions and attention global ones.")
    if cfg.moe_every and tp.sequence_parallel:
        raise ValueError(f"{tp.prefix} sequence parallelism of MoE blocks is not built (their "
                         "routing groups would be cut over tp); use tp without SP.")
    model.wte = VocabParallelEmbedding(model.wte, tp)
    if not cfg.tie_weights:
        model.lm_head.weight = shard_parameter(model.lm_head.weight, pl.Shard(1), tp)
    if tp.sequence_parallel:
        model.wpe = sp.SequenceParallelPositions(model.wpe, tp)
        model.ln_f = sp.SequenceParallelLayerNorm(model.ln_f, tp)
    for block in model.blocks:
        block.attn = TensorParallelAttention(block.attn, tp)
        if hasattr(block, "mlp"):            # a MoE stays whole, Replicate over tp: every
            block.mlp = TensorParallelMLP(block.mlp, tp)    # tp rank routes the same tokens
        if tp.sequence_parallel:
            block.ln_1 = sp.SequenceParallelLayerNorm(block.ln_1, tp)
            block.ln_2 = sp.SequenceParallelLayerNorm(block.ln_2, tp)
    model.layout = TensorParallelLayout(model, tp)
    check_layout(model, tp)
    return model


def check_layout(model, tp: TensorParallel) -> None:
    """PlacementError unless every parameter is placed over tp as Megatron's layout says."""
    wrong = [(n, pl.placement_of(p, "tp"), expected_placement(n))
             for n, p in model.named_parameters()
             if pl.placement_of(p, "tp") != expected_placement(n)]
    if wrong:
        lines = "; ".join(f"{n} is {a}, expected {e}" for n, a, e in wrong[:4])
        raise pl.PlacementError(f"{tp.prefix} tensor-parallel GPT (tp={tp.group.size}) is "
                                f"not laid out as Megatron's: {lines}.")


__all__ = ["f", "g", "TensorParallel", "ColumnParallelLinear", "RowParallelLinear",
           "TensorParallelAttention", "TensorParallelMLP", "TensorParallelLayout",
           "apply_tensor", "expected_placement", "vocab_range"]
