"""Expert parallelism: the E experts of every MoE layer split over the ep ranks, each token
sent to its experts' rank and back by two all-to-alls.

The MoE layer itself is nn/moe.py's: each token goes to its top-K of E expert MLPs, and
which tokens an expert accepts (its capacity) is decided inside routing groups of G
consecutive tokens, fixed by the model and not by the layout, so the same tokens are
dropped whatever dp, tp, cp, pp, ep, the ZeRO stage or the micro-batch count
(tests/parallel/expert/test_moe_layouts.py); a layout that would cut a group is refused
before any process starts (compose.Plan.validate).

ep divides dp (Megatron's layout: the ep ranks are data-parallel ranks, ep the faster part
of the dp axis). Each ep rank holds E/ep experts of every MoE layer and routes its own
tokens; a first all-to-all exchanges the per-expert counts, a second one with uneven
splits carries each kept token to its expert's rank, and the reverse all-to-all brings the
results back for the gate-weighted sum. Both all-to-alls are autograd Functions whose
backward is the transposed all-to-all. Dense gradients are summed over dp (x cp), an
expert's over its replicas only (dp/ep x cp); tp replicates the MoE blocks (each tp rank
routes the same tokens; sequence parallelism of MoE blocks is refused), cp and pp just run
it, ZeRO 1-3 shard the experts' units over their replicas. The bytes of the all-to-alls
per micro-batch and layer, 2 (S + R) C numbers (S kept tokens sent to other ranks, R
received from them) plus the counts, equal the bytes measured
(ExpertParallelMoE.take_traffic).

    expert_parallel.py   AllToAll, ExpertParallelMoE (dispatch, the local experts: the plain
                         loop, or one grouped node, nn/grouped_experts.py; combine) and
                         apply_experts(model, ep group)
    balancing.py         aux-loss-free balancing under any layout: the routing bias moved
                         from the global batch's load (summed over dp x cp, and DualPipe's
                         mirror pair), the table of every layer's bias shared over pp
    expert_tensor.py     expert tensor parallelism (MoE parallel folding): dp = edp x ep x
                         etp, each expert's MLP split over etp, the received rows gathered
                         and the partial outputs reduce-scattered over etp
compose.parallelize calls apply_experts (or apply_expert_tensor) after tp and cp;
compose.gradient_sync sums the experts' gradients over their own group; train.py runs the
bias update after each step.
Read next: nn/routing.py and nn/moe.py, then expert_parallel.py, balancing.py,
expert_tensor.py.
"""
