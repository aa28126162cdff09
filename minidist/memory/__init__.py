"""Memory: activation recomputation, mixed precision, offloading and the memory budget.

Reading order: ledger.py (every device array a rank holds, by category), recompute.py
(activation recomputation, full and selective), precision.py (bf16 / fp16 / fp8: what is
rounded where), loss_scale.py (fp16's dynamic loss scaling), fp8.py (E4M3 / E5M2 with
delayed scaling), master_weights.py (fp32 master weights around any engine), offload.py
(optimizer state and parameters to host memory or disk), budget_models.py and budget.py
(the per-rank estimate, checked against measured bytes).
Each module is imported where it is used; this package imports none of them.
"""
