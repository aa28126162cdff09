"""Parallelism: one subpackage per axis, applied to the plain model by compose.py in one order.

    compose.py         Plan (how many ranks each axis gets) and build: the mesh, then
                       parallelize (tp, cp, ep, pp applied to GPT(cfg, seed) in that order),
                       then gradient_sync (the engine), then the pipeline stage
    placement.py       Replicate / Shard / Partial: what every parameter and activation is
                       on each axis, and check mode, which asserts it
    sharding.py        ModelSharding: what this rank holds, and the global views of it
    engine.py          the narrow interface every gradient-sync engine offers the loop
    micro_batching.py  my rows of each global batch, cut into micro-batches; gradient
                       accumulation, the step schedule without a pipeline
    data/              DDP: replicas summing their gradients (and its shared-memory fast path);
                       DiLoCo, 1-bit Adam and PowerSGD, which sync less or in fewer bits
    zero/              ZeRO-1/2/3: DDP without the redundant copies (and HSDP: sharded inside
                       a node, replicated across)
    tensor/            Megatron tensor parallelism, sequence parallelism, the vocabulary split
    context/           context parallelism: ring attention and Ulysses
    pipeline/          pipeline parallelism: schedules as data, their validator, simulator
                       and renderer, and the stage that runs them
    expert/            expert parallelism: a MoE layer's experts over the ep ranks
Each subpackage's docstring is its map: the files in reading order, the function that
applies it, and the module of its traffic and memory formulas.
Read next: data/ (the first parallelism), then compose.py.
"""
