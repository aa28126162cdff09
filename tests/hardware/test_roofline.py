"""hardware/roofline.py: the step's op list against the FLOP ledger of a real step, the
parameter list against the model, and the roofs' arithmetic against hand computations."""

import math

import pytest

from minidist import optim
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.hardware import roofline as rl
from minidist.hardware.op_costs import Kernel
from minidist.memory.budget_models import preset
from minidist.nn import GPT, GPTConfig
from minidist.observe import op_flops
from minidist.observe.flops import FlopLedger
from minidist.observe.throughput import closed_form

BATCH = 4


def _tiny(**overrides) -> tuple[GPTConfig, DataConfig]:
    data_cfg = DataConfig(task="sort", length=6)
    fields = dict(n_layer=2, n_embd=32, n_head=4, dtype="float32")
    fields.update(overrides)
    return model_config_for(data_cfg, **fields), data_cfg


def _ledger(cfg: GPTConfig, data_cfg: DataConfig) -> FlopLedger:
    model, data = GPT(cfg, 0), SyntheticData(data_cfg)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data.batch(data.global_indices(0, BATCH))                      # (B, T) each
    ledger = FlopLedger()
    with ledger:
        _, loss = model(x, y)
        loss.backward()
    ledger.count_optimizer(opt)
    return ledger


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False, "n_layer": 3},
                                       {"bias": False, "n_head": 2}])
def test_step_matches_the_flop_ledger_of_a_real_step(overrides):
    """Matmul FLOPs (forward + backward) equal what the ledger counts when the GPT runs,
    and PaLM's closed form; the forward's other FLOPs equal the ledger's but for the one
    multiply that scales the summed loss by 1/n_tokens; the optimizer's are exact."""
    cfg, data_cfg = _tiny(**overrides)
    ledger = _ledger(cfg, data_cfg)
    ops = rl.gpt_ops(cfg, BATCH)
    T = data_cfg.block_size
    for variant in ("unfused", "fused"):
        fwd_bwd = [o for o in ops if o.phase != "optimizer"]
        matmul = sum(o.matmul_flops(variant) for o in fwd_bwd)
        flash_extra = cfg.n_layer * 2 * BATCH * cfg.n_head * T * T * (cfg.n_embd // cfg.n_head)
        assert matmul - (flash_extra if variant == "fused" else 0) == ledger.model_flops()
    assert ledger.model_flops() == closed_form(cfg, T).matmul * BATCH * T
    forward_other = sum(o.flops("unfused") - o.matmul_flops("unfused")
                        for o in ops if o.phase == "forward")
    assert forward_other == ledger.total("other", ("forward",)) - 1
    optimizer = sum(o.flops("unfused") for o in ops if o.phase == "optimizer")
    assert optimizer == ledger.total("all", ("optimizer",))         # the norm and AdamW
    sizes = rl.parameter_sizes(cfg)
    assert optimizer == op_flops.optimizer_flops("adamw", sum(sizes)) + \
        op_flops.grad_norm_flops(sizes)


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False}, {"bias": False},
                                       {"n_layer": 3, "mlp_ratio": 2}])
def test_parameter_sizes_match_the_model(overrides):
    cfg, _ = _tiny(**overrides)
    assert rl.parameter_sizes(cfg) == [p.data.size for p in GPT(cfg, 0).parameters()]


def test_launch_counts_and_bytes_of_the_step_fused_and_unfused():
    """The tiny GPT (L = 2 layers, 28 parameter arrays): every op runs as one kernel fused
    (the LayerNorm and bias + GELU backwards as two, the GEMM backwards as dx and dW, the
    embedding backward as two, cross-entropy's backward in its forward's kernel);
    unfused, AdamW alone launches 14 per array."""
    cfg, _ = _tiny()
    ops = rl.gpt_ops(cfg, BATCH)
    L, arrays = cfg.n_layer, len(rl.parameter_sizes(cfg))
    assert arrays == 28
    forward = 1 + (2 * L + 1) + 4 * L + L + L + 2 * L + 1 + 1          # 24 with L = 2
    backward = 0 + 2 + 2 * (2 * L + 1) + 2 * 4 * L + 2 * L + L + 2 * L + 2
    assert rl.totals(ops, "fused")["launches"] == forward + backward + 2
    adamw = next(o for o in ops if o.name == "adamw")
    assert adamw.launches("unfused") == 14 * arrays and adamw.launches("fused") == 1
    assert adamw.bytes("unfused") * 7 == adamw.bytes("fused") * 32
    f, u = rl.totals(ops, "fused"), rl.totals(ops, "unfused")
    assert f["bytes"] < u["bytes"] and f["launches"] < u["launches"]


def test_precision_scales_bytes_not_flops_and_keeps_optimizer_state_float32():
    cfg, _ = _tiny()
    by = {p: rl.gpt_ops(cfg, BATCH, precision=p) for p in rl.PRECISIONS}
    ln = {p: next(o for o in ops if o.name == "layernorm") for p, ops in by.items()}
    assert ln["float64"].bytes() == 2 * ln["float32"].bytes() == 4 * ln["bf16"].bytes()
    assert ln["float64"].flops() == ln["bf16"].flops()
    adamw = {p: next(o for o in ops if o.name == "adamw") for p, ops in by.items()}
    assert adamw["bf16"].bytes() == adamw["tf32"].bytes() == adamw["float32"].bytes()
    assert adamw["float64"].bytes() == 2 * adamw["float32"].bytes()


def test_h200_roofs_ridges_and_bounds():
    r = rl.h200("float32")
    assert r.ridge() == pytest.approx(66.9 / 4.8) and rl.h200("bf16").ridge() == \
        pytest.approx(989.4e12 / 4.8e12)
    assert (rl.h200("float64").matmul, rl.h200("float64").vector) == (66.9e12, 33.5e12)
    assert rl.h200("tf32").matmul == 494.7e12 and rl.h200("tf32").vector == 66.9e12
    k = Kernel("k", matmul=2 * 66.9e12, other=0, read=4.8e12, written=0)   # 2 s vs 1 s
    op = rl.Op("k", "forward", 3, (k,), (k, k))
    assert r.seconds(op) == pytest.approx(6.0) and r.seconds(op, "unfused") == pytest.approx(12)
    assert r.limit(op) == "compute"
    mem = Kernel("m", other=66.9e12, read=3 * 4.8e12, written=4.8e12)      # 1 s vs 4 s
    assert r.limit(rl.Op("m", "forward", 1, (mem,), (mem,))) == "memory"
    assert r.kernel_seconds(mem) == pytest.approx(4.0)
    both = Kernel("b", matmul=66.9e12, other=66.9e12)
    cpu = rl.Roof("cpu", 66.9e12, 66.9e12, 4.8e12, overlap=False)
    assert (r.kernel_seconds(both), cpu.kernel_seconds(both)) == (1.0, 2.0)
    assert r.limit(rl.Op("none", "backward", 1, (), (k,))) == "-"
    with pytest.raises(ValueError, match="fp8"):
        rl.h200("fp8")


def test_what_is_memory_bound_on_the_h200():
    """Tiny GPT: every op memory-bound. GPT-3 125M at T = 2048 in BF16: the GEMMs and the
    fused attention are compute-bound, the norms, GELU, residuals and AdamW memory-bound."""
    cfg, _ = _tiny()
    assert {rl.h200().limit(o) for o in rl.gpt_ops(cfg, 32) if o.fused} == {"memory"}
    roof = rl.h200("bf16")
    limits = {(o.name, o.phase): roof.limit(o) for o in rl.gpt_ops(preset("gpt3-125m"), 8,
                                                                    precision="bf16")}
    for name in ("qkv matmul", "attn proj matmul", "fc matmul", "fc2 matmul", "attention"):
        assert limits[(name, "forward")] == limits[(name, "backward")] == "compute", name
    for name in ("layernorm", "bias + gelu", "residual add", "adamw", "cross-entropy"):
        assert limits[(name, "optimizer" if name == "adamw" else "forward")] == "memory", name


def test_bad_configs_are_named_errors():
    cfg, _ = _tiny()
    with pytest.raises(ValueError, match="T=13"):
        rl.gpt_ops(cfg, 2, T=13)
    with pytest.raises(ValueError, match="moe_every=1"):
        rl.gpt_ops(_tiny(moe_every=1)[0], 2)
    with pytest.raises(ValueError, match="variant"):
        rl.gpt_ops(cfg, 2)[0].bytes("half")
    assert math.isclose(rl.step_seconds(rl.gpt_ops(cfg, 2), rl.h200()),
                        sum(rl.h200().seconds(o) for o in rl.gpt_ops(cfg, 2)))
