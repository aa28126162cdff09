"""nn/gpt.py: the whole model against finite differences, and config validation.

The default run gradchecks the cheapest whole model (untied head, no bias); the tied dense
model and the MoE model are in the slow set (test_moe.py gradchecks the MoE layer by
default)."""

import numpy as np
import pytest

from minidist import seed as seeding
from minidist.autograd import gradcheck
from minidist.nn import GPT, GPTConfig

SMALL = dict(vocab_size=5, block_size=4, n_layer=2, n_head=2, n_embd=4, mlp_ratio=2)


def _swap(model, names, tensors):
    """Point the model's attributes at `tensors` (gradcheck passes float64 copies)."""
    for name, t in zip(names, tensors):
        *path, attr = name.split(".")
        owner = model
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, attr, t)


def _batch(cfg, B=2, T=3, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    targets[0, 0] = -100                                   # an ignored position
    return idx, targets


@pytest.mark.parametrize("extra", [
    pytest.param(dict(), marks=pytest.mark.slow),                # dense, tied head
    dict(tie_weights=False, bias=False),                         # the cheapest: default
    pytest.param(dict(moe_every=2, n_experts=3, top_k=2, capacity_factor=0.6,
                      aux_loss_coef=0.5), marks=pytest.mark.slow),
])
def test_gradcheck_whole_model(extra):
    cfg = GPTConfig(**SMALL, **extra)
    model = GPT(cfg, seed=1)
    for name, p in model.named_parameters():                    # bigger weights: a harder test
        p.data[...] = seeding.draw(seeding.normal(0.4), p.shape, 1, name) + p.data
    names, params = zip(*model.named_parameters())
    idx, targets = _batch(cfg)

    def fn(*ps):
        _swap(model, names, ps)
        return model(idx, targets)[1]

    try:
        assert gradcheck(fn, list(params), atol=1e-8, rtol=1e-6)
    finally:
        _swap(model, names, params)
    if cfg.moe_every:
        assert model.blocks[1].moe.last_routing.n_dropped > 0      # drops were exercised


def test_loss_is_mean_cross_entropy_and_n_tokens_rescales():
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg, seed=0)
    idx, targets = _batch(cfg)
    logits, loss = model(idx, targets)
    z = logits.data - logits.data.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    keep = targets != -100
    want = -logp[keep, targets[keep]].mean()
    assert loss.item() == pytest.approx(want, abs=1e-14)
    _, loss_sum = model(idx, targets, n_tokens=1)
    assert loss_sum.item() == pytest.approx(want * keep.sum(), abs=1e-13)
    assert logits.shape == (2, 3, 5) and model(idx)[1] is None


def test_layout_names_tying_and_moe_placement():
    model = GPT(GPTConfig(**{**SMALL, "n_layer": 4}, moe_every=2, n_experts=2))
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and "lm_head.weight" not in names
    assert hasattr(model.blocks[1], "moe") and hasattr(model.blocks[3], "moe")
    assert hasattr(model.blocks[0], "mlp") and hasattr(model.blocks[2], "mlp")
    assert "blocks.3.moe.experts.1.proj.weight" in names
    assert model.blocks[2].attn.resid_drop.name == "blocks.2.attn.resid_drop"
    untied = GPT(GPTConfig(**SMALL, tie_weights=False))
    assert "lm_head.weight" in dict(untied.named_parameters())


def test_float32_model_is_rounded_float64_model():
    m64 = GPT(GPTConfig(**SMALL), seed=3)
    m32 = GPT(GPTConfig(**SMALL, dtype="float32"), seed=3)
    for name, p in m32.named_parameters():
        assert p.dtype == np.float32
        assert np.array_equal(p.numpy(), m64.state_dict()[name].astype(np.float32))
    idx, targets = _batch(m32.cfg)
    _, loss = m32(idx, targets)
    assert loss.dtype == np.float32


def test_generate_appends_tokens_and_crops_context():
    model = GPT(GPTConfig(**SMALL), seed=0)
    out = model.generate(np.array([[1, 2], [3, 4]]), max_new_tokens=5)
    assert out.shape == (2, 7) and np.array_equal(out[:, :2], [[1, 2], [3, 4]])
    assert out.max() < 5 and model.training


@pytest.mark.parametrize("bad,match", [
    (dict(n_embd=10, n_head=4), "n_embd=10 is not divisible by n_head=4"),
    (dict(vocab_size=0), "vocab_size=0"),
    (dict(top_k=5, n_experts=4), "top_k=5"),
    (dict(dtype="float16"), "dtype"),
    (dict(dropout=1.0), "dropout"),
    (dict(moe_every=-1), "moe_every"),
    (dict(capacity_factor=-0.5), "capacity_factor"),   # 0 is dropless
        (dict(router="top1"), "router"),
        (dict(n_experts=4, route_groups=3), "route_groups"),
        (dict(router="expert-choice", bias_rate=0.01), "expert-choice"),
        (dict(shared_experts=-1), "shared_experts"),
])
def test_bad_configs_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**SMALL, **bad})


def test_too_long_input_and_all_ignored_targets_raise():
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match="block_size=4"):
        model(np.zeros((1, 5), dtype=np.int64))
    with pytest.raises(ValueError, match="-100"):
        model(np.zeros((1, 2), dtype=np.int64), np.full((1, 2), -100))
