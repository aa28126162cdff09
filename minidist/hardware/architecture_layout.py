"""An Architecture (hardware/architecture.py) on a layout: the rules it must meet, and the
elements each rank holds.

    validate       Plan.validate for a GPTConfig; for an Architecture its tp rule
                   (Architecture.check_tp: Megatron's split of heads, KV heads and F), then
                   Plan.validate on a GPT of the same L, H, C, V and T, since the layout's
                   other rules (the batch split, sequence parallelism, the pipeline's stages
                   and schedule) read only those
    unit_numels    one rank's elements per ZeRO unit of its pipeline stage (the root: the
                   embeddings on the first stage, the head on the last; then one unit per
                   block), its tp shard of each array (architecture.local_numel)
Kept apart from architecture.py because a layout brings in the parallel package (and so the
runtime), which the roofline and the GPU check must not import.
Read next: hardware/architecture_memory.py.
"""

from __future__ import annotations

from minidist.hardware.architecture import (Architecture, block_shapes, embedding_shapes,
                                            head_shapes, local_numel)
from minidist.memory.budget_models import stage_layers
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan


def validate(cfg: GPTConfig | Architecture, plan: Plan, global_batch: int,
             seq_len: int) -> None:
    """ValueError, one line, if the layout cannot run the model: Plan.validate for a
    GPTConfig; for an Architecture its tp rule (`check_tp`), then Plan.validate on the GPT of
    the same L, H, C, V and T, since the rest of the layout's rules (the batch split,
    sequence parallelism, the pipeline's stages and schedule) read only those."""
    if isinstance(cfg, GPTConfig):
        return plan.validate(cfg, global_batch, seq_len)
    cfg.check_tp(plan.tp, "Plan")
    stand_in = GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                         mlp_ratio=1, dtype="float32", recompute=cfg.recompute)
    plan.validate(stand_in, global_batch, seq_len)


def unit_numels(a: Architecture, tp: int = 1, pp: int = 1, stage: int = 0) -> list[int]:
    """Elements per ZeRO unit of one rank's shard of pipeline stage `stage`: [root, my
    blocks...], the root the embeddings (first stage) and the head (last stage; a tied wte
    there too when pp > 1, as budget_models.unit_numels places it); no root on a middle
    stage."""
    first, last = stage == 0, stage == pp - 1
    root = (embedding_shapes(a) if first else []) + (head_shapes(a) if last else [])
    if last and not first and a.tie_weights:
        root += embedding_shapes(a)[:1]
    size = lambda shapes: sum(local_numel(s, d, tp) for _, s, d in shapes)  # noqa: E731
    blocks = [size(block_shapes(a))] * len(stage_layers(a, pp, stage))     # reads n_layer
    return ([size(root)] if root else []) + blocks
