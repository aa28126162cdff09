"""determinize (deterministic/layers.py): the mode replaces layers by twins that hold the same
Parameter objects, so nothing but the grouping of the sums changes; the model's code is
left as it is."""

import numpy as np

from minidist.deterministic.attention import CanonicalAttention
from minidist.deterministic.layers import TiledLayout, TiledLinear, TreeEmbedding, \
    TreeLayerNorm, determinize
from minidist.nn import GPT, GPTConfig
from minidist.nn.attention import LocalAttention
from minidist.nn.layers import Linear

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, dtype="float64")


def test_twins_hold_the_same_parameters_in_the_same_order():
    model = GPT(CFG, seed=0)
    before = list(model.named_parameters())
    determinize(model)
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(p is q for (_, p), (_, q) in zip(after, before))
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["blocks.0.attn.qkv"] is TiledLinear and kinds["blocks.1.mlp.proj"] is TiledLinear
    assert kinds["blocks.0.ln_1"] is TreeLayerNorm and kinds["ln_f"] is TreeLayerNorm
    assert isinstance(model.layout, TiledLayout)
    assert kinds["wte"] is not TreeEmbedding                       # only with token tiles
    assert isinstance(model.blocks[0].attn.core, LocalAttention)


def test_token_tiles_also_replace_the_embeddings_and_the_attention_core():
    model = determinize(GPT(CFG, seed=0), token_tiles=4)
    assert type(model.wte) is TreeEmbedding and type(model.wpe) is TreeEmbedding
    assert all(isinstance(b.attn.core, CanonicalAttention) for b in model.blocks)


def test_a_twin_computes_the_layer_s_function():
    """Tiles change the grouping of the sums, not the result: equal to rounding."""
    plain = GPT(CFG, seed=0)
    twin = determinize(GPT(CFG, seed=0), token_tiles=2)
    idx = np.random.default_rng(0).integers(0, CFG.vocab_size, (3, CFG.block_size))
    (za, la), (zb, lb) = plain(idx, idx), twin(idx, idx)
    assert np.allclose(za.data, zb.data, rtol=0, atol=1e-12)
    la.backward()
    lb.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), twin.named_parameters()):
        assert np.allclose(p.grad, q.grad, rtol=0, atol=1e-12), name


def test_other_linears_stay_plain():
    """Only the tp-shardable matmuls are tiled (a MoE's router and experts are not)."""
    moe = GPTConfig(**{**CFG.__dict__, "moe_every": 1, "n_experts": 2})
    model = determinize(GPT(moe, seed=0))
    kinds = {name: type(m) for name, m in model.named_modules()}
    assert kinds["blocks.0.moe.router"] is Linear
    assert kinds["blocks.0.moe.experts.0.fc"] is Linear
