"""Tensor parallelism as formulas: the bytes a tp rank sends and the activations it keeps.

Communication. Megatron's layout (tensor_parallel.py) costs, per layer and micro-batch,
2 all-reduces of the hidden states x[B, T, C] forward (g) and 2 backward (f); sequence
parallelism (parallel/tensor/sequence.py) turns each into an all-gather or a reduce-scatter
along T, and the volume stays the same, 4 x 2(W-1)/W B T C numbers per rank on a ring.
Around the blocks come the embedding's g, the LM head's f, the vocabulary-parallel loss's
3 all-reduces of B T numbers (parallel/tensor/vocab.py) and, under SP only, one all-reduce per
replicated parameter used on sequence shards (its gradient is a partial sum over my
positions): the LayerNorm gains and shifts, the row-parallel biases, ln_f, and the whole
position table wpe (block_size, C). Once per step the engine's norm all-gathers one
float64 per rank over tp (parallel/sharding.py). `tp_calls` lists them all;
`step_bytes` sums what ONE rank counts as sent (group.stats) for each, using the
algorithm really run (compose.build: "direct" all-reduce and reduce-scatter on shared
memory, all-gathers "auto"), so it equals RankResult.bytes_by_axis["tp"] exactly:
    direct all-reduce of n   (W-1) n if n b <= 4096 (direct_small.py), else per round of
                             direct.window elements (w - n_r) + (W-1) n_r, n_r = my share
    direct/ring reduce-scatter  n - n_r            ring all-reduce  2n - n_r - n_{r+1}
    all-gather of m per rank    ring (W-1) m; halving (W-1) m when W is a power of two
n_r is chunk r of np.array_split(n, W): the count depends on the rank unless W divides n.

Activation memory (what the autograd keeps for the backward, autograd/saved.py), per
layer and rank, b bytes per element, W = tp, T' = T/W under SP (else T), H heads, F MLP
features; parameters excluded:
    LayerNorms (xhat, 1/sigma) x 2          2 B T' (C + 1) b
    qkv and fc inputs                       2 B T' C b     (under SP only my positions)
    q, k, v of my H/W heads (one buffer)    3 B T C/W b
    scores (kept by the 1/sqrt(D) scale)    B H/W T^2 b
    softmax output                          B H/W T^2 b
    proj input (my heads)                   B T C/W b
    GELU input, tanh, output                3 B T F/W b
    with dropout p > 0: attention dropout (mask, output) 2 B H/W T^2 b; the two residual
    dropouts (input, mask) 4 B T' C b
Korthikanti et al.'s Table 2 (16-bit activations, 1-byte dropout masks; s = T, b = B,
h = C, a = H, t = W): 34 sbh + 5as^2b without parallelism; sbh (10 + 24/t) + 5as^2b/t with
tp; sbh 34/t + 5as^2b/t with tp + SP. Ours without SP has the same shape: an unsharded
4 B T C b + 2 B T b (their 10 sbh less the two dropout masks) plus terms over W. Under SP
every term divides by W: the two column-parallel matmuls
keep only their input shard and all-gather it again in the backward
(sequence.AllGatherMatmul, as Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication
does): 2 more all-gathers per layer, and 1 for the LM head.

One rank's view of one step (tp rank r of W, M micro-batches of B sequences), the calls
`tp_calls` lists, with SP's replacements in brackets:
    1. forward: embedding g [reduce-scatter]; per block 2 g [2 all-gathers in, 2
       reduce-scatters out]; LM head f, nothing [all-gather]; the loss's 3 all-reduces;
    2. backward: LM head f [all-gather again, reduce-scatter]; per block 2 f [2
       all-gathers of the outputs' gradients, 2 all-gathers again of the inputs, 2
       reduce-scatters]; embedding nothing [all-gather]; [+ the replicated gradients'
       all-reduces];
    3. after M micro-batches: the grad norm's all-gather of one float64.
Nothing here communicates except `measure_layer_activations`, which runs block 0
(collective over the tp group) for the tests and the bench to compare with.
References: Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3 (f and g); Korthikanti et al.
    2022, arXiv:2205.05198, Sec. 4.1-4.2 and Table 2.
Read next: bench/train.py (`python -m minidist bench train --tp 2`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist.autograd import Tensor
from minidist.autograd.saved import saved_bytes
from minidist.collectives import cost, direct, direct_small
from minidist.nn import GPT, GPTConfig
from minidist.nn.layers import DropoutKey
from minidist.parallel import placement as pl
from minidist.parallel.tensor.tensor_parallel import TensorParallel, apply_tensor

NORM_ITEMSIZE = 8                   # the grad-norm partial sum is float64 in every dtype


@dataclass(frozen=True)
class Call:
    """`times` calls of collective `op` over tp, n elements of `itemsize` bytes per rank."""

    what: str
    op: str
    times: int
    n: int
    itemsize: int


def _share(n: int, W: int, r: int) -> int:
    """Size of chunk r of np.array_split(range(n), W)."""
    return n // W + (1 if r < n % W else 0)


def _halving_gather_rows(W: int, r: int) -> int:
    """Rows of m elements rank r sends in halving_doubling.all_gather (its fold, the
    doubling rounds over the participants' windows, the unfold)."""
    Wp = 1 << (W.bit_length() - 1)
    rem = W - Wp
    if r < 2 * rem and r % 2 == 0:
        return 1                                          # folds into r + 1, waits
    first = lambda i: 2 * i if i < rem else i + rem       # noqa: E731  first old rank of i
    lo, mask, rows = (r // 2 if r < 2 * rem else r - rem), 1, 0
    while mask < Wp:
        rows += first(lo + mask) - first(lo)
        lo, mask = min(lo, lo ^ mask), 2 * mask
    return rows + (W if r < 2 * rem else 0)


def sent_bytes(op: str, n: int, W: int, r: int, itemsize: int, algo: str = "direct",
               shared_memory: bool = True) -> int:
    """Bytes rank r of W counts as sent (group.stats) for one call of `op` on n elements."""
    if W == 1 or n == 0:
        return 0
    if algo == "auto":
        algo = cost.choose(op, n * itemsize, W, shared_memory=shared_memory)
    s, s_next = _share(n, W, r), _share(n, W, (r + 1) % W)
    if op == "all_reduce" and algo == "direct":
        if n * itemsize <= direct_small.SMALL_BYTES:
            return (W - 1) * n * itemsize
        m, elems = direct.window(itemsize, W), 0
        for start in range(0, n, m):
            w = min(m, n - start)
            elems += w - _share(w, W, r) + (W - 1) * _share(w, W, r)
        return elems * itemsize
    table = {("all_reduce", "ring"): 2 * n - s - s_next,
             ("reduce_scatter", "direct"): n - s, ("reduce_scatter", "ring"): n - s,
             ("all_gather", "ring"): (W - 1) * n,
             ("all_gather", "halving"): _halving_gather_rows(W, r) * n}
    if (op, algo) not in table:
        raise ValueError(f"tensor_memory: no byte count for {op} with algo {algo!r}; the tp "
                         "layers run direct or ring (all-gathers ring or halving).")
    return table[(op, algo)] * itemsize


def _check_split(cfg: GPTConfig, T: int, tp: int, sp: bool) -> None:
    F = cfg.mlp_ratio * cfg.n_embd
    if cfg.n_head % tp or cfg.n_embd % tp or F % tp or (sp and T % tp) or (sp and tp == 1):
        raise ValueError(f"tensor_memory: n_head={cfg.n_head}, C={cfg.n_embd}, F={F}"
                         f"{f', T={T}' if sp else ''} must all divide by tp={tp}"
                         f"{' (and SP needs tp > 1)' if sp else ''}.")


def tp_calls(cfg: GPTConfig, rows: int, T: int, tp: int, sp: bool) -> list[Call]:
    """Every tp collective of ONE micro-batch (rows sequences of T positions) on one rank."""
    _check_split(cfg, T, tp, sp)
    L, C, b = cfg.n_layer, cfg.n_embd, np.dtype(cfg.dtype).itemsize
    x, tokens = rows * T * C, rows * T                    # B T C hidden states, B T tokens
    loss = Call("loss: max, exp-sum, target logit", "all_reduce", 3, tokens, b)
    if not sp:
        return [Call("embedding: g (forward)", "all_reduce", 1, x, b),
                Call("blocks: g after attention and MLP", "all_reduce", 2 * L, x, b),
                Call("blocks: f before attention and MLP (backward)", "all_reduce", 2 * L,
                     x, b),
                Call("LM head: f (backward)", "all_reduce", 1, x, b), loss]
    per_layer = 2 * (1 + cfg.bias) + 2 * cfg.bias         # LN gains (+ shifts), row biases
    return [Call("embedding: reduce-scatter (fwd)", "reduce_scatter", 1, x, b),
            Call("embedding: all-gather (bwd)", "all_gather", 1, x // tp, b),
            Call("blocks: all-gather in (fwd, again in bwd) / out (bwd)", "all_gather",
                 6 * L, x // tp, b),
            Call("blocks: reduce-scatter out (fwd) / in (bwd)", "reduce_scatter", 4 * L, x, b),
            Call("LM head: all-gather (fwd, again in bwd)", "all_gather", 2, x // tp, b),
            Call("LM head: reduce-scatter (bwd)", "reduce_scatter", 1, x, b), loss,
            Call("grads of LN gains/shifts, row biases, ln_f (f)", "all_reduce",
                 per_layer * L + 1 + cfg.bias, C, b),
            Call("grad of the position table wpe (f)", "all_reduce", 1, cfg.block_size * C, b)]


def step_bytes(cfg: GPTConfig, rows: int, T: int, tp: int, sp: bool = False, *,
               micro_batches: int = 1, rank: int = 0, algo: str = "direct",
               gather_algo: str = "auto", shared_memory: bool = True) -> int:
    """Bytes tp rank `rank` sends over tp in one training step (= bytes_by_axis["tp"]).

    rows: sequences per micro-batch, B / (dp M). Every micro-batch runs tp_calls; the
    step adds the engine's all-gather of one float64 (the grad norm's partial sum).
    """
    if tp == 1:
        return 0
    total = 0
    for c in tp_calls(cfg, rows, T, tp, sp):
        a = gather_algo if c.op == "all_gather" else algo
        total += c.times * sent_bytes(c.op, c.n, tp, rank, c.itemsize, a, shared_memory)
    norm = sent_bytes("all_gather", 1, tp, rank, NORM_ITEMSIZE, gather_algo, shared_memory)
    return micro_batches * total + norm


def megatron_layer_bytes(B: int, T: int, C: int, tp: int, itemsize: int) -> float:
    """The papers' figure per layer and micro-batch: 4 ring all-reduces of B T C numbers,
    4 x 2(W-1)/W B T C x itemsize bytes (with SP: 4 all-gathers + 4 reduce-scatters, the
    same). Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022, Sec. 4.2.2."""
    return 4 * 2 * (tp - 1) / tp * B * T * C * itemsize


# --- activation memory -------------------------------------------------------------------

def activation_terms(B: int, T: int, C: int, H: int, F: int, *, tp: int = 1,
                     sp: bool = False, itemsize: int = 8, dropout: bool = False
                     ) -> dict[str, int]:
    """{term: bytes} one tp rank keeps for the backward of one layer (module docstring)."""
    W, b = tp, itemsize
    if H % W or C % W or F % W or (sp and (T % W or W == 1)):
        raise ValueError(f"activation_terms: H={H}, C={C}, F={F}{f', T={T}' if sp else ''} "
                         f"must divide by tp={W}{' (and SP needs tp > 1)' if sp else ''}.")
    Tl = T // W if sp else T                              # positions outside the tp regions
    terms = {"layernorm xhat, 1/sigma (x2)": 2 * B * Tl * (C + 1) * b,
             "qkv and fc inputs": 2 * B * Tl * C * b,
             "q, k, v of my heads": 3 * B * T * (C // W) * b,
             "scores and softmax": 2 * B * (H // W) * T * T * b,
             "proj input": B * T * (C // W) * b,
             "gelu input, tanh, output": 3 * B * T * (F // W) * b}
    if dropout:
        terms["attention dropout mask, output"] = 2 * B * (H // W) * T * T * b
        terms["residual dropouts (x2) input, mask"] = 4 * B * Tl * C * b
    return terms


def activation_bytes(B: int, T: int, C: int, H: int, F: int, *, tp: int = 1,
                     sp: bool = False, itemsize: int = 8, dropout: bool = False) -> int:
    """Bytes one tp rank keeps for the backward of one layer: sum of activation_terms."""
    return sum(activation_terms(B, T, C, H, F, tp=tp, sp=sp, itemsize=itemsize,
                                dropout=dropout).values())


def paper_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1,
                           sp: bool = False) -> float:
    """Korthikanti et al. 2022, Table 2: bytes per layer, 16-bit activations with dropout.
    sbh (10 + 24/t) + 5as^2b/t (t = 1: 34 sbh + 5as^2b); with SP sbh 34/t + 5as^2b/t."""
    unsharded = 0 if sp else 10 * s * b * h
    sharded = (34 if sp else 24) * s * b * h
    return unsharded + sharded / t + 5 * a * s * s * b / t


def measure_layer_activations(group, cfg: GPTConfig, rows: int, sp: bool = False,
                              seed: int = 0, T: int | None = None) -> int:
    """COLLECTIVE over `group` (the tp group; size 1: the plain GPT): bytes the autograd keeps
    for block 0 of this rank's shard of GPT(cfg, seed) on rows x T random inputs (T'
    positions under SP), parameters excluded (autograd/saved.py)."""
    T = cfg.block_size if T is None else T
    _check_split(cfg, T, group.size, sp)
    algo = "direct" if getattr(group, "supports_shared", False) else "ring"
    model = GPT(cfg, seed)
    if group.size > 1:
        apply_tensor(model, TensorParallel(group, sp, algo=algo))
    shape = (rows, T // group.size if sp else T, cfg.n_embd)
    x = Tensor(np.random.default_rng(seed).standard_normal(shape).astype(cfg.dtype),
               requires_grad=True)
    x = pl.tag(x, "tp", pl.Shard(1) if sp else pl.Replicate())
    key = DropoutKey(seed, 0, tuple(range(rows))) if cfg.dropout > 0 else None
    y, _ = model.blocks[0](x, key)
    return saved_bytes(y, exclude=model.parameters())


__all__ = ["Call", "sent_bytes", "tp_calls", "step_bytes", "megatron_layer_bytes",
           "activation_terms", "activation_bytes", "paper_activation_bytes",
           "measure_layer_activations"]
