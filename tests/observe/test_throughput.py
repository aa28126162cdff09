"""Throughput: the ledger of a GPT training step equals PaLM's 6N + 12LHQT after the two
documented terms (vectors, tied head), op by op and in total; the parameter counts of the
closed form are the model's; model FLOPs do not depend on the layout while ZeRO-3's
recomputation shows up in hardware FLOPs only; MFU and HFU are the stated quotients."""

import json

import numpy as np
import pytest

from minidist.data import DataConfig
from minidist.nn import GPT, GPTConfig
from minidist.observe import report, run_dir
from minidist.observe.flops import FlopLedger
from minidist.observe.progress import Progress
from minidist.observe.throughput import (closed_form, from_ledger, mfu, model_flops_per_token,
                                         palm_flops_per_token, throughput)
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

CONFIGS = [dict(), dict(tie_weights=False), dict(bias=False), dict(mlp_ratio=2, n_head=4),
           dict(n_layer=3, n_embd=24, n_head=3, vocab_size=17, bias=False, tie_weights=False)]


def _step(cfg: GPTConfig, B: int, T: int) -> FlopLedger:
    model = GPT(cfg, 0)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, cfg.vocab_size, (2, B, T))
    led = FlopLedger()
    with led:
        model(x, y)[1].backward()
    return led


@pytest.mark.parametrize("over", CONFIGS)
def test_closed_form_counts_the_models_parameters(over):
    cfg = GPTConfig(**over)
    params = dict(GPT(cfg, 0).named_parameters())
    cf = closed_form(cfg)
    assert cf.N == sum(p.size for n, p in params.items() if n not in ("wte.weight",
                                                                       "wpe.weight"))
    assert cf.n_vector == sum(p.size for p in params.values() if p.ndim == 1)
    assert cf.head == (cfg.vocab_size * cfg.n_embd if cfg.tie_weights else 0)
    assert (cf.L, cf.H, cf.Q, cf.T) == (cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head,
                                        cfg.block_size)
    N = sum(p.size for p in params.values())                  # MFU's N: every parameter
    assert model_flops_per_token(cfg) == palm_flops_per_token(N, cf.L, cf.H, cf.Q, cf.T)


@pytest.mark.parametrize("over", CONFIGS)
@pytest.mark.parametrize("B, T", [(3, 12), (2, 5), (1, 1)])
def test_gpt_step_ledger_equals_the_closed_form(over, B, T):
    cfg = GPTConfig(**over)
    led = _step(cfg, B, T)
    cf = closed_form(cfg, T)
    N, L, H, Q = cf.N, cf.L, cf.H, cf.Q
    assert led.model_flops() == B * T * (6 * N + 12 * L * H * Q * T - 6 * cf.n_vector
                                         + 6 * cf.head)
    assert led.model_flops() == B * T * cf.matmul == B * T * sum(v for _, v in cf.terms()[:4])
    assert cf.palm == 6 * N + 12 * L * H * Q * T


def test_gpt_step_matmuls_by_hand_per_op():
    """Forward matmuls of one step, written out: per layer qkv, scores, A v, proj, fc, fc2;
    then the head. The four biased projections run as Linear (the GEMM, then + b in place),
    the rest as MatMul. Backward: exactly twice each (every input needs its gradient)."""
    cfg = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=2, n_embd=16)
    B, T, C, V, H, L, r = 3, 12, 16, 11, 2, 2, 4
    D = C // H
    linears = 2 * B * T * C * 3 * C + 2 * B * T * C * C + 2 * B * T * C * r * C \
        + 2 * B * T * r * C * C
    attention = 2 * B * H * T * D * T + 2 * B * H * T * T * D
    bias_adds = B * T * (3 * C + C + r * C + C)
    led = _step(cfg, B, T)
    assert led.entries[("MatMul", "forward")] == [L * attention + 2 * B * T * C * V, 0, 2 * L + 1]
    assert led.entries[("Linear", "forward")] == [L * linears, L * bias_adds, 4 * L]
    assert led.entries[("MatMul", "backward")][0] == 2 * (L * attention + 2 * B * T * C * V)
    assert led.entries[("Linear", "backward")][0] == 2 * L * linears
    assert led.total("matmul", ("recompute", "optimizer")) == 0


def test_closed_form_refuses_moe_and_a_too_long_sequence():
    with pytest.raises(ValueError, match="dense GPT"):
        closed_form(GPTConfig(moe_every=2))
    with pytest.raises(ValueError, match="block_size=12"):
        closed_form(GPTConfig(), T=13)


def test_mfu_and_hfu_arithmetic():
    t = throughput(model_flops=6e9, hardware_flops=8e9, seconds=0.5, tokens=1000,
                   peak=2e10, ranks=3)
    assert t.tokens_per_s == 2000
    assert t.mfu == pytest.approx(6e9 / (0.5 * 2e10 * 3))                 # 0.2
    assert t.hfu == pytest.approx(8e9 / (0.5 * 2e10 * 3))
    cfg = GPTConfig()
    led = _step(cfg, 2, 6)
    u = from_ledger(led, cfg, seconds=0.01, tokens=12, peak=1e9)
    assert u.mfu == 12 * model_flops_per_token(cfg) / (0.01 * 1e9)
    assert u.hfu == led.hardware_flops() / (0.01 * 1e9)
    with pytest.raises(ValueError, match="must be >= 0"):
        throughput(-1, 8, 1.0, 1, 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        throughput(1, 2, 0.0, 1, 1.0)


def _count_one_step(ctx, cfg, data_cfg, plan, batch):
    led = FlopLedger()
    with led:
        train_on_rank(ctx, cfg, data_cfg, plan, RunConfig(steps=1, global_batch=batch),
                      OptimizerConfig(lr=1e-3))
    return led


@pytest.mark.multiproc
def test_zero3_runs_each_forward_once_and_model_flops_stay():
    """Stage 3 keeps each call's graph for the backward: nothing is recomputed, so its
    FLOPs equal stage 0's, recomputation none."""
    data_cfg = DataConfig(task="sort", length=3)
    cfg = GPTConfig(vocab_size=data_cfg.vocab_size, block_size=data_cfg.block_size,
                    n_layer=2, n_head=2, n_embd=16)
    ledgers = {}
    for zero in (0, 3):
        led = FlopLedger()
        plan = Plan(dp=2, zero=zero, check_placements=True)     # with placement's hook
        for part in spawn(2, _count_one_step, cfg, data_cfg, plan, 4):
            led.merge(part)
        ledgers[zero] = led
    exact = 4 * data_cfg.block_size * closed_form(cfg, data_cfg.block_size).matmul
    assert ledgers[0].model_flops() == ledgers[3].model_flops() == exact
    assert ledgers[0].total("all", ("recompute",)) == ledgers[3].total("all", ("recompute",)) == 0
    for phase in ("forward", "backward"):
        assert ledgers[3].total("matmul", (phase,)) == ledgers[0].total("matmul", (phase,))
    assert ledgers[3].total("all", ("forward",)) == ledgers[0].total("all", ("forward",))


def test_palm_540b_mfu_is_46_2_percent_with_the_shared_embedding_in_n():
    """PaLM (Chowdhery et al. 2022, Table 3 and App. B): 540B on 6144 TPU v4 chips of 275
    TFLOP/s (bf16), 238.3K tokens/s, L=118, H=48, Q=256, T=2048: MFU 46.2 %. The one
    convention (N every parameter: PaLM's 540.35B, its shared embedding included) gives
    it; N without the 256k x 18432 embedding gives 45.8 %."""
    per_token = palm_flops_per_token(540.35e9, 118, 48, 256, 2048)
    assert round(100 * mfu(per_token * 238.3e3, 1.0, 275e12, 6144), 1) == 46.2
    no_embedding = palm_flops_per_token(540.35e9 - 256_000 * 18432, 118, 48, 256, 2048)
    assert round(100 * mfu(no_embedding * 238.3e3, 1.0, 275e12, 6144), 1) == 45.8


def test_the_progress_line_the_bench_and_the_report_give_one_mfu():
    """The main job's line (Progress), bench throughput / demo 24 (from_ledger) and `report`
    (mfu_of, from what config.json records) compute MFU of the same run by the same
    convention: fed the same tokens/s, peak and ranks, they give the same number."""
    cfg = GPTConfig()
    bar = Progress.for_model(cfg, batch=2, ranks=2, total_steps=1, peak_flops=1e9)
    led = _step(cfg, 2, 6)
    tokens = 2 * cfg.block_size
    bench = from_ledger(led, cfg, seconds=0.25, tokens=tokens, peak=1e9, ranks=2)
    saved = json.loads(json.dumps(run_dir.config(cfg, DataConfig(), Plan(dp=2),
                                                 global_batch=2, peak_flops=1e9)))
    printed = report.mfu_of(saved, {"tokens_per_s": 4.0 * tokens})       # 4 steps a second
    assert bar.mfu(steps_per_second=4.0) == pytest.approx(bench.mfu, rel=1e-12)
    assert printed == pytest.approx(bench.mfu, rel=1e-12)
    embeddings = (cfg.vocab_size + cfg.block_size) * cfg.n_embd
    assert model_flops_per_token(cfg) == closed_form(cfg).palm + 6 * embeddings
