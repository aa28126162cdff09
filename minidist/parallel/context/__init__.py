"""Context parallelism: every layer on a slice of the sequence; only attention crosses slices.

    context_parallel.py   ContextParallel (group, algorithm, layout), the positions a rank
                          holds (zig-zag or contiguous) and apply_context(model, cp)
    ring_attention.py     K/V blocks round the cp ring, merged by an online softmax
                          (Liu et al. 2023)
    ulysses.py            an all-to-all from sequence shards to head shards and back
                          (Jacobs et al. 2023)
    memory.py             the bytes a cp rank sends, its attention work, its memory
compose.parallelize calls apply_context after apply_tensor.
Read next: context_parallel.py, then ring_attention.py.
"""
