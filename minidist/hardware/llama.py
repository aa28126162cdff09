"""Llama 2 and Llama 3: the published shapes, as Architectures the predictor prices.

A Llama block is minidist's GPT block with RMSNorm, a SwiGLU MLP, rotary positions,
grouped-query attention, no biases and an untied LM head (hardware/architecture.py has the
comparison); nn/ builds none of them, hardware/predict.py prices them. Each preset is the
released model's shapes, with its source:

    preset        L     C     H   G      F       V       T    parameters (N)
    llama2-7b    32   4096   32  32  11008   32000   4096     6,738,415,616
    llama2-13b   40   5120   40  40  13824   32000   4096    13,015,864,320
    llama2-70b   80   8192   64   8  28672   32000   4096    68,976,648,192
    llama3-8b    32   4096   32   8  14336  128256   8192     8,030,261,248
    llama3-70b   80   8192   64   8  28672  128256   8192    70,553,706,496
    llama3-405b 126  16384  128   8  53248  128256   8192   405,853,388,800
    (L layers, C width, H query heads, G key/value heads, F SwiGLU width, V vocabulary,
    T context length; head width D = C / H = 128 in all six)

Sources, number by number:
    Llama 2   L, C, H, G, F, V: the config.json of meta-llama/Llama-2-{7b,13b,70b}-hf on the
              Hugging Face hub (num_hidden_layers, hidden_size, num_attention_heads,
              num_key_value_heads, intermediate_size, vocab_size); T = 4096 and grouped-
              query attention for 70B only: Touvron et al. 2023, "Llama 2", arXiv:2307.09288,
              Table 1 (context length 4k; GQA for 34B and 70B), the configs'
              max_position_embeddings 4096 too.
    Llama 3   L, C, F, H, G: Llama Team 2024, "The Llama 3 Herd of Models", arXiv:2407.21783,
              Table 3 (8B: 32, 4,096, 14,336, 32, 8; 70B: 80, 8,192, 28,672, 64, 8; 405B:
              126, 16,384, 53,248, 128, 8), also meta-llama/llama-models' models/sku_list.py
              (dim, n_layers, n_heads, n_kv_heads). V = 128,256: the config.json of
              meta-llama/Meta-Llama-3-8B and -70B (vocab_size; Table 3 rounds it to
              "128,000": 128,000 BPE tokens and 256 reserved special ones). T = 8192: the
              sequence length of the paper's main pre-training (before its long-context
              stage to 128K) and the Llama 3 configs' max_position_embeddings. Some
              published 405B configs list 16 KV heads: a copy with the 8 heads duplicated for
              16-way inference; the model has 8 (Table 3, sku_list.py).
    F         all six follow Meta's rule (the FeedForward of Meta's reference code):
              F = m ceil(floor(k floor(8C/3)) / m), with sku_list.py's ffn_dim_multiplier k
              and multiple_of m: Llama 2 70B and Llama 3 70B k = 1.3, m = 4096; Llama 3 8B
              k = 1.3, m = 1024; 405B k = 1.2, m = 4096; Llama 2 7B and 13B no multiplier
              (k = 1), m = 256 (tests/hardware/test_llama.py checks all six).
    N         architecture.parameter_count, checked by the tests against the Hugging Face
              checkpoints: LlamaForCausalLM.num_parameters(), equal to the hub's
              safetensors total for Llama 3 and to it less the rotary inv_freq buffers
              (L x 64 numbers, not parameters) that the Llama 2 checkpoints also store.
Not described: Llama 3's document masks and its rotary base (neither changes the shapes
or the FLOPs counted here), Llama 2's 34B (never released).
Read next: hardware/architecture.py, hardware/predict.py.
"""

from __future__ import annotations

from minidist.hardware.architecture import Architecture

# name: (L, C, H, G, F, V, T), sources in the module docstring
LLAMA_SHAPES = {"llama2-7b": (32, 4096, 32, 32, 11008, 32000, 4096),
                "llama2-13b": (40, 5120, 40, 40, 13824, 32000, 4096),
                "llama2-70b": (80, 8192, 64, 8, 28672, 32000, 4096),
                "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 8192),
                "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 8192),
                "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 8192)}


def llama(name: str, recompute: str = "none") -> Architecture:
    """The Architecture of a Llama preset (LLAMA_SHAPES); ValueError listing them otherwise."""
    if name not in LLAMA_SHAPES:
        raise ValueError(f"model {name!r} is not a Llama preset; they are "
                         f"{', '.join(LLAMA_SHAPES)}.")
    L, C, H, G, F, V, T = LLAMA_SHAPES[name]
    return Architecture(n_layer=L, n_embd=C, n_head=H, n_kv_head=G, ffn_hidden=F,
                        vocab_size=V, block_size=T, norm="rmsnorm", mlp="swiglu",
                        positions="rotary", bias=False, tie_weights=False,
                        recompute=recompute)


__all__ = ["LLAMA_SHAPES", "llama"]
