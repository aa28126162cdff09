"""Tensor parallelism's formulas against what the ranks really do: bytes each tp rank sends
per step (RankResult.bytes_by_axis["tp"], every rank, every step) and the activations one
block keeps for the backward (autograd/saved.py), exactly; and both side by side with the
papers (Megatron's 4 all-reduces per layer; Korthikanti et al. 2022, Table 2).

The default run measures tp = 2 (with and without sequence parallelism) and W = 3 for the
per-call counts; `-m slow` adds tp = 4, dp x tp x ZeRO and tp = 1, 4 activations."""

import numpy as np
import pytest

from minidist import collectives as C
from minidist.autograd.saved import saved_bytes
from minidist.collectives import direct
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.nn import GPT
from minidist.parallel.tensor import memory as tm
from minidist.parallel.tensor.tensor_parallel import TensorParallel, apply_tensor
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank


# --- the per-call counts, against the collectives themselves ---------------------------

def _sent_per_call(ctx, calls):
    g, out = ctx.world, []
    for op, algo, n in calls:
        before = g.stats["bytes_sent"]
        getattr(C, op)(np.arange(n, dtype=np.float64), group=g, algo=algo)
        out.append(g.stats["bytes_sent"] - before)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_sent_bytes_match_each_algorithm_on_every_rank(W):
    big = direct.window(8, W) + 13                    # two rounds, shares uneven
    calls = [("all_reduce", "direct", 100), ("all_reduce", "direct", 1001),
             ("all_reduce", "direct", big), ("all_reduce", "ring", 1001),
             ("reduce_scatter", "direct", 1001), ("reduce_scatter", "ring", 1001),
             ("all_gather", "ring", 7), ("all_gather", "halving", 7),
             ("all_gather", "auto", 1), ("all_gather", "auto", 5000)]
    runs = spawn(W, _sent_per_call, calls)
    for r, got in enumerate(runs):
        for (op, algo, n), sent in zip(calls, got):
            assert sent == tm.sent_bytes(op, n, W, r, 8, algo), (op, algo, n, r)
    # Summed over the ranks, every reduction moves the textbook volume, except direct's
    # small-message path, where every rank reads all W-1 peers' inputs: W (W-1) n.
    for (op, algo, n), sent in zip(calls, zip(*runs)):
        small = op == "all_reduce" and algo == "direct" and n * 8 <= 4096
        total = {"all_reduce": (W if small else 2) * (W - 1) * n * 8,
                 "reduce_scatter": (W - 1) * n * 8, "all_gather": W * (W - 1) * n * 8}
        if algo != "halving" and not (op == "all_gather" and algo == "auto"):
            assert sum(sent) == total[op], (op, algo, n)
    assert len({got[2] for got in runs}) > 1          # the big direct all-reduce: per rank


# --- bytes per step, against RankResult.bytes_by_axis["tp"] ------------------------------

CASES = [  # dp, tp, sp, prompt length (T = 2x), C, heads, global batch, micro-batches, ZeRO
    (1, 2, False, 6, 16, 2, 4, 2, 0),       # everything below 4 KiB: direct_small
    (1, 2, True, 6, 16, 2, 4, 2, 0),
    (1, 4, False, 5, 16, 4, 53, 1, 0),      # B T = 530 tokens: loss all-reduces per rank
    (1, 4, True, 6, 32, 4, 4, 2, 0),
    (2, 2, True, 6, 32, 2, 8, 2, 1),        # tp traffic does not depend on dp or ZeRO
]
# default: the two tp = 2 cases (with and without sp); the rest are slow
CASES = CASES[:2] + [pytest.param(*c, marks=pytest.mark.slow) for c in CASES[2:]]


@pytest.mark.multiproc
@pytest.mark.parametrize("dp, tp, sp, length, C_, H, G, M, zero", CASES)
def test_bytes_per_step_equal_the_formula(dp, tp, sp, length, C_, H, G, M, zero):
    data = DataConfig(task="sort", length=length, seed=2)
    cfg = model_config_for(data, n_layer=2, n_head=H, n_embd=C_)
    plan = Plan(dp=dp, tp=tp, zero=zero, micro_batches=M, sequence_parallel=sp,
                check_placements=False)             # check mode's digests are traffic too
    runs = spawn(dp * tp, train_on_rank, cfg, data, plan, RunConfig(steps=2, global_batch=G),
                 OptimizerConfig(lr=1e-2))
    rows, T = G // (dp * M), data.block_size
    want = [tm.step_bytes(cfg, rows, T, tp, sp, micro_batches=M, rank=r) for r in range(tp)]
    for q, run in enumerate(runs):                    # global rank q is tp rank q % tp
        for step, by_axis in enumerate(run.bytes_by_axis):
            assert by_axis["tp"] == want[q % tp], f"rank {q}, step {step}"
    for step in range(2):
        assert sum(run.bytes_by_axis[step]["tp"] for run in runs) == dp * sum(want)
    if length == 5:                                   # the case built to depend on the rank
        assert len(set(want)) > 1


def test_per_layer_volume_is_megatrons():
    """Megatron's 4 all-reduces of B T C per layer (SP: 4 all-gathers and 4 reduce-scatters,
    the same volume), exactly when B T C splits evenly and passes the small-message path;
    under SP each layer adds the all-reduces of its LN gains/shifts and row-parallel biases,
    and the backward's second all-gather of the qkv and fc inputs (one B T C / tp each)."""
    data = DataConfig(task="sort", length=6)
    for tp in (2, 4):
        cfgs = [model_config_for(data, n_layer=L, n_head=4, n_embd=32) for L in (1, 2)]
        b, B, T, C_ = 8, 3, data.block_size, 32
        paper = tm.megatron_layer_bytes(B, T, C_, tp, b)
        assert paper == 4 * 2 * (tp - 1) / tp * B * T * C_ * b
        no_sp = [tm.step_bytes(c, B, T, tp) for c in cfgs]
        assert no_sp[1] - no_sp[0] == paper
        with_sp = [tm.step_bytes(c, B, T, tp, True) for c in cfgs]
        regather = (tp - 1) * (B * T * C_ // tp) * b              # one ring all-gather
        assert with_sp[1] - with_sp[0] == paper + 6 * (tp - 1) * C_ * b + 2 * regather
        # SP moves what tp moves, plus those gradients (6 per layer, direct_small), ln_f's
        # and wpe's, and the re-gathers of 2 layers x (qkv, fc) and the LM head
        extra = (6 * 2 + 2) * (tp - 1) * C_ * b + tm.sent_bytes("all_reduce", T * C_, tp, 0, b)
        assert with_sp[1] - no_sp[1] == extra + 5 * regather


def test_formulas_refuse_splits_that_do_not_divide():
    cfg = model_config_for(DataConfig(task="sort", length=5), n_head=2, n_embd=16)
    with pytest.raises(ValueError, match="divide by tp=4"):
        tm.step_bytes(cfg, 2, 10, 4)                       # 2 heads over 4 ranks
    with pytest.raises(ValueError, match="T=10"):
        tm.activation_bytes(2, 10, 16, 4, 64, tp=4, sp=True)
    with pytest.raises(ValueError, match="no byte count"):
        tm.sent_bytes("all_reduce", 100, 2, 0, 8, "tree")


# --- activation memory, against autograd/saved.py -----------------------------------------

DATA = DataConfig(task="sort", length=6, seed=2)          # T = 12: splits over 2 and 4


def _model_layers(group, sp, rows):
    """Bytes the whole GPT's graph keeps (loss as root), for 1 and 2 layers."""
    out = []
    for L in (1, 2):
        cfg = model_config_for(DATA, n_layer=L, n_head=4, n_embd=16)
        model = apply_tensor(GPT(cfg, 0), TensorParallel(group, sp, algo="direct"))
        x, y = SyntheticData(DATA).batch(np.arange(rows))
        _, loss = model(x, y)
        out.append(saved_bytes(loss, exclude=model.parameters()))
    return out


def _activations_on_rank(ctx, rows):
    W, out = ctx.world.size, {}
    for sp in ([False, True] if W > 1 else [False]):
        for p in (0.0, 0.1):
            cfg = model_config_for(DATA, n_layer=2, n_head=4, n_embd=16, dropout=p)
            out[sp, p > 0] = tm.measure_layer_activations(ctx.world, cfg, rows, sp)
        out[sp, "model"] = _model_layers(ctx.world, sp, rows)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2,     # tp = 2: with
                                pytest.param(4, marks=pytest.mark.slow)])     # and without sp
def test_activation_formula_equals_what_the_graph_keeps(tp):
    rows, T, C_, H = 3, DATA.block_size, 16, 4
    runs = spawn(tp, _activations_on_rank, rows)
    for r, got in enumerate(runs):
        for sp in ([False, True] if tp > 1 else [False]):
            for dropout in (False, True):
                want = tm.activation_bytes(rows, T, C_, H, 4 * C_, tp=tp, sp=sp, itemsize=8,
                                           dropout=dropout)
                assert got[sp, dropout] == want, f"rank {r}, sp={sp}, dropout={dropout}"
            one, two = got[sp, "model"]                # inside the whole GPT, from the loss
            assert two - one == tm.activation_bytes(rows, T, C_, H, 4 * C_, tp=tp, sp=sp), \
                f"rank {r}, sp={sp}: one more layer of the GPT"


SIZES = dict(B=4, T=64, C=128, H=8, F=512, itemsize=2)      # 16-bit, as in the paper


def _ours(tp, sp=False, **kw):
    s = dict(SIZES, **kw)
    return tm.activation_bytes(s["B"], s["T"], s["C"], s["H"], s["F"], tp=tp, sp=sp,
                               itemsize=s["itemsize"])


def test_paper_table_2():
    s, b, h, a = 2048, 1, 12288, 96                          # GPT-3 175B, one sequence
    for sp in (False, True):
        assert tm.paper_activation_bytes(s, b, h, a, 1, sp) == 34 * s * b * h + 5 * a * s * s * b
    t = 8
    assert tm.paper_activation_bytes(s, b, h, a, t) == s * b * h * (10 + 24 / t) \
        + 5 * a * s * s * b / t
    assert tm.paper_activation_bytes(s, b, h, a, t, sp=True) == s * b * h * 34 / t \
        + 5 * a * s * s * b / t


def test_ours_beside_the_paper_without_sp_an_unsharded_term_like_10_sbh():
    """ours(t) = U + S / t exactly; U is Korthikanti's 10 sbh (16-bit) less its two 1-byte
    dropout masks (no dropout here): LN 4 sbh (+ 1/sigma 4 sb), QKV and MLP inputs 4 sbh.
    The paper's U, for comparison, is 10 sbh."""
    B, T, C_ = SIZES["B"], SIZES["T"], SIZES["C"]
    S = 2 * (_ours(1) - _ours(2))
    U = _ours(1) - S
    for t in (4, 8):
        assert _ours(t) == U + S // t
    sbh = B * T * C_
    assert U == 8 * sbh + 4 * B * T
    paper = [tm.paper_activation_bytes(T, B, C_, SIZES["H"], t) for t in (1, 2)]
    assert paper[0] - 2 * (paper[0] - paper[1]) == 10 * sbh        # the paper's U
    assert U - 4 * B * T == 10 * sbh - 2 * sbh                      # ours: less the masks


def test_with_sp_every_term_divides_by_tp():
    """Under SP each term of one layer is its tp=1 value over t, the paper's 1/t scaling
    (34 sbh / t). The qkv and fc matmuls keep only their input shard and all-gather it
    again in the backward, as Megatron does; the causal mask is added to the scores and
    kept by nothing."""
    s = SIZES
    one = tm.activation_terms(s["B"], s["T"], s["C"], s["H"], s["F"], itemsize=2)
    for t in (2, 4, 8):
        sharded = tm.activation_terms(s["B"], s["T"], s["C"], s["H"], s["F"], tp=t, sp=True,
                                      itemsize=2)
        for name, value in sharded.items():
            assert value == one[name] // t, (t, name)
        assert _ours(t, sp=True) == _ours(1) // t
        assert _ours(t, sp=True) < _ours(t)            # SP still saves: LN terms / t
