"""The architecture a prediction prices: a decoder-only transformer, described by its shapes.

The predictor (hardware/predict.py) prices models it never builds. minidist's GPT
(nn/gpt.py) is one of them; a Llama block is another, and nn/ does not build it. Both are
the same stack of L blocks around a token embedding and an LM head, and differ only in a
few choices, so one small description serves both (`Architecture`):

    choice          minidist's GPT (GPT-2's block)     Llama 2 / 3
    norm            LayerNorm, gain and shift          RMSNorm, gain only
    mlp             fc (C x F), GELU, fc2 (F x C)      SwiGLU: gate and up (C x F each),
                                                       silu(gate) * up, down (F x C)
    attention       H heads, each with its own K, V    grouped-query: H query heads share
                                                       G = n_kv_head K, V heads (G | H)
    positions       a learned table (T x C)            rotary, inside attention (no table)
    biases          on every linear layer and norm     none
    embeddings      tied (the LM head is wte^T)        untied (a separate C x V head)

`of(cfg)` turns a GPTConfig into its Architecture; hardware/llama.py holds the Llama
presets. From an Architecture: the op list of a step (roofline.gpt_ops), the parameter
arrays and their count, one array's share under Megatron's split (`local_numel`); on a
layout (hardware/architecture_layout.py) its rules and each rank's elements, and the memory
(hardware/architecture_memory.py). This module imports no runtime: the roofline and the
GPU check read it on machines without multiprocess.

One block's parameter arrays, in the order GPT(cfg).parameters() keeps them (a Llama's
fused the way Megatron stores them: q, k, v in one qkv matrix, gate and up in one fc):
    norm_1 (C,)   qkv (C, (H + 2G) D)   proj (C, C)   norm_2 (C,)   fc (C, F or 2F)   fc2 (F, C)
    (+ a bias of the output width after each, GPT only); D = C / H the head width.
Around the blocks: wte (V, C) [+ wpe (T, C)]; norm_f (C,) [+ lm_head (C, V) when untied].

Sharding over tp (Megatron's split, Shoeybi et al. 2019, Sec. 3; for grouped-query
attention Megatron-core's Attention, which splits the query heads and the KV groups over
tp and refuses a tp that does not divide both):
    qkv[C, ((H + 2G) D)_tp]  its H / tp query heads and G / tp KV heads; fc[C, F_tp] (both
    halves of SwiGLU's); proj[C_tp, C] and fc2[F_tp, C] by rows; wte[V_tp, C] and
    lm_head[C, V_tp] by vocabulary (V padded to a multiple of tp, each rank ceil(V / tp)
    rows, as parallel/placement.piece_length pads); norms, wpe and the row-split layers'
    biases whole on every rank. So tp must divide H, G and F (`check_tp`: refused, as
    Megatron refuses it; replicating KV heads when tp > G, as some inference engines do,
    is not modelled).

References: Radford et al. 2019 (GPT-2); Touvron et al. 2023, arXiv:2302.13971, Sec. 2.2
    (RMSNorm, SwiGLU, rotary); Ainslie et al. 2023, arXiv:2305.13245 (grouped-query
    attention); Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3 (the tp split).
Read next: hardware/llama.py, hardware/architecture_memory.py, hardware/roofline.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minidist.nn import GPTConfig
from minidist.parallel.placement import piece_length

NORMS = ("layernorm", "rmsnorm")         # also the op names in roofline.gpt_ops
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rotary")
RECOMPUTE = ("none", "selective", "full")

Shapes = list[tuple[str, tuple[int, ...], int | None]]     # (name, shape, the dim tp splits)


@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer by its shapes (module docstring). Field names follow
    GPTConfig's where they mean the same; `recompute` is the run's activation policy,
    carried here as GPTConfig carries it."""

    n_layer: int                 # L
    n_embd: int                  # C
    n_head: int                  # H query heads
    n_kv_head: int               # G key/value heads (G = H: multi-head attention)
    ffn_hidden: int              # F, the MLP's hidden width
    vocab_size: int              # V
    block_size: int              # T, the context length
    norm: str = "layernorm"
    mlp: str = "gelu"
    positions: str = "learned"
    bias: bool = True
    tie_weights: bool = True
    recompute: str = "none"

    def __post_init__(self) -> None:
        for field in ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "vocab_size",
                      "block_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"Architecture: {field}={getattr(self, field)} must be >= 1.")
        if self.n_embd % self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"Architecture: n_head={self.n_head} must divide n_embd="
                             f"{self.n_embd}, and n_kv_head={self.n_kv_head} must divide "
                             "n_head (each KV head serves a whole group of query heads).")
        for name, value, allowed in (("norm", self.norm, NORMS), ("mlp", self.mlp, MLPS),
                                     ("positions", self.positions, POSITIONS),
                                     ("recompute", self.recompute, RECOMPUTE)):
            if value not in allowed:
                raise ValueError(f"Architecture: {name}={value!r} must be one of {allowed}.")
        if self.norm == "rmsnorm" and self.bias:
            raise ValueError("Architecture: an RMSNorm has no shift; bias=True (a bias on "
                             "every linear layer and norm, GPT-2's) goes with norm='layernorm'.")

    @property
    def head_dim(self) -> int:
        """D = C / H."""
        return self.n_embd // self.n_head

    @property
    def qkv_width(self) -> int:
        """(H + 2G) D: the qkv projection's outputs, H query heads and G key and value heads."""
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    def check_tp(self, tp: int, who: str) -> None:
        """ValueError unless tp divides H, G and F (Megatron's split, module docstring)."""
        H, G, F = self.n_head, self.n_kv_head, self.ffn_hidden
        if tp >= 1 and not (H % tp or G % tp or F % tp):
            return
        fits = max(d for d in range(1, max(tp, 1) + 1) if not (H % d or G % d or F % d))
        kv = f", n_kv_head={G}" if G != H else ""
        why = (f"; Megatron splits the {G} KV heads over tp and refuses a tp that does not "
               f"divide them, so use tp={fits}") if kv and G % max(tp, 1) else ""
        raise ValueError(f"{who}: tp={tp} must be >= 1 and divide n_head={H}{kv} and the MLP "
                         f"width {F}{why}.")


def of(cfg: GPTConfig | Architecture) -> Architecture:
    """The Architecture of a GPTConfig (its dense shapes: MoE layers are the predictor's own
    business), or the Architecture itself."""
    if isinstance(cfg, Architecture):
        return cfg
    return Architecture(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=cfg.n_head,
                        n_kv_head=cfg.n_head, ffn_hidden=cfg.mlp_ratio * cfg.n_embd,
                        vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                        bias=cfg.bias, tie_weights=cfg.tie_weights, recompute=cfg.recompute)


def _with_biases(a: Architecture, rows) -> Shapes:
    """Each (name, shape, tp dim) weight, followed by its bias when the model has biases:
    split with a column-split weight's outputs, whole after a row-split or unsplit one."""
    out: Shapes = []
    for name, shape, dim in rows:
        out.append((f"{name}.weight", shape, dim))
        if a.bias:
            out.append((f"{name}.bias", shape[-1:], 0 if dim == 1 else None))
    return out


def embedding_shapes(a: Architecture) -> Shapes:
    """wte (V, C), split by vocabulary; wpe (T, C), whole, under learned positions."""
    C = a.n_embd
    return [("wte.weight", (a.vocab_size, C), 0)] + \
        ([("wpe.weight", (a.block_size, C), None)] if a.positions == "learned" else [])


def block_shapes(a: Architecture) -> Shapes:
    """One block's arrays (module docstring), each with the dimension tp splits."""
    C, F = a.n_embd, a.ffn_hidden
    up = 2 * F if a.mlp == "swiglu" else F           # SwiGLU's gate and up side by side
    return _with_biases(a, (("norm_1", (C,), None), ("qkv", (C, a.qkv_width), 1),
                            ("proj", (C, C), 0), ("norm_2", (C,), None),
                            ("fc", (C, up), 1), ("fc2", (F, C), 0)))


def head_shapes(a: Architecture) -> Shapes:
    """norm_f (C,) and, untied, lm_head (C, V) split by vocabulary."""
    out = _with_biases(a, (("norm_f", (a.n_embd,), None),))
    return out + ([] if a.tie_weights else [("lm_head.weight", (a.n_embd, a.vocab_size), 1)])


def parameter_sizes(cfg: GPTConfig | Architecture) -> list[int]:
    """Elements of each parameter array, in order: the embeddings, L blocks, the head (for a
    GPTConfig: model.parameters() order, checked by tests/hardware/test_roofline.py)."""
    a = of(cfg)
    per = lambda shapes: [math.prod(shape) for _, shape, _ in shapes]      # noqa: E731
    return per(embedding_shapes(a)) + per(block_shapes(a)) * a.n_layer + per(head_shapes(a))


def parameter_count(cfg: GPTConfig | Architecture) -> int:
    """N: every parameter of the model, both embedding tables when untied (a tied one once)."""
    return sum(parameter_sizes(cfg))


def local_numel(shape: tuple[int, ...], dim: int | None, tp: int) -> int:
    """Elements one of tp ranks holds: the split dimension cut to ceil(n / tp) (padded)."""
    return math.prod(piece_length(n, tp) if d == dim else n for d, n in enumerate(shape))


__all__ = ["Architecture", "NORMS", "MLPS", "POSITIONS", "of", "embedding_shapes",
           "block_shapes", "head_shapes", "parameter_sizes", "parameter_count", "local_numel"]
