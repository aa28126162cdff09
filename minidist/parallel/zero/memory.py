"""ZeRO's memory and communication, as formulas: the paper's, and minidist's exact ones.

The paper counts model-state bytes per rank for Ψ parameters on N_d ranks, trained with
mixed-precision Adam: 2 bytes per fp16 parameter, 2 per fp16 gradient, and K = 12 bytes
of optimizer state per parameter (fp32 master copy, m and v: 4 + 4 + 4):

    baseline (DDP)    (2 + 2 + K) Ψ
    stage 1 (P_os)    2Ψ + 2Ψ + KΨ/N_d
    stage 2 (P_os+g)  2Ψ + (2 + K)Ψ/N_d
    stage 3 (P_os+g+p) (2 + 2 + K)Ψ/N_d
Its worked example (Sec. 1 and Fig. 1): Ψ = 7.5B, N_d = 64, K = 12 gives 120 GB,
31.4 GB, 16.6 GB and 1.9 GB per device (`paper_example`).

minidist trains in one dtype of b bytes (8 for float64, 4 for float32) and keeps no
master copy, so the same formulas hold with 2 -> b and K = 2b for AdamW (m, v), b for
SGD with momentum, 0 for plain SGD (`formula_bytes(..., param_bytes=b, grad_bytes=b,
k=2b)`). Those are the smooth formulas; what a rank really holds is rounded by the
layout of flat.py, and `exact_bytes` says it to the byte: with S = sum_u ceil(N_u / W)
(each unit padded to a multiple of W) and Ψ_pad = W S,
    stage 0  b Ψ      + b Ψ      + K Ψ       (DDP: unpadded arrays and buckets)
    stage 1  b Ψ_pad  + b Ψ_pad  + K S
    stage 2  b Ψ_pad  + b S      + K S
    stage 3  b S      + b S      + K S       (+ gathered units, see parallel/zero/stage3.py)
The tests check that ZeroEngine.memory() equals exact_bytes exactly.

Communication (elements sent per rank per step by the ring algorithms, group.stats):
    stage 0  all_reduce of Ψ: 2 Ψ (W-1)/W           (exact per rank when W | bucket sizes)
    stage 1, 2  reduce_scatter + all_gather: 2 W S (W-1)/W = 2 S (W-1)
    stage 3  2 all-gathers per micro-batch + reduce_scatter: (2M + 1) S (W-1)
    stages 1-3 also all-gather one partial sum of squares for the norm: W - 1 more.
The paper (Sec. 7.2) says 2Ψ for stages 1-2 (same as DDP) and 3Ψ for stage 3.

Reference: Rajbhandari et al. 2020, arXiv:1910.02054, Sec. 3.1 (16Ψ with K = 12),
    Sec. 5 and Fig. 1 (the per-stage formulas and the 7.5B example), Sec. 7.2.
Read next: demos/07_zero.py.
"""

from __future__ import annotations

import math
from typing import Sequence

PAPER_EXAMPLE = {"psi": 7.5e9, "n": 64, "k": 12}       # Fig. 1: 7.5B parameters, 64 ranks
STATE_PER_ELEMENT = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}   # arrays of b bytes


def _check_stage(stage: int) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage={stage!r} must be 0 (DDP), 1, 2 or 3.")


def formula_bytes(stage: int, psi: float, n: int, *, param_bytes: float = 2,
                  grad_bytes: float = 2, k: float = 12) -> dict[str, float]:
    """The paper's model-state bytes per rank: {"params", "grads", "optimizer", "total"}."""
    _check_stage(stage)
    p = psi / n if stage >= 3 else psi
    g = psi / n if stage >= 2 else psi
    o = psi / n if stage >= 1 else psi
    out = {"params": param_bytes * p, "grads": grad_bytes * g, "optimizer": k * o}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def paper_example() -> dict[int, float]:
    """Fig. 1's per-device GB (1 GB = 1e9 B) for stages 0-3: 120, 31.4, 16.6, 1.9."""
    return {s: formula_bytes(s, PAPER_EXAMPLE["psi"], PAPER_EXAMPLE["n"],
                             k=PAPER_EXAMPLE["k"])["total"] / 1e9 for s in range(4)}


def shard_sizes(numels: Sequence[int], W: int) -> list[int]:
    """S_u = ceil(N_u / W) per unit (at least 1), as flat.FlatUnit computes it."""
    return [max(1, math.ceil(n / W)) for n in numels]


def exact_bytes(stage: int, numels: Sequence[int], W: int, itemsize: int,
                state_arrays: int = 2, micro_batches: int = 1) -> dict[str, int]:
    """Bytes one rank holds under minidist's layout: {"params", "grads", "optimizer"},
    plus the high-water marks "peak_unsharded_grads" (stages 2-3) and
    "peak_gathered_params" (stage 3) that ZeroEngine.memory() measures.

    numels: elements per unit in flat.split_units order (root first, then the blocks);
    state_arrays: optimizer arrays per element (STATE_PER_ELEMENT). Peaks: during the
    backward the root's full gradient lives from the head to the embedding, the blocks'
    one at a time (GPT's backward finishes a block before the one below; the tests
    check it); with micro_batches > 1 every unit's full gradient is kept (no_sync).
    """
    _check_stage(stage)
    b, psi = itemsize, sum(numels)
    S = shard_sizes(numels, W)
    full, shard = b * W * sum(S), b * sum(S)
    if stage == 0:
        return {"params": b * psi, "grads": b * psi, "optimizer": state_arrays * b * psi}
    out = {"params": full if stage < 3 else shard, "grads": full if stage < 2 else shard,
           "optimizer": state_arrays * shard}
    blocks = S[1:] or [0]
    if stage == 2:
        out["peak_unsharded_grads"] = full if micro_batches > 1 else b * W * (S[0] + max(blocks))
    if stage == 3:
        pairs = [x + y for x, y in zip(blocks, blocks[1:])] or blocks
        out["peak_gathered_params"] = b * W * (S[0] + max(pairs))
        held = sum(S) if micro_batches > 1 else 0          # the no_sync accumulators
        out["peak_unsharded_grads"] = b * W * (held + S[0] + max(blocks))
    return out


def comm_elements(stage: int, numels: Sequence[int], W: int, micro_batches: int = 1) -> int:
    """Elements one rank sends per step with the ring algorithms (stages 1-3, see above)."""
    _check_stage(stage)
    if stage == 0:
        raise ValueError("comm_elements: stage 0 is DDP, whose per-rank count depends on its "
                         "buckets; use 2 * psi * (W - 1) / W (formula) for it.")
    S = sum(shard_sizes(numels, W))
    passes = 2 if stage < 3 else 2 * micro_batches + 1
    return (W - 1) * (passes * S + 1)
