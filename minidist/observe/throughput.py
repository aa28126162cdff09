"""Throughput: tokens per second, and how much of the machine's peak a step turns into work.

Tokens/s compares two runs of one model; across models and machines the fraction of the
peak matters. Model FLOPs utilisation (MFU, Chowdhery et al. 2022) divides the FLOPs the
MODEL needs per second by the peak the hardware could do:

    MFU = model FLOPs per step / (step seconds x peak FLOP/s per rank x ranks)
    HFU = the same with hardware FLOPs: everything executed, recomputation included
Model FLOPs follow ONE convention everywhere minidist prints an MFU (the main job's
progress line, `bench throughput`, `report`, demo 24), PaLM's (App. B), per token:

    6N + 12LHQT      `model_flops_per_token(cfg)`; `mfu()` divides by the peak
    N   every parameter of the model: the embeddings included, a tied input/output
        embedding counted once (PaLM's N = 540.35B counts its shared embedding; with
        PaLM 540B's published figures only this N gives its 46.2 %)
    L layers, H heads, Q head dim, T sequence length
    6N: every weight is used in one multiply-add per token forward (2 FLOPs) and two
        backward (dx and dW: 4 FLOPs); 12LHQT: per layer, q k^T and A v are each 2QT
        FLOPs per head and token forward, 3x that with their backward, over the FULL T x T
        square (our causal attention computes all of it, then masks).
Hardware FLOPs are the ledger's (observe/flops.py).

A run that recomputes activations does more work for the same model, so its HFU rises
while its MFU does not: MFU is the number to compare, HFU says how busy the machine was.

What this GPT executes differs from the formula, so the FLOP ledger's matmul FLOPs of one
training step of B sequences are checked against a closed form written with N', the
NON-embedding parameters (all but wte and wpe), which it equals EXACTLY:

    B T (6N' + 12LHQT - 6 N_vec + 6 V C [tied head])
    N_vec:  biases and LayerNorm gains and shifts are in N' but run no matmul (they cost
            elementwise FLOPs, counted as "other", not as model FLOPs);
    6VC:    the LM head (B T, C) @ (C, V), forward and backward: a matmul on the tied token
            embedding, which N' leaves out. Untied, the head's weight is in N' already
            and the term is 0.
The embedding lookups are gathers (0 FLOPs); their backward is an add.at ("other").
`closed_form(cfg, T)` returns each term; tests/observe/test_throughput.py checks the
equality, and demos/24_throughput.py prints it.

One rank's view of a measured step:
    1. count one step with the ledger (its FLOPs do not change from step to step);
    2. time the other steps with the ledger off (the hooks are then not even called);
    3. throughput(model FLOPs, hardware FLOPs, median step seconds, tokens, peak, ranks),
       FLOPs summed over ranks, peak from observe/peak.py (one BLAS thread per rank).
No communication here; the caller sums the ranks' ledgers.

Reference: Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
    arXiv:2204.02311, App. B (MFU, 6N + 12LHQT, HFU); Korthikanti et al. 2022,
    arXiv:2205.05198 (model vs hardware FLOPs utilisation under recomputation).
Read next: observe/flops.py, observe/peak.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.nn import GPTConfig


@dataclass(frozen=True)
class ClosedForm:
    """The terms of the ledger's closed form, 6N' + 12LHQT - 6 N_vec + 6 head, for one
    dense GPT at sequence length T (FLOPs per token)."""

    N: int              # N': non-embedding parameters (all but wte and wpe)
    n_vector: int       # of those, biases and LayerNorm gains and shifts (no matmul)
    head: int           # V * C when the LM head is the tied wte (a matmul not in N'), else 0
    L: int
    H: int
    Q: int
    T: int

    @property
    def palm(self) -> int:
        """6N' + 12LHQT, N' the non-embedding parameters: the ledger's check, not MFU's
        model FLOPs (those count every parameter: model_flops_per_token)."""
        return palm_flops_per_token(self.N, self.L, self.H, self.Q, self.T)

    @property
    def matmul(self) -> int:
        """The matmul FLOPs per token this GPT executes: 6N' + 12LHQT - 6 N_vec + 6 head."""
        return self.palm - 6 * self.n_vector + 6 * self.head

    def terms(self) -> list[tuple[str, int]]:
        """(label, FLOPs per token) for each term, ending with the exact matmul total."""
        L, H, Q, T = self.L, self.H, self.Q, self.T
        return [(f"6N', N' = {self.N:,} non-embedding params", 6 * self.N),
                (f"12LHQT, L={L} H={H} Q={Q} T={T}", 12 * L * H * Q * T),
                (f"- 6 x {self.n_vector:,} biases and LayerNorm params", -6 * self.n_vector),
                (f"+ 6 x {self.head:,} tied LM head (V x C)", 6 * self.head),
                ("= the matmul FLOPs this GPT executes", self.matmul)]


def closed_form(cfg: GPTConfig, T: int | None = None) -> ClosedForm:
    """The closed form of a dense GPTConfig at sequence length T (default block_size).

    Parameters, per layer: W_qkv 3C^2, W_proj C^2, W_fc and W_fc2 r C^2 each (r =
    mlp_ratio); vectors: two LayerNorm gains (2C) and, with bias, two LayerNorm shifts
    (2C) and the biases 3C + C + rC + C; then ln_f (C, and C with bias) and an untied
    head V C.
    """
    T = cfg.block_size if T is None else T
    if cfg.moe_every:
        raise ValueError(f"closed_form: moe_every={cfg.moe_every}; 6N + 12LHQT is for a "
                         "dense GPT (a MoE layer runs top_k of its experts per token). Use "
                         "the FLOP ledger for MoE models, or set moe_every=0.")
    if not 1 <= T <= cfg.block_size:
        raise ValueError(f"closed_form: T={T} must be between 1 and block_size="
                         f"{cfg.block_size} (the sequence length of the batch).")
    C, r, L, b = cfg.n_embd, cfg.mlp_ratio, cfg.n_layer, int(cfg.bias)
    vectors = L * (2 * C + b * (2 * C + 5 * C + r * C)) + C + b * C
    matrices = L * (4 + 2 * r) * C * C + (0 if cfg.tie_weights else cfg.vocab_size * C)
    return ClosedForm(N=matrices + vectors, n_vector=vectors,
                      head=cfg.vocab_size * C if cfg.tie_weights else 0,
                      L=L, H=cfg.n_head, Q=C // cfg.n_head, T=T)


def model_flops_per_token(cfg: GPTConfig, T: int | None = None) -> int:
    """The model FLOPs per token behind every MFU minidist prints (the main job's progress
    line, `bench throughput`, `report`, demo 24): PaLM's convention (Chowdhery et al.
    2022, App. B),

        6N + 12LHQT,  N = every parameter of the model (GPT.num_parameters()): the
                      embeddings included, a tied input/output embedding once (PaLM's
                      N = 540.35B counts its shared embedding, and only that N gives its
                      published 46.2 % MFU); L layers, H heads of Q dims, T the sequence
                      length (default block_size)

    It is the work the model needs, not what this GPT happens to execute: the FLOP ledger's
    exact matmul count (`closed_form(cfg).matmul`) leaves out the embedding lookups (gathers)
    and the elementwise vectors, and counts the tied head's matmul; the ledger's hardware
    FLOPs (everything executed) are HFU's numerator. A dense model only (ValueError for
    MoE, as closed_form)."""
    cf = closed_form(cfg, T)
    embeddings = (cfg.vocab_size + cfg.block_size) * cfg.n_embd      # wte (tied: once), wpe
    return palm_flops_per_token(cf.N + embeddings, cf.L, cf.H, cf.Q, cf.T)


def palm_flops_per_token(N: int, L: int, H: int, Q: int, T: int) -> int:
    """6N + 12LHQT: N parameters, L layers, H heads of Q dims, sequence length T."""
    return 6 * N + 12 * L * H * Q * T


def mfu(model_flops: float, seconds: float, peak: float, ranks: int = 1) -> float:
    """Model FLOPs utilisation: model_flops done in `seconds` on `ranks` ranks of peak
    FLOP/s `peak` each: model_flops / (seconds x peak x ranks). Every MFU minidist prints
    is this with model_flops = tokens x model_flops_per_token(cfg) (HFU: the ledger's
    hardware FLOPs)."""
    return model_flops / (seconds * peak * ranks)


@dataclass(frozen=True)
class Throughput:
    """One step's throughput: FLOPs summed over `ranks`, peak FLOP/s of one rank."""

    tokens: int
    seconds: float
    ranks: int
    peak: float
    model_flops: int
    hardware_flops: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mfu(self) -> float:
        """model FLOPs / (seconds x peak x ranks)."""
        return mfu(self.model_flops, self.seconds, self.peak, self.ranks)

    @property
    def hfu(self) -> float:
        """hardware FLOPs / (seconds x peak x ranks)."""
        return mfu(self.hardware_flops, self.seconds, self.peak, self.ranks)


def throughput(model_flops: int, hardware_flops: int, seconds: float, tokens: int,
               peak: float, ranks: int = 1) -> Throughput:
    """Tokens/s, MFU and HFU of a step of `seconds` that processed `tokens` on `ranks`
    ranks, each of peak FLOP/s `peak`; FLOPs are the step's, summed over the ranks."""
    if not seconds > 0 or not peak > 0 or ranks < 1 or tokens < 0:
        raise ValueError(f"throughput: seconds={seconds} and peak={peak} must be > 0, "
                         f"ranks={ranks} >= 1 and tokens={tokens} >= 0.")
    if model_flops < 0 or hardware_flops < 0:
        raise ValueError(f"throughput: model FLOPs {model_flops:,} and hardware FLOPs "
                         f"{hardware_flops:,} must be >= 0.")
    return Throughput(tokens, float(seconds), ranks, float(peak), int(model_flops),
                      int(hardware_flops))


def from_ledger(ledger, cfg: GPTConfig, seconds: float, tokens: int, peak: float,
                ranks: int = 1) -> Throughput:
    """throughput() of one step of `tokens` tokens of GPTConfig cfg (at its block_size):
    model FLOPs by the one convention (model_flops_per_token), hardware FLOPs from the
    step's FlopLedger (observe/flops.py)."""
    return throughput(tokens * model_flops_per_token(cfg), ledger.hardware_flops(), seconds,
                      tokens, peak, ranks)
