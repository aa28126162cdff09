"""Deterministic mode: every layout adds the same numbers in the same order, so the trained
parameters and losses are bitwise those of one process.

Floating-point addition is not associative, and a BLAS result depends on the shape of the
call: how a layout groups its samples (dp ranks, micro-batches) and cuts its matmuls (tp
shards, cp positions) shows in the last bits. The mode removes both, from outside the
model's code:
    1. the same operations on the same shapes: `determinize(model)` (layers.py; on a rank
       of a layout, layout.determinize_layout) replaces every layer whose bits depend on a
       shape or a grouping by its twin, which holds the same parameters and adds in fixed
       trees (layers.py, tensor.py, attention.py, expert.py);
    2. one fixed order for every sum across ranks: each grain (a sample, or `grain` rows)
       is computed on its own and the grains are added in the aligned tree over their
       global index (tree_sum.py), whoever holds them (step.py), as
       baseline.train_single_process(deterministic=True) does.
autograd/, nn/, optim/ and parallel/ contain nothing of the mode.

Tensor parallelism (tensor.py): the single process and every layout compute the
tp-shardable matmuls over the same fixed tiles (matmul.py), and a tp rank's partial sums
over split tiles are exchanged and added in the same tree; the LayerNorm and bias
gradients are sums over tokens in a fixed tree, exchanged over tp when sequence
parallelism cuts them; the norm is over whole (tp-gathered) gradients.
Expert parallelism (expert.py): an expert runs each source grain's tokens in a call of
its own, on an alias whose gradient is that grain's; the experts' grains are added in the
same tree over their replicas (edp), and their roots replace the experts' slices of the
dense root.
Context parallelism (context.py, with token_tiles): every sum over positions is a tree
over fixed runs of positions, exchanged over cp, and attention runs over all-gathered K
and V with the queries in runs (attention.py).
Covered: dp of any size, ZeRO 0-3, pp (every schedule; MoE blocks too, whose aux terms
the stages gather to add them in the model's order), tp with or without SP, ep (with pp
too), cp (ring or Ulysses layouts, zig-zag or contiguous, with --token-tiles), and their
products, any micro-batch count, with any activation recomputation, float64 and float32.
Not covered (refused by step.check): cp with MoE (a rank's experts would run on its
positions' tokens only, and their gradients would need the position runs too), and mixed
precision (the twins add in the model's dtype).

Reading order: tree_sum.py (the aligned tree), matmul.py (tiles and token sums),
layers.py (the twins, determinize), tensor.py, context.py, attention.py, expert.py,
layout.py (determinize_layout), step.py (the grain sum over dp and pp). The package
imports none of them, so that baseline.py can use layers.py without the parallel layer.
"""
