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

How each grain is summed:
    Samples (`step.py`): each micro-batch is one grain of `--grain G` rows (default 1); the
    grains' gradients and losses are added in the aligned tree over their global index. Each
    rank sums the complete subtrees it holds, the ranks all-gather those nodes, and every
    rank evaluates the same tree. The root reaches the engine as rank 0's gradient with
    zeros elsewhere (root + 0 + ... + 0 is the root in any order), so DDP and ZeRO run
    unchanged. A pipeline stage takes what each backward action (B, W) adds to its sample's
    share; the tied wte's two shares are exchanged, and MoE aux terms computed on several
    stages are gathered and added in the model's order.
    Weight tiles (`matmul.py`, `tensor.py`): the tp-shardable matmuls run over fixed tiles
    of W (head_dim columns of qkv, head_dim rows of the projection, F/H for the MLP, one
    vocabulary column for the LM head), so that a tp shard is whole tiles. Every BLAS call
    then has the single process's shape, and the sums over split tiles (Megatron's f and g)
    exchange the nodes of the tree instead of an all-reduce. The vocabulary's exp-sum uses
    the same tree. Under SP the LayerNorm and bias gradients are sums over single tokens in
    the tree, exchanged over tp. The norm is over whole (tp-gathered) gradients.
    Experts (`expert.py`): an expert runs each source grain's tokens in a call of its own,
    on an alias whose gradient is that grain's (kept per micro-batch in flight under pp).
    The grains are added in the tree over the expert's replicas (edp), and their roots
    replace the experts' slices of the dense root.
    Positions (`--token-tiles N`, `context.py`, `attention.py`): the matmuls' rows and dW
    and the embeddings' sums are trees over N leaves, leaf j the run of T/N positions j of
    every row of the micro-batch; LayerNorms, biases and the loss sum single tokens in
    the tree. Attention computes each query run over all-gathered K and V, and adds dK
    and dV over the runs in the tree. Context parallelism needs it: a cp rank holds whole
    runs (N a multiple of 2cp for the zig-zag layout), and exchanges its nodes over cp
    (under SP over tp, then cp).
Covered: dp of any size, ZeRO 0-3, pp (every schedule; MoE blocks too, whose aux terms
the stages gather to add them in the model's order), tp with or without SP, ep (with pp
too), cp (ring or Ulysses layouts, zig-zag or contiguous, with --token-tiles), and their
products, any micro-batch count, with any activation recomputation, float64 and float32.
Mixed precision: its casts are elementwise, so they keep the guarantee where the twins
apply them: the tiled matmuls round their operands and outputs to the format
(matmul.Operands; under fp8 one scale per weight tile and per row of an activation's
K-tile, which no layout cuts), the tree LayerNorm and loss read fp32 copies, and the
gradients travel and add in fp32; fp16's loss scale seeds every backward (pipeline stages
too). bf16, fp16 and fp8 with the rowwise, blockwise or mxfp8 recipe each train one set
of bits under every layout (tests/deterministic/test_precision.py).
Not covered (refused by step.check): cp with MoE (a rank's experts would run on its
positions' tokens only, and their gradients would need the position runs too), and fp8
with a per-tensor scale (recipes delayed, tensorwise: the amax of the rows a rank holds).

Reading order: tree_sum.py (the aligned tree), matmul.py (tiles and token sums),
layers.py (the twins, determinize), tensor.py, context.py, attention.py, expert.py,
layout.py (determinize_layout), step.py (the grain sum over dp and pp). The package
imports none of them, so that baseline.py can use layers.py without the parallel layer.
"""
