"""GPT: token and position embeddings, n_layer pre-LN transformer blocks, LM head.

    h_0 = wte[idx] + wpe[0..T-1]                         (B, T, C)
    h_l = h_{l-1} + Attn(LN(h_{l-1}));  h_l = h_l + MLP(LN(h_l))   for l = 1..n_layer
    logits = LN_f(h_L) @ W_head                          (B, T, V)
With `tie_weights` the head is the transposed token embedding, W_head = wte^T (C, V).
Every `moe_every`-th block (blocks moe_every-1, 2*moe_every-1, ...) swaps its MLP for a
mixture of experts (nn/moe.py), routing groups of moe_group_size tokens (0: one sequence,
block_size) by the rule of `router`, route_groups, route_limit and bias_rate
(nn/routing.py), with shared_experts always-on experts and routed experts of width
expert_hidden; its weighted load-balancing and router z-losses are added to the LM loss.

Loss (the quantity every parallel layout must reproduce):
    loss = sum_{(b,t): y != -100} CE(logits[b, t], y[b, t]) / n_tokens
           + aux_weight * sum_{MoE layers} (aux_loss_coef * aux + z_loss_coef * z)
with aux, z the means over the layer's routing groups (nn/moe.py). n_tokens defaults to
this batch's count of non-ignored targets (a plain mean). Gradient accumulation and every
parallel layout pass the GLOBAL count, so that the micro-batch losses add up to the
global-batch loss, and aux_weight = (tokens here) / (tokens in the global batch), so that
the auxiliary terms add up to their mean over all the global batch's routing groups.

Activation recomputation (memory/recompute.py): recompute="full" keeps only each block's
input and runs the block again in the backward; "selective" recomputes only the attention
core. Either gives bitwise the gradients of "none": it changes memory and time, no number.

Initialisation (GPT-2): weights N(0, 0.02^2); the two projections that write into the
residual stream (attn.proj, mlp.proj and the experts' proj) N(0, (0.02/sqrt(2 n_layer))^2).
Each parameter is drawn from (seed, its name) by seed.init_parameters.

Shapes: idx, targets (B, T) int with T <= block_size; logits (B, T, V); loss scalar.
References: Radford et al. 2019 (GPT-2), Sec. 2.3 (pre-LN, residual init); Vaswani et al.
    2017, arXiv:1706.03762; Karpathy's nanoGPT (the layout followed here).
Read next: baseline.py (training it), then parallel/.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from minidist import backend
from minidist import seed as seeding
from minidist.autograd import Tensor, no_grad
from minidist.autograd import functional as F
from minidist.memory import recompute as recomputation
from minidist.nn.attention import CausalSelfAttention
from minidist.nn.layers import STD, MLP, DropoutKey, Dropout, Embedding, LayerNorm, Linear
from minidist.nn.layers import name_dropouts
from minidist.nn.module import Module, ModuleList
from minidist.nn.moe import MoE
from minidist.nn.routing import RoutingRule


@dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters; validated on construction."""

    vocab_size: int = 11
    block_size: int = 12
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    moe_every: int = 0
    n_experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    moe_group_size: int = 0                    # tokens per routing group; 0: block_size
    router: str = "softmax"                    # "softmax", "sigmoid", "expert-choice"
    route_groups: int = 1                      # experts in groups (group-limited routing)
    route_limit: int = 0                       # a token's experts in <= this many groups
    bias_rate: float = 0.0                     # gamma of aux-loss-free balancing (0: off)
    shared_experts: int = 0                    # always-on experts beside the routed ones
    expert_hidden: int = 0                     # an expert's width; 0: mlp_ratio * n_embd
    dtype: str = "float64"
    # an execution choice, like the Plan: it changes no number, so repr (what a checkpoint
    # must agree on to be resumed, reliability/recovery.py) leaves it out
    recompute: str = dataclasses.field(default="none", repr=False)    # "none", "selective", "full"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig: {field}={getattr(self, field)} must be >= 1.")
        if self.n_embd % self.n_head:
            heads = max(h for h in range(1, self.n_head) if self.n_embd % h == 0)
            wider = -(-self.n_embd // self.n_head) * self.n_head
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head="
                             f"{self.n_head}; use n_head={heads} (a divisor of n_embd) or "
                             f"n_embd={wider} (a multiple of n_head).")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1).")
        if self.moe_every < 0:
            raise ValueError(f"GPTConfig: moe_every={self.moe_every} must be >= 0 (0 = no MoE).")
        if self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} must be between 1 and n_experts="
                             f"{self.n_experts}; lower top_k or add experts.")
        if not self.capacity_factor >= 0 or self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError(f"GPTConfig: capacity_factor={self.capacity_factor} must be >= 0 "
                             f"(0: dropless), "
                             f"aux_loss_coef={self.aux_loss_coef} and z_loss_coef="
                             f"{self.z_loss_coef} >= 0.")
        if self.shared_experts < 0 or self.expert_hidden < 0:
            raise ValueError(f"GPTConfig: shared_experts={self.shared_experts} and "
                             f"expert_hidden={self.expert_hidden} must be >= 0.")
        try:
            self.routing_rule.check(self.n_experts, self.top_k, self.capacity_factor)
        except ValueError as e:
            raise ValueError(f"GPTConfig: {e}") from None
        if self.moe_group_size < 0:
            raise ValueError(f"GPTConfig: moe_group_size={self.moe_group_size} must be >= 0 "
                             "(tokens per routing group; 0 = one sequence of block_size).")
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"GPTConfig: dtype={self.dtype!r} must be 'float64' or 'float32'.")
        recomputation.check_mode(self.recompute, "GPTConfig")

    @property
    def routing_rule(self) -> RoutingRule:
        """How the MoE blocks route (nn/routing.py)."""
        return RoutingRule(self.router, self.route_groups, self.route_limit, self.bias_rate)

    @property
    def routing_group(self) -> int:
        """Tokens per MoE routing group: moe_group_size, or block_size when 0."""
        return self.moe_group_size or self.block_size

    def is_moe(self, layer: int) -> bool:
        """True if block `layer` (0-based) uses a mixture of experts instead of an MLP."""
        return self.moe_every > 0 and layer % self.moe_every == self.moe_every - 1


class Block(Module):
    """x + Attn(LN(x)), then + MLP(LN(x)) (or MoE). forward returns (x, aux or None).

    recompute="full": forward checkpoints `layers` (memory/recompute.py), keeping only x;
    "selective": the attention rebuilds its weights in the backward (nn/attention.py).
    """

    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        C, dt = cfg.n_embd, cfg.dtype
        proj_std = STD / math.sqrt(2 * cfg.n_layer)
        self.ln_1 = LayerNorm(C, cfg.bias, dt)
        self.attn = CausalSelfAttention(C, cfg.n_head, cfg.bias, cfg.dropout, dt, proj_std,
                                        selective=cfg.recompute == "selective")
        self.ln_2 = LayerNorm(C, cfg.bias, dt)
        hidden = cfg.mlp_ratio * C
        if cfg.is_moe(layer):
            self.moe = MoE(C, cfg.expert_hidden or hidden, cfg.n_experts, cfg.top_k,
                           cfg.capacity_factor, cfg.bias, dt, proj_std,
                           group_size=cfg.routing_group, aux_loss_coef=cfg.aux_loss_coef,
                           z_loss_coef=cfg.z_loss_coef, rule=cfg.routing_rule,
                           shared_experts=cfg.shared_experts)
        else:
            self.mlp = MLP(C, hidden, cfg.bias, cfg.dropout, dt, proj_std)
        self.recompute = cfg.recompute

    def forward(self, x: Tensor, key: DropoutKey | None = None) -> tuple[Tensor, Tensor | None]:
        if self.recompute == "full":
            return recomputation.checkpoint(self.layers, x, key)
        return self.layers(x, key)

    def layers(self, x: Tensor, key: DropoutKey | None = None) -> tuple[Tensor, Tensor | None]:
        """The block's computation (what full recomputation runs twice)."""
        x = x + self.attn(self.ln_1(x), key)                    # (B, T, C)
        if hasattr(self, "moe"):
            y, aux = self.moe(self.ln_2(x))
            return x + y, aux
        return x + self.mlp(self.ln_2(x), key), None


class GPTLayout:
    """Where the GPT's activations live: the single-process layout (everything whole).

    The GPT asks its layout the four questions that change when the model is split over
    ranks; parallel/tensor/'s TensorParallelLayout answers them for tensor (and sequence)
    parallelism, and later axes (context parallelism) answer them again:
        positions(T)        the global positions of this rank's embedded tokens, for an
                            input of T tokens                            arange(T) here
        sequence_shards(n)  for dropout: where an activation of n positions on this rank
                            sits, {1: (first position or positions, T)}  {} here
        logits(x, w)        the LM head: x (B, T, C) @ w (C, V)          -> (B, T, V)
        loss_sum(z, y)      sum over counted tokens of CE(z, y)          -> scalar
    """

    def positions(self, T: int):
        return backend.xp.arange(T)

    def sequence_shards(self, rows: int) -> dict:
        return {}

    def logits(self, x: Tensor, w: Tensor) -> Tensor:
        return x @ w                                             # (B, T, C) @ (C, V)

    def loss_sum(self, logits: Tensor, targets) -> Tensor:
        return F.cross_entropy(logits, backend.xp.asarray(targets), reduction="sum")


class GPT(Module):
    """The language model. `GPT(cfg, seed)` builds it and draws every parameter from `seed`.

    forward = embed -> blocks -> head -> loss, each a method of its own, so that a layout
    can wrap them (ZeRO-3 gathers the root unit's parameters around `embed` and `head`).
    """

    def __init__(self, cfg: GPTConfig, seed: int | None = 0) -> None:
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd, cfg.dtype)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd, cfg.dtype)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList([Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, cfg.bias, cfg.dtype)
        if not cfg.tie_weights:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        self.layout = GPTLayout()               # not a Module: holds no parameters
        name_dropouts(self)
        for d in self.activation_dropouts():
            d.sequence = self.sequence_shards
        if seed is not None:
            seeding.init_parameters(self, seed)

    def forward(self, idx, targets=None, *, n_tokens: int | None = None,
                aux_weight: float = 1.0, dropout_key: DropoutKey | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """Return (logits (B, T, V), loss or None); the loss formula is in the module doc."""
        x = self.embed(idx, dropout_key)                         # (B, T, C)
        aux_terms = []
        for block in self.blocks:
            x, aux = block(x, dropout_key)                       # (B, T, C)
            if aux is not None:
                aux_terms.append(aux)
        logits = self.head(x)                                    # (B, T, V)
        if targets is None:
            return logits, None
        return logits, self.loss(logits, targets, n_tokens, aux_terms, aux_weight)

    def embed(self, idx, dropout_key: DropoutKey | None = None) -> Tensor:
        """h_0 = drop(wte[idx] + wpe[positions]): idx (B, T) int -> (B, T, C)."""
        idx = np.asarray(idx)
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"GPT: sequence length T={T} exceeds block_size="
                             f"{self.cfg.block_size}; crop the input or raise block_size.")
        x = self.wte(backend.xp.asarray(idx)) + self.wpe(self.layout.positions(T))
        return self.drop(x, dropout_key)

    def sequence_shards(self, rows: int) -> dict:
        """Where an activation of `rows` positions on this rank sits in the sequence (the
        layout decides; the dropouts of the residual stream ask)."""
        return self.layout.sequence_shards(rows)

    def activation_dropouts(self) -> list[Dropout]:
        """The dropouts on the residual stream (B, T, C): embedding, attention, MLP."""
        out = [self.drop]
        for b in self.blocks:
            out.append(b.attn.resid_drop)
            if hasattr(b, "mlp"):
                out.append(b.mlp.drop)
        return out

    def head(self, x: Tensor) -> Tensor:
        """logits = LN_f(x) @ W_head, W_head = wte^T when tied: (B, T, C) -> (B, T, V)."""
        w = self.wte.weight.transpose() if self.cfg.tie_weights else self.lm_head.weight
        return self.layout.logits(self.ln_f(x), w)

    def loss(self, logits: Tensor, targets, n_tokens: int | None, aux_terms=(),
             aux_weight: float = 1.0) -> Tensor:
        """sum of CE over counted targets / n_tokens + aux_weight * sum(aux) (each aux term
        already weighted by its coefficients, nn/moe.py)."""
        targets = np.asarray(targets)
        count = int((targets != -100).sum()) if n_tokens is None else int(n_tokens)
        if count < 1:
            raise ValueError(f"GPT: loss over {count} target tokens; every target is -100 "
                             "(ignored) or n_tokens < 1. Pass targets with answer tokens.")
        loss = self.layout.loss_sum(logits, targets) * (1.0 / count)
        for aux in aux_terms:
            loss = loss + aux * aux_weight
        return loss

    def generate(self, idx, max_new_tokens: int, temperature: float = 0.0,
                 rng: np.random.Generator | None = None) -> np.ndarray:
        """Append `max_new_tokens` tokens to idx (B, T0); greedy when temperature == 0."""
        out = np.array(idx, dtype=np.int64)
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                logits, _ = self(out[:, -self.cfg.block_size:])
                last = backend.to_numpy(logits.data[:, -1, :]).astype(np.float64)   # (B, V)
                if temperature == 0.0:
                    nxt = last.argmax(axis=-1)
                else:
                    p = np.exp((last - last.max(-1, keepdims=True)) / temperature)
                    p /= p.sum(-1, keepdims=True)
                    gen = rng if rng is not None else np.random.default_rng(0)
                    nxt = np.array([gen.choice(p.shape[1], p=row) for row in p])
                out = np.concatenate([out, nxt[:, None]], axis=1)
        self.train(was_training)
        return out
