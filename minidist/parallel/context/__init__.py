"""Context parallelism: every layer on a slice of the sequence; only attention crosses slices.

With cp > 1 every activation of the model is split along the sequence: cp rank r holds its
positions of every row. Everything but attention works position by position and just runs
on them (the position embedding, dropout masks and the loss use the true global positions
and the global token count); the parameters' gradients are partial sums over the cp ranks'
tokens, so the gradient sync runs over dp x cp. Attention crosses the slices by one of two
algorithms (Plan.cp_algo, `--cp-algo`):

                ring (ring_attention.py)                Ulysses (ulysses.py)
    idea        K/V blocks travel round the cp ring;    an all-to-all trades sequence shards
                an online softmax merges them           for head shards, attention runs on
                                                        whole sequences, a second all-to-all
                                                        trades back
    sent per    forward (cp-1) K/V blocks; backward     forward q, k, v and the output:
    rank and    the K/V blocks again and the dK/dV      4 (cp-1)/cp of the activation
    layer       accumulators                            B T_cp C/tp; backward the same
    needs       T a multiple of 2 cp (zig-zag) or cp    n_head a multiple of tp x cp
    use when    long sequences, few heads; sends        many heads, a fast all-to-all; the
                overlap the block compute               volume per rank does not grow with cp

The zig-zag layout (the default) cuts T into 2 cp chunks and gives rank r chunks r and
2cp-1-r: with a causal mask every rank does the same attention work, where contiguous
slices give the last rank up to 2cp/(cp+1) times the mean (ring_attention.attention_work).

    context_parallel.py   ContextParallel (group, algorithm, layout), the positions a rank
                          holds and apply_context(model, cp)
    ring_attention.py     K/V blocks round the cp ring, merged by an online softmax
                          (Liu et al. 2023)
    ulysses.py            an all-to-all from sequence shards to head shards and back
                          (Jacobs et al. 2023)
    memory.py             the bytes a cp rank sends, its attention work, its memory
compose.parallelize calls apply_context after apply_tensor.
Read next: context_parallel.py, then ring_attention.py.
"""
