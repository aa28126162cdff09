"""Deterministic mode under context parallelism: every sum over positions is cut into the
same runs of positions as in the single process, and exchanged over cp.

Context parallelism (parallel/context/) gives cp rank r the positions P_r of every
sequence, for the whole model. Everything position-wise is then computed as the single
process computes it, but every SUM over positions is a partial sum on each rank: the
weight gradients (x^T g over tokens), the LayerNorm and bias gradients, the embeddings'
gradients, the loss, and, inside attention, dK and dV (sums over queries). The plain mode
adds the partial sums in the gradient sync over dp x cp; here, with --token-tiles N, the
sequence is cut into N runs of T / N positions (each cp rank must hold whole runs: N a
multiple of 2 cp for the zig-zag layout, of cp for the contiguous one), and:
    - the tiled matmuls multiply one run of every row of the micro-batch per BLAS call and
      sum dW over the runs in the aligned tree over their global index (matmul.TiledMatMul,
      rows: a rank holds one node per block of aligned runs, whatever the rows);
    - attention computes each query run over the whole sequence's K and V
      (deterministic/attention.py), dK and dV summed over the runs in the same tree;
    - the embeddings add each run into a table of its own, summed in the tree; LayerNorm,
      biases and the loss sum over single tokens in the tree (matmul.Tokens);
and each of these sums exchanges its nodes over cp, so every cp rank ends the backward of
a grain with the grain's whole gradient, bitwise the single process's (which runs the same
code over all N runs, with no exchange). The grain sum of deterministic/step.py then
runs over dp as usual, and the root is handed to the engine by rank 0 of dp x cp.

One rank's view (cp rank r, runs R_r of my positions): forward as the single process on
my runs (attention: all_gather of k, v); backward: each sum over positions -> the nodes of
my runs -> all_gather over cp -> combine: the whole sum.
Communication: per layer and grain, the nodes of every weight's gradient (at most
~2 log2(N) copies per rank, all-gathered over cp) and of dK, dV: much more than the plain
mode's one reduction per step; the reference pays it for exactness.
Under SP too: a SequenceParallelLayerNorm's, a row-parallel bias's and the position
embedding's sums run over this tp rank's slice of my positions and exchange over tp, then
over cp (deterministic/tensor.py).
Not covered: cp with MoE (refused by step.check).
Read next: deterministic/attention.py.
"""

from __future__ import annotations

import functools

from minidist import collectives as C
from minidist.deterministic.matmul import Tokens
from minidist.parallel.context.context_parallel import sequence_positions


def context_tokens(context, token_tiles: int | None) -> tuple[Tokens, Tokens]:
    """(tokens, rows) on this cp rank's positions, exchanged over the cp group: single-token
    leaves for LayerNorms and biases, runs of T / token_tiles positions for the rest."""
    if token_tiles is None:
        raise ValueError("--deterministic with context parallelism needs --token-tiles N "
                         "(runs of T / N positions that every cp rank holds whole: N a "
                         f"multiple of {2 * context.group.size} for the zig-zag layout).")
    positions = functools.partial(sequence_positions, context=context)
    exchange = functools.partial(C.all_gather, group=context.group, algo="ring")
    return Tokens(positions, exchange), Tokens(positions, exchange, token_tiles)
