"""Expert parallelism: the E experts of every MoE layer split over the ep ranks, each token
sent to its experts' rank and back by two all-to-alls.

    expert_parallel.py   AllToAll, ExpertParallelMoE (dispatch, the local experts, combine)
                         and apply_experts(model, ep group)
The MoE layer itself (routing, capacity, the auxiliary losses) is nn/moe.py's;
compose.parallelize calls apply_experts after tp and cp. Expert gradients sum over their
replicas (edp x cp), the dense ones over dp x cp (compose.gradient_sync).
Read next: nn/moe.py, then expert_parallel.py.
"""
