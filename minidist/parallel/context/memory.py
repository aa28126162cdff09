"""Context parallelism as formulas: the bytes a cp rank sends, its attention work, its memory.

Communication. Attention is the only layer that talks over the cp group, and its traffic
per layer and micro-batch follows from the shapes alone (W = cp, b bytes per number, rows
sequences of T positions, h = H / tp heads of D on this rank, T_cp = T / W, and
N = rows h T_cp D numbers in one rank's K, or V):
    ring     forward   W-1 K/V blocks round the ring                       (W-1) 2N
             backward  W-1 K/V blocks again, and W dK/dV accumulators
                       (the W-th brings each accumulator home)           (2W-1) 2N
             per layer (3W-2) 2N b: linear in W at fixed T_cp, but every message
             overlaps the compute of a block (ring_attention.RING_TIMES measures how much)
    ulysses  forward   q, k, v seq -> heads, then y heads -> seq      4 (W-1)/W N
             backward  dy seq -> heads, then dq, dk, dv heads -> seq  4 (W-1)/W N
             per layer 8 (W-1)/W N b: flat in W at fixed T_cp (Jacobs et al.'s Sec. 3.2)
`cp_calls` lists these; `step_bytes` sums them over the micro-batches of a step: exactly
RankResult.bytes_by_axis["cp"] (the gradient sync runs on its own dp x cp group).

Work. Ring attention computes, per sequence and head, only the blocks a query can see
(ring_attention.attention_work): contiguous slices give rank r r+1 blocks of T_cp^2, so
max/mean = 2W/(W+1); zig-zag gives every rank T^2 (W+1) / (2 W^2). Ulysses computes whole
T x T matrices of H/W heads, T^2 / W per head of the model, balanced in either layout. The
single process computes the whole T x T (masked entries too): T^2. Forward FLOPs of the two
attention matmuls: 4 D per score element.

Activation memory (what the autograd keeps for one block, autograd/saved.py; tp = 1):
    both   LayerNorms 2 B T_cp (C+1) b, qkv and fc inputs 2 B T_cp C b, q, k, v
           3 B T_cp C b, proj input B T_cp C b, GELU 3 B T_cp F b (with dropout p > 0:
           the residual dropouts 4 B T_cp C b)
    ring   + its output y and lse: B T_cp C b + B H T_cp b. No score matrix at all: each
           block's p is recomputed from lse in the backward (FlashAttention's trick)
    ulysses + scores and softmax of H/W heads over ALL T: 2 B (H/W) T^2 b (with dropout:
           mask and output, 2 B (H/W) T^2 b more)
The single process keeps tensor_memory.activation_terms(tp=1): its T^2 terms are
2 B H T^2 b. So Ulysses divides the T^2 terms by W, ring removes them.

One rank's view of one step (cp rank c of W, M micro-batches, L layers), what it counts:
    1. forward, per micro-batch and layer: W-1 K/V passes (Ulysses: 2 all-to-alls);
    2. backward: W-1 K/V and W dK/dV passes (Ulysses: 2 all-to-alls).
Nothing here communicates except `measure_layer_activations`, which runs block 0 of the
cp-sharded model (collective over the cp group) for the tests and the bench.
References: Liu et al. 2023, arXiv:2310.01889 (ring attention, Sec. 3); Jacobs et al. 2023,
    arXiv:2309.14509 (Ulysses, Sec. 3.2, communication); Dao et al. 2022, arXiv:2205.14135
    (recomputing p from the log-sum-exp); Korthikanti et al. 2022, arXiv:2205.05198,
    Sec. 4.1 (what a layer stores).
Read next: bench/train.py (`python -m minidist bench train --cp 2`).
"""

from __future__ import annotations

import numpy as np

from minidist.autograd import Tensor
from minidist.autograd.saved import saved_bytes
from minidist.nn import GPT, GPTConfig
from minidist.nn.layers import DropoutKey
from minidist.parallel.context.context_parallel import ContextParallel, apply_context
from minidist.parallel.context.ring_attention import attention_work
from minidist.parallel.tensor import memory as tm
from minidist.parallel.tensor.memory import Call

ALGOS = ("ring", "ulysses")


def _check(cfg: GPTConfig, T: int, cp: int, algo: str, tp: int = 1) -> int:
    """h, the heads on one rank; ValueError unless T, H and the algorithm fit cp and tp."""
    if algo not in ALGOS or cp < 1 or tp < 1 or cfg.n_head % tp:
        raise ValueError(f"context_memory: need algo in {ALGOS}, cp, tp >= 1 and n_head="
                         f"{cfg.n_head} divisible by tp={tp}; got algo={algo!r}, cp={cp}.")
    h = cfg.n_head // tp
    if T % cp or (algo == "ulysses" and h % cp):
        raise ValueError(f"context_memory: T={T} must divide by cp={cp}"
                         + (f" and the {h} heads per tp rank too (Ulysses)"
                            if algo == "ulysses" else "") + ".")
    return h


def cp_calls(cfg: GPTConfig, rows: int, T: int, cp: int, algo: str = "ring",
             tp: int = 1) -> list[Call]:
    """Every cp message of ONE micro-batch (rows sequences of T) on one rank; Call.n is the
    numbers this rank sends per call (module docstring)."""
    h = _check(cfg, T, cp, algo, tp)
    if cp == 1:
        return []
    L, D, b = cfg.n_layer, cfg.n_embd // cfg.n_head, np.dtype(cfg.dtype).itemsize
    N = rows * h * (T // cp) * D                          # one rank's K (or V) block
    if algo == "ring":
        return [Call("forward: K/V blocks round the ring", "sendrecv", (cp - 1) * L, 2 * N, b),
                Call("backward: K/V blocks again", "sendrecv", (cp - 1) * L, 2 * N, b),
                Call("backward: dK/dV accumulators, home at last", "sendrecv", cp * L, 2 * N, b)]
    piece = N // cp                                       # h/W heads of my T/W positions
    return [Call("forward: q, k, v seq -> heads", "all_to_all", L, 3 * (cp - 1) * piece, b),
            Call("forward: y heads -> seq", "all_to_all", L, (cp - 1) * piece, b),
            Call("backward: dy seq -> heads", "all_to_all", L, (cp - 1) * piece, b),
            Call("backward: dq, dk, dv heads -> seq", "all_to_all", L, 3 * (cp - 1) * piece, b)]


def step_bytes(cfg: GPTConfig, rows: int, T: int, cp: int, algo: str = "ring", *,
               tp: int = 1, micro_batches: int = 1) -> int:
    """Bytes one cp rank sends for attention in one training step: M x sum of cp_calls.
    rows: sequences per micro-batch, B / (dp M). The same on every cp rank."""
    per = sum(c.times * c.n * c.itemsize for c in cp_calls(cfg, rows, T, cp, algo, tp))
    return micro_batches * per


# --- attention work ----------------------------------------------------------------------

def attention_scores(T: int, cp: int, algo: str = "ring", layout: str = "zigzag",
                     causal: bool = True) -> list[int]:
    """Per cp rank, the score elements it computes per sequence and per head of the model:
    ring_attention.attention_work (ring), T^2 / cp (Ulysses), T^2 (cp = 1: attention_core
    computes the whole matrix, masked entries included)."""
    if cp == 1:
        return [T * T]
    if algo == "ring":
        return attention_work(T, cp, layout, causal)
    if algo != "ulysses" or T % cp:
        raise ValueError(f"attention_scores: algo={algo!r} must be in {ALGOS}, T={T} a "
                         f"multiple of cp={cp}.")
    return [T * T // cp] * cp


def attention_flops(rows: int, n_head: int, head_dim: int, scores: int) -> int:
    """Forward FLOPs of q k^T and p v for `scores` elements per sequence and head: 4 D each."""
    return 4 * rows * n_head * head_dim * scores


# --- activation memory -------------------------------------------------------------------

def activation_terms(B: int, T: int, C: int, H: int, F: int, *, cp: int = 1,
                     algo: str = "ring", itemsize: int = 8, dropout: bool = False
                     ) -> dict[str, int]:
    """{term: bytes} one cp rank keeps for the backward of one layer (module docstring);
    cp = 1: the single process, tensor_memory.activation_terms(tp=1)."""
    if cp == 1:
        return tm.activation_terms(B, T, C, H, F, itemsize=itemsize, dropout=dropout)
    if algo not in ALGOS or T % cp or C % H or (algo == "ulysses" and H % cp):
        raise ValueError(f"activation_terms: algo={algo!r} in {ALGOS}, T={T} divisible by "
                         f"cp={cp}, C={C} by H={H} (Ulysses: H by cp).")
    Tl, b = T // cp, itemsize
    terms = {"layernorm xhat, 1/sigma (x2)": 2 * B * Tl * (C + 1) * b,
             "qkv and fc inputs": 2 * B * Tl * C * b,
             "q, k, v": 3 * B * Tl * C * b,
             "proj input": B * Tl * C * b,
             "gelu input, tanh, output": 3 * B * Tl * F * b}
    if algo == "ring":
        terms["ring output y, lse"] = B * Tl * C * b + B * H * Tl * b
    else:
        terms["scores and softmax, H/cp heads, all T"] = 2 * B * (H // cp) * T * T * b
    if dropout:
        terms["residual dropouts (x2) input, mask"] = 4 * B * Tl * C * b
        if algo == "ulysses":
            terms["attention dropout mask, output"] = 2 * B * (H // cp) * T * T * b
    return terms


def activation_bytes(B: int, T: int, C: int, H: int, F: int, *, cp: int = 1,
                     algo: str = "ring", itemsize: int = 8, dropout: bool = False) -> int:
    """Bytes one cp rank keeps for the backward of one layer: sum of activation_terms."""
    return sum(activation_terms(B, T, C, H, F, cp=cp, algo=algo, itemsize=itemsize,
                                dropout=dropout).values())


def measure_layer_activations(group, cfg: GPTConfig, rows: int, algo: str = "ring",
                              layout: str = "zigzag", seed: int = 0,
                              T: int | None = None) -> int:
    """COLLECTIVE over `group` (the cp group; size 1: the plain GPT): bytes the autograd keeps
    for block 0 of GPT(cfg, seed) with its attention over the cp group, on rows x T/cp random
    inputs at this rank's positions, parameters excluded (autograd/saved.py)."""
    T = cfg.block_size if T is None else T
    W = group.size
    _check(cfg, T, W, algo)
    model = GPT(cfg, seed)
    if W > 1:
        apply_context(model, ContextParallel(group, algo, layout))
    x = Tensor(np.random.default_rng(seed).standard_normal((rows, T // W, cfg.n_embd))
               .astype(cfg.dtype), requires_grad=True)
    key = DropoutKey(seed, 0, tuple(range(rows))) if cfg.dropout > 0 else None
    y, _ = model.blocks[0](x, key)
    return saved_bytes(y, exclude=model.parameters())


__all__ = ["ALGOS", "cp_calls", "step_bytes",
           "attention_scores", "attention_flops", "activation_terms", "activation_bytes",
           "measure_layer_activations"]
