"""The model side of the memory budget: named GPT sizes, and the elements a rank holds.

The estimator (memory/budget.py) needs, for a GPT and a layout, how many parameter
elements one rank keeps and how ZeRO groups them into units. Building the model to count
them is fine for the tiny test models and impossible for a 175B one (700 GB in float32),
so this module writes the GPT's parameter list down from the config alone
(`parameter_shapes`, checked against GPT(cfg).named_parameters() by the tests) and cuts it
the way the layout does:
    tp   every parameter gets Megatron's placement (parallel/tensor.expected_placement) and
         a Shard(dim, blocks=k) dimension of n keeps k ceil(n / (k W)) elements
         (parallel/placement.piece_length: the vocabulary rows are padded, so every tp
         rank holds the same count);
    pp   stage s keeps the blocks of split_layers(L, P)[s] (parallel/pipeline/stage.py), wte and
         wpe on the first stage, ln_f (and lm_head) on the last, and a tied wte there too;
    ZeRO units are flat.split_units': the root (everything outside the blocks) first, then
         one per block (a middle pipeline stage has no root).

One rank's view: `unit_numels(cfg, tp, pp, stage)` = [N_root, N_block_i for my blocks],
the elements of my tp shard; zero_memory.exact_bytes turns them into bytes.

Presets: the GPT-3 family of Brown et al. 2020, arXiv:2005.14165, Table 2.1 (n_layer,
d_model, n_heads; n_ctx = 2048, the GPT-2 vocabulary of 50257 tokens, d_ff = 4 d_model),
as minidist's GPT builds them: learned positions, pre-LN, biases, tied embeddings, no
dropout. Two rows of the table do not multiply out: 1.3B lists 24 heads of d_head = 128
for d_model = 2048 (16 heads of 128 are used), 13B d_model = 5140 for 40 heads of 128
(5120 is used). Counted this way the sizes are 125.2M ... 174.6B (the tests pin them).
Read next: memory/budget.py.
"""

from __future__ import annotations

import math

from minidist.nn import GPTConfig
from minidist.parallel import placement as pl
from minidist.parallel.pipeline.stage import split_layers
from minidist.parallel.tensor.tensor_parallel import expected_placement

# name: (n_layer, n_embd, n_head), Brown et al. 2020, Table 2.1
GPT3_SHAPES = {"gpt3-125m": (12, 768, 12), "gpt3-350m": (24, 1024, 16),
               "gpt3-760m": (24, 1536, 16), "gpt3-1.3b": (24, 2048, 16),
               "gpt3-2.7b": (32, 2560, 32), "gpt3-6.7b": (32, 4096, 32),
               "gpt3-13b": (40, 5120, 40), "gpt3-175b": (96, 12288, 96)}
GPT3_VOCAB, GPT3_CONTEXT = 50257, 2048


def preset(name: str) -> GPTConfig:
    """The GPTConfig of a named size (GPT3_SHAPES); ValueError listing them otherwise."""
    if name not in GPT3_SHAPES:
        raise ValueError(f"model {name!r} is unknown; the presets are "
                         f"{', '.join(GPT3_SHAPES)} (Brown et al. 2020, Table 2.1), or 'tiny'.")
    L, C, H = GPT3_SHAPES[name]
    return GPTConfig(vocab_size=GPT3_VOCAB, block_size=GPT3_CONTEXT, n_layer=L, n_head=H,
                     n_embd=C, dtype="float32")


def _check_dense(cfg: GPTConfig) -> None:
    if cfg.moe_every:
        raise ValueError(f"memory budget: the model has MoE blocks (moe_every={cfg.moe_every}),"
                         " whose experts and routing the estimator does not model; use a "
                         "dense GPT (moe_every=0).")


def block_shapes(cfg: GPTConfig, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of block i's parameters, in model.parameters() order (nn/gpt.py)."""
    C, F, p = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, f"blocks.{i}."
    out = []
    for name, shape, has_bias in (("ln_1", (C,), True), ("attn.qkv", (C, 3 * C), True),
                                  ("attn.proj", (C, C), True), ("ln_2", (C,), True),
                                  ("mlp.fc", (C, F), True), ("mlp.proj", (F, C), True)):
        out.append((p + name + ".weight", shape))
        if has_bias and cfg.bias:
            out.append((p + name + ".bias", (shape[-1],)))
    return out


def _embeddings(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    return [("wte.weight", (cfg.vocab_size, cfg.n_embd)),
            ("wpe.weight", (cfg.block_size, cfg.n_embd))]


def _head(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    C = cfg.n_embd
    out = [("ln_f.weight", (C,))] + ([("ln_f.bias", (C,))] if cfg.bias else [])
    return out + ([] if cfg.tie_weights else [("lm_head.weight", (C, cfg.vocab_size))])


def parameter_shapes(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of GPT(cfg), in model.parameters() order."""
    _check_dense(cfg)
    blocks = [p for i in range(cfg.n_layer) for p in block_shapes(cfg, i)]
    return _embeddings(cfg) + blocks + _head(cfg)


def local_numel(name: str, shape: tuple[int, ...], tp: int) -> int:
    """Elements of `name` on one tp rank of tp: its Megatron placement, padding included."""
    placement = expected_placement(name) if tp > 1 else pl.Replicate()
    if not isinstance(placement, pl.Shard):
        return math.prod(shape)
    dim, k = placement.dim % len(shape), placement.blocks
    return math.prod(k * pl.piece_length(n, tp, k) if d == dim else n
                     for d, n in enumerate(shape))


def stage_layers(cfg: GPTConfig, pp: int, stage: int) -> range:
    """The blocks pipeline stage `stage` of pp holds (the whole stack when pp = 1)."""
    return split_layers(cfg.n_layer, pp)[stage] if pp > 1 else range(cfg.n_layer)


def _in_root(name: str, cfg: GPTConfig, pp: int, stage: int) -> bool:
    """Does stage `stage` hold this non-block parameter? (pipeline.PipelineCut.holds)"""
    top = name.split(".")[0]
    head = {"ln_f", "lm_head"} | ({"wte"} if cfg.tie_weights else set())
    return (stage == 0 and top in ("wte", "wpe")) or (stage == pp - 1 and top in head)


def unit_numels(cfg: GPTConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> list[int]:
    """Elements per ZeRO unit of one rank's shard: [root, my blocks...] (flat.split_units
    order; no root on a middle pipeline stage)."""
    _check_dense(cfg)
    root = sum(local_numel(n, s, tp) for n, s in _embeddings(cfg) + _head(cfg)
               if _in_root(n, cfg, pp, stage))
    blocks = [sum(local_numel(n, s, tp) for n, s in block_shapes(cfg, i))
              for i in stage_layers(cfg, pp, stage)]
    return ([root] if root else []) + blocks


def parameter_count(cfg: GPTConfig) -> int:
    """Ψ: the elements of the whole model (a tied wte counted once)."""
    return sum(math.prod(shape) for _, shape in parameter_shapes(cfg))


__all__ = ["GPT3_SHAPES", "preset", "parameter_shapes", "block_shapes", "local_numel",
           "stage_layers", "unit_numels", "parameter_count"]
