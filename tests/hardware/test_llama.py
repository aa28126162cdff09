"""Llama blocks in the predictor (hardware/architecture.py, llama.py, architecture_memory.py):
the presets' parameter counts are the released checkpoints', the FLOPs and the memory are
the hand counts, the op list multiplies every parameter a token meets twice per forward, tp
splits as Megatron does, and `python -m minidist predict --model llama3-70b` prints it all.

The small shape below has grouped-query attention of 8 query heads in 2 groups, so tp = 2
splits both and tp = 4 must be refused: L 2, C 64, H 8, G 2, D 8, F 96, V 100, T 16."""

from dataclasses import replace

import pytest

from minidist.__main__ import main as cli
from minidist.hardware import architecture as ar
from minidist.hardware import architecture_layout as lay
from minidist.hardware import architecture_memory as am
from minidist.hardware import op_costs as oc
from minidist.hardware import predict as pr
from minidist.hardware import profiles
from minidist.hardware import roofline as rl
from minidist.hardware.llama import LLAMA_SHAPES, llama
from minidist.memory import budget
from minidist.memory import budget_models as bm
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan

SMALL = ar.Architecture(n_layer=2, n_embd=64, n_head=8, n_kv_head=2, ffn_hidden=96,
                        vocab_size=100, block_size=16, norm="rmsnorm", mlp="swiglu",
                        positions="rotary", bias=False, tie_weights=False)
H100 = profiles.load("h100-sxm")


@pytest.mark.parametrize("name, n", [
    ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192), ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)])
def test_parameter_counts_are_the_released_checkpoints(name, n):
    """LlamaForCausalLM.num_parameters() of the Hugging Face checkpoints (the hub's
    safetensors totals, less L x 64 rotary inv_freq buffers for Llama 2)."""
    assert ar.parameter_count(llama(name)) == n


def test_every_preset_width_follows_metas_ffn_rule():
    """F = m ceil(floor(k floor(8C/3)) / m), with Meta's multiplier k and multiple m."""
    rule = {"llama2-7b": (1, 256), "llama2-13b": (1, 256), "llama2-70b": (1.3, 4096),
            "llama3-8b": (1.3, 1024), "llama3-70b": (1.3, 4096), "llama3-405b": (1.2, 4096)}
    for name, (L, C, H, G, F, V, T) in LLAMA_SHAPES.items():
        k, m = rule[name]
        assert F == m * -(-int(k * (8 * C // 3)) // m), name
        assert C // H == 128 and H % G == 0


def test_a_gpt_described_as_an_architecture_counts_as_the_gpt():
    """of(cfg) has the GPT's parameter arrays (roofline's test checks them against the
    model) and the memory estimator's shards per tp rank and pipeline stage."""
    for cfg in (GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=4, n_embd=32),
                GPTConfig(vocab_size=51, block_size=8, n_layer=3, n_head=2, n_embd=16,
                          bias=False, tie_weights=False, mlp_ratio=2)):
        a = ar.of(cfg)
        assert ar.parameter_count(a) == bm.parameter_count(cfg)
        for tp, pp in ((1, 1), (2, 1), (2, 2), (1, 3)):
            for stage in range(pp):
                assert lay.unit_numels(a, tp, pp, stage) == bm.unit_numels(cfg, tp, pp, stage)


def test_the_model_flops_by_hand():
    """6N + 12LHQT per token, N every parameter: per block norm 64 + qkv 64 x 96 + proj
    64 x 64 + norm 64 + gate and up 64 x 192 + down 96 x 64 = 28,800; two blocks, wte and
    lm_head 100 x 64 each, the final norm 64: N = 70,464."""
    assert ar.parameter_count(SMALL) == 70_464
    p = pr.predict(SMALL, Plan(dp=2, micro_batches=2, check_placements=False), 8, H100,
                   memory=False)
    per_token = 6 * 70_464 + 12 * 2 * 8 * 8 * 16
    assert p.model_flops == per_token * 8 * 16 == 447_360 * 128
    assert p.hardware_flops == p.model_flops                  # no recomputation


def test_the_op_list_multiplies_every_parameter_a_token_meets():
    """Forward: 2 FLOPs per token for each weight a token multiplies (qkv 6,144, proj
    4,096, gate and up 12,288, down 6,144 per block; the LM head 6,400: 63,744, the gathered
    wte and the norms' gains excluded) plus the scores, 4 B H T^2 D per layer. The whole step
    unfused: 6 per weight and 12 B H T^2 D per layer, the model FLOPs of MFU less wte's and
    the gains' 6 (V C + (2L + 1) C) per token."""
    B, R = 3, 3 * 16
    ops = rl.gpt_ops(SMALL, B, precision="bf16")
    forward = sum(o.matmul_flops("unfused") for o in ops if o.phase == "forward")
    assert forward == 2 * 63_744 * R + 4 * 2 * B * 8 * 16 * 16 * 8
    assert sum(o.matmul_flops() for o in ops if o.phase == "forward") == forward
    step = sum(o.matmul_flops("unfused") for o in ops)
    assert step == 6 * 63_744 * R + 12 * 2 * B * 8 * 16 * 16 * 8
    p = pr.predict(SMALL, Plan(dp=1, micro_batches=1, check_placements=False), B, H100,
                   memory=False)
    assert step == p.model_flops - 6 * (100 * 64 + 5 * 64) * R
    names = [o.name for o in ops if o.phase == "forward"]
    assert names == ["embedding", "rmsnorm", "qkv matmul", "rotary", "attention",
                     "attn proj matmul", "residual add", "fc matmul", "swiglu", "fc2 matmul",
                     "lm head matmul", "cross-entropy"]
    assert set(names) - {"embedding", "lm head matmul", "cross-entropy"} <= set(pr.PER_LAYER)


def test_tensor_parallelism_splits_heads_kv_heads_mlp_and_vocabulary():
    """tp = 2: 4 query heads and 1 KV head, 48 columns of gate and of up, 50 vocabulary
    columns per rank; the ranks' matmul FLOPs add up to one rank's at tp = 1; a tp that does
    not divide the 2 KV heads is refused, as Megatron refuses it."""
    one, two = (rl.gpt_ops(SMALL, 3, tp=t) for t in (1, 2))
    by = {(o.phase, o.name): o for o in two}
    R = 48
    L = 2                                                     # each block op runs L times
    assert by["forward", "qkv matmul"].matmul_flops() == L * 2 * R * 64 * (4 + 2 * 1) * 8
    assert by["forward", "fc matmul"].matmul_flops() == L * 2 * R * 64 * 2 * 48
    assert by["forward", "lm head matmul"].matmul_flops() == 2 * R * 64 * 50
    assert by["forward", "attention"].fused == oc.attention(3, 4, 16, 8, 4, kv_heads=1)[0]
    assert by["forward", "rotary"].fused == oc.rotary(3, 16, 4 + 1, 8, 4)[0]
    assert 2 * sum(o.matmul_flops() for o in two) == sum(o.matmul_flops() for o in one)
    with pytest.raises(ValueError, match="n_kv_head=2 .* Megatron splits the 2 KV heads"):
        rl.gpt_ops(SMALL, 3, tp=4)
    with pytest.raises(ValueError, match="use tp=8"):
        pr.predict(llama("llama3-70b"), Plan(tp=16, dp=2, micro_batches=1,
                                             check_placements=False), 2, H100)
    # rank shards: a block's qkv 64 x 48, proj 32 x 64, gate/up 64 x 96, down 48 x 64 and
    # its 2 norms; stage 0 adds wte's 50 rows, stage 1 the final norm and 50 head columns
    block = 3072 + 2048 + 6144 + 3072 + 2 * 64
    assert lay.unit_numels(SMALL, 2, 2, 0) == [50 * 64, block]
    assert lay.unit_numels(SMALL, 2, 2, 1) == [64 + 64 * 50, block]


def test_grouped_query_attention_shrinks_qkv_and_the_kv_bytes_not_the_scores():
    mha = replace(SMALL, n_kv_head=8)
    gqa_ops = {(o.phase, o.name): o for o in rl.gpt_ops(SMALL, 2)}
    mha_ops = {(o.phase, o.name): o for o in rl.gpt_ops(mha, 2)}
    q = ("forward", "qkv matmul")
    assert gqa_ops[q].matmul_flops() * 24 == mha_ops[q].matmul_flops() * 12   # (8+4) / (8+16)
    att = ("forward", "attention")
    assert gqa_ops[att].matmul_flops() == mha_ops[att].matmul_flops()
    a, kv = 2 * 8 * 16 * 8 * 4, 2 * 2 * 16 * 8 * 4          # q's bytes, one of k, v's
    assert mha_ops[att].bytes() - gqa_ops[att].bytes() == 2 * 2 * (a - kv)    # L x (k, v)
    assert ar.parameter_count(mha) - ar.parameter_count(SMALL) == 2 * 64 * 2 * 6 * 8


def test_rmsnorm_swiglu_and_rotary_costs_by_hand():
    """n = 12 elements (R 4, C or F 3), 2 bytes each."""
    rms, _ = oc.layernorm(4, 3, 2, bias=False, centered=False)
    ln, _ = oc.layernorm(4, 3, 2, bias=False)
    # x*x 12, mean 12, +eps 4, sqrt 4, 1/. 4, x*r 12, *w 12: 60; LayerNorm adds mean and x-mu
    assert rms[0].other == 60 and ln[0].other == 60 + 24
    assert (rms[0].read, rms[0].written) == (2 * (12 + 3), 2 * (12 + 4))
    sw, sw_unfused = oc.swiglu(4, 3, 2)
    assert (sw[0].other, sw[0].read, sw[0].written, len(sw_unfused)) == (60, 48, 24, 5)
    swb, _ = oc.swiglu_backward(4, 3, 2)
    assert (swb[0].other, swb[0].read, swb[0].written) == (12 * 12, 72, 48)
    ro, ro_unfused = oc.rotary(1, 2, 3, 2, 2)                   # n = 12, tables 2 x 2
    assert (ro[0].other, ro[0].read, ro[0].written) == (12 + 6 + 12 + 12, 2 * (12 + 8), 24)
    assert oc.embedding(2, 3, 4, 2, positions=False)[0][0].other == 0


def test_the_activation_terms_by_hand():
    """R 3, T 16, tp 2, bf16: norm inputs 2 R T' C b, qkv and fc inputs the same, q k v
    R T (8 + 4) 8 / 2 b, proj input R T 64 / 2 b, gate up and product 3 R T 96 / 2 b, the
    softmax R (8 / 2) T^2 b; T' = 8 under SP."""
    none = am.layer_terms(SMALL, 3, 16, tp=2)
    assert none == {"norm inputs (x2)": 12_288, "qkv and fc inputs": 12_288,
                    "q, k, v of my heads": 4_608, "proj input": 3_072,
                    "gate, up, silu(gate) * up": 13_824, "softmax of my heads": 6_144}
    assert sum(none.values()) == 3 * 2 * (4 * 16 * 64 + 16 * (96 + 64 + 3 * 96) // 2
                                          + 8 // 2 * 16 * 16)
    sp = am.layer_terms(SMALL, 3, 16, tp=2, sp=True)
    assert sum(sp.values()) == 52_224 - 2 * 6_144
    assert sum(am.layer_terms(SMALL, 3, 16, tp=2, mode="selective").values()) == 52_224 - 6_144
    assert am.layer_terms(SMALL, 3, 16, tp=2, sp=True, mode="full") == {"block input": 3_072}


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_the_count_is_korthikantis_table_2_with_dropout_added_back(t, sp):
    """A GPT block (G = H, GELU of 4C) in 16 bits: these terms plus the dropout ones, masks
    2sbh (2sbh/t under SP) and attention's mask and output 3as^2b/t, are Table 2's."""
    s, b, h, a = 16, 3, 64, 8
    gpt = ar.of(GPTConfig(vocab_size=100, block_size=s, n_layer=2, n_head=a, n_embd=h))
    masks = 2 * s * b * h / (t if sp else 1)
    for mode in ("none", "selective"):
        ours = sum(am.layer_terms(gpt, b, s, t, sp, mode).values())
        attention = 3 * a * s * s * b / t if mode == "none" else 0     # selective rebuilds it
        assert ours + masks + attention == budget.korthikanti_layer_bytes(s, b, h, a, t, sp,
                                                                          mode)
    if not sp:
        assert sum(am.layer_terms(gpt, b, s, t, mode="full").values()) == \
            budget.korthikanti_layer_bytes(s, b, h, a, t, recompute="full")


def test_the_memory_estimate_of_each_stage_by_hand():
    """dp 2 x tp 2 x pp 2, SP, selective recomputation, bf16, 4 micro-batches of 3 rows:
    1F1B holds 2 micro-batches on stage 0 and 1 on stage 1; params 2 B, grads 2 B and
    optimizer 12 B an element (ZeRO 0); the backward rebuilds one layer's softmax."""
    plan = budget.MemoryPlan(dp=2, tp=2, pp=2, recompute="selective", precision="bf16",
                             micro_batches=4, sp=True)
    first, last = am.estimate_stages(SMALL, plan, 24)
    block = 3072 + 2048 + 6144 + 3072 + 2 * 64
    layer = 6_144 + 6_144 + 4_608 + 3_072 + 13_824                # selective, SP
    for est, elements, held, extra in (
            (first, 50 * 64 + block, 2, 3 * 16 * 8),                          # token ids
            (last, 64 + 64 * 50 + block, 1, 2 * 3 * 8 * 64 * 2 + 3 * 16 * (50 * 4 + 8))):
        assert (est.params, est.grads, est.optimizer) == (2 * elements, 2 * elements,
                                                          12 * elements)
        assert (est.held, est.activations) == (held, held * (layer + extra))
        assert est.recompute == 6_144 and est.buffers == 0
    assert am.estimate(SMALL, plan, 24) == max(first, last, key=lambda e: e.total)
    with pytest.raises(ValueError, match="context parallelism"):
        am.estimate(SMALL, budget.MemoryPlan(cp=2, precision="bf16"), 2)


def test_a_llama_step_is_its_parts_and_fits_where_it_should():
    plan = Plan(tp=8, pp=4, dp=32, micro_batches=32, check_placements=False)
    p = pr.predict(llama("llama3-70b", "full"), plan, 1024, H100)
    b = p.breakdown
    assert p.step_s == pytest.approx(b["pipeline"] + b["dp exposed"] + b["optimizer"])
    assert b["pipeline"] == pytest.approx(b["compute"] + b["recompute"] + b["tp exposed"]
                                          + b["bubble"], rel=0.02)
    assert p.hfu > p.mfu and p.fits and p.memory["total"] < H100.hbm_bytes
    # 70.6B parameters on one GPU do not fit; split 8 x 4 ways they do
    one = pr.predict(llama("llama3-70b", "full"), Plan(dp=1024, micro_batches=1,
                                                       check_placements=False), 1024, H100)
    assert not one.fits and one.memory["params"] == 2 * 70_553_706_496
    selective = pr.predict(llama("llama3-70b", "selective"), plan, 1024, H100)
    assert selective.step_s < p.step_s and selective.mfu > p.mfu


def test_the_command_prints_a_llama_layout(capsys):
    assert cli(["predict", "--model", "llama3-70b", "--hardware", "h100-sxm", "--gpus", "1024",
                "--tp", "8", "--pp", "4", "--global-batch", "1024", "--seq", "8192"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("predict · llama3-70b: 80 layers, h=8192, 64 heads (8 KV), "
                             "swiglu F=28672, V=128256, s=8192")
    text = " ".join(" ".join(out).split())
    for words in ("layout tp=8 pp=4 dp=32", "MFU", "HFU", "bubble", "memory per GPU (GiB)",
                  "of 80 GiB: fits"):
        assert words in text, (words, text)
    assert all(len(line) <= 100 for line in out), out


def test_the_command_searches_a_llama_and_names_the_presets(capsys):
    assert cli(["predict", "--search", "--model", "llama3-8b", "--hardware", "h100-sxm",
                "--gpus", "8", "--global-batch", "16", "--seq", "4096"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("predict --search · llama3-8b on 8 x h100-sxm") and len(out) == 12
    assert all(len(line) <= 100 for line in out), out
    with pytest.raises(SystemExit):
        cli(["predict", "--model", "llama4"])
    assert "llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b, llama3-405b" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["predict", "--model", "llama3-8b", "--cp", "2", "--tp", "1", "--pp", "1",
             "--gpus", "64", "--global-batch", "64"])
    assert "context parallelism (cp=2)" in capsys.readouterr().err
