"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): every weight matrix of a block
split over the tp group, with sequence parallelism and the vocabulary split beside it.

    tensor_parallel.py   f and g, the column- and row-parallel linear layers, attention and
                         MLP over tp, and apply_tensor(model, tp), which swaps them in
    vocab.py             the embedding table, LM head and cross-entropy split by vocabulary
    sequence.py          sequence parallelism (Korthikanti et al. 2022): LayerNorm and
                         dropout on T/tp positions, all-gather / reduce-scatter for f and g
    async_tp.py          async TP (collective matmul, Wang et al. 2023): SP's all-gather and
                         reduce-scatter cut into steps, hidden behind the matmul chunks
    memory.py            the bytes a tp rank sends and the activations it keeps, as formulas
compose.parallelize calls apply_tensor first, before the other axes.
Read next: tensor_parallel.py.
"""
