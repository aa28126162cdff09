"""ZeRO (Rajbhandari et al. 2020): data parallelism that shards the optimizer state
(stage 1), the gradients (stage 2) and the parameters (stage 3) over the dp ranks.

    flat.py     units of parameters as padded flat vectors, cut into W equal shards
    engine.py   ZeroEngine: stages 1-3 over those shards (reduce-scatter, step, all-gather)
    stage3.py   stage 3's forward and backward: a unit gathered just before the call that
                reads it, freed after, its gradient reduce-scattered in the backward
    memory.py   the bytes each stage keeps and sends, the paper's formulas and the exact ones
compose.gradient_sync builds a ZeroEngine for Plan(zero=1, 2 or 3).
Read next: flat.py, then engine.py.
"""
