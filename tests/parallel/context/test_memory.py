"""Context parallelism's formulas against what the ranks really do: bytes each cp rank sends
per step (RankResult.bytes_by_axis["cp"], every rank, every step), the attention work per
rank (contiguous vs zig-zag vs Ulysses), and the activations one block keeps for the
backward (autograd/saved.py), exactly, for ring attention and Ulysses.

The default run measures cp = 2 (bytes: ring and Ulysses once each); `-m slow` adds cp = 3,
4, the dp x cp and tp x cp layouts and the other activation sizes."""

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.data import DataConfig, model_config_for
from minidist.parallel.context import memory as cm
from minidist.parallel.context import ring_attention as ra
from minidist.parallel.tensor import memory as tm
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

DATA = DataConfig(task="sort", length=12, seed=2)          # T = 24: 2 cp chunks for cp 2, 3, 4


# --- bytes per step, against RankResult.bytes_by_axis["cp"] -------------------------------

CASES = [  # dp, tp, cp, algo, layout, heads, global batch, micro-batches
    (1, 1, 2, "ring", "zigzag", 2, 4, 2),
    (1, 1, 3, "ring", "zigzag", 3, 3, 1),
    (1, 1, 4, "ring", "contiguous", 2, 2, 1),
    (1, 1, 2, "ulysses", "zigzag", 2, 4, 2),
    (1, 1, 3, "ulysses", "contiguous", 3, 3, 1),
    (1, 1, 4, "ulysses", "zigzag", 4, 2, 1),
    (2, 1, 2, "ring", "zigzag", 2, 4, 1),       # dp x cp: the cp group carries attention only
    (2, 1, 2, "ulysses", "zigzag", 2, 8, 2),
    (1, 2, 2, "ring", "zigzag", 2, 4, 1),       # tp x cp: h = H / tp heads on each rank
    (1, 2, 2, "ulysses", "zigzag", 4, 4, 1),
]
DEFAULT = (0, 3)        # by index: cp = 2, ring and Ulysses; the rest are slow
CASES = [c if i in DEFAULT else pytest.param(*c, marks=pytest.mark.slow)
         for i, c in enumerate(CASES)]


@pytest.mark.multiproc
@pytest.mark.parametrize("dp, tp, cp, algo, layout, H, G, M", CASES)
def test_bytes_per_step_equal_the_formula(dp, tp, cp, algo, layout, H, G, M):
    cfg = model_config_for(DATA, n_layer=2, n_head=H, n_embd=8 * H)
    plan = Plan(dp=dp, tp=tp, cp=cp, cp_algo=algo, cp_layout=layout, micro_batches=M,
                check_placements=False)             # check mode's digests are traffic too
    runs = spawn(plan.world_size, train_on_rank, cfg, DATA, plan,
                 RunConfig(steps=2, global_batch=G), OptimizerConfig(lr=1e-2))
    T, rows = DATA.block_size, G // (dp * M)
    attention = cm.step_bytes(cfg, rows, T, cp, algo, tp=tp, micro_batches=M)
    assert attention > 0
    for q, run in enumerate(runs):                   # global rank q = (d cp + c) tp + t
        for step, by_axis in enumerate(run.bytes_by_axis):   # the cp group: attention only
            assert by_axis["cp"] == attention, f"rank {q}, step {step}"


def test_per_layer_volume_ring_linear_in_cp_ulysses_flat():
    """Per layer at fixed T_cp: ring (3W-2) 2N b grows with W, Ulysses 8 (W-1)/W N b does
    not (Jacobs et al. 2023, Sec. 3.2); both are zero on one rank."""
    b, rows, D, h, T_cp = 8, 2, 4, 4, 6
    N = rows * h * T_cp * D
    for W in (1, 2, 3, 4):
        cfg = model_config_for(DataConfig(task="sort", length=T_cp * W // 2), n_layer=1,
                               n_head=h, n_embd=h * D)
        T = cfg.block_size
        ring = cm.step_bytes(cfg, rows, T, W, "ring")
        uly = cm.step_bytes(cfg, rows, T, W, "ulysses") if h % W == 0 else None
        assert ring == (0 if W == 1 else (3 * W - 2) * 2 * N * b)
        if uly is not None:
            assert uly * W == 8 * (W - 1) * N * b
    calls = cm.cp_calls(cfg, rows, cfg.block_size, 2, "ring")       # the docstring's counts
    assert [c.times for c in calls] == [1, 1, 2]


def _ring_record(ctx, T):
    """One ring attention forward and backward; what ring_attention.RING_TIMES recorded."""
    ra.RING_TIMES.reset()
    P = ra.sequence_layout(T, ctx.world_size, "zigzag")
    q, k, v = (Tensor(np.random.default_rng(i).standard_normal((2, 2, T // ctx.world_size, 4)),
                      requires_grad=True) for i in range(3))
    ra.ring_attention(q, k, v, ctx.world, positions=P, T=T).sum().backward()
    t = ra.RING_TIMES
    return t.passes, [phase for phase, *_ in t.last], t.send_s, t.wait_s


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2, 3])
def test_the_ring_times_every_pass_the_byte_formula_counts(W):
    """RING_TIMES sees each message of cp_calls once (one layer): its send time on the
    worker and the compute thread's wait for it, so 1 - wait/send is defined per pass."""
    T = 12
    cfg = model_config_for(DataConfig(task="sort", length=T // 2), n_layer=1, n_head=2,
                           n_embd=8)
    calls = cm.cp_calls(cfg, 2, T, W, "ring")
    for passes, phases, send, wait in spawn(W, _ring_record, T):
        assert passes == len(phases) == sum(c.times for c in calls)
        assert [phases.count(p) for p in ("forward K/V", "backward K/V", "backward dK/dV")] \
            == [c.times for c in calls]
        assert send > 0 and wait >= 0


def test_formulas_refuse_what_does_not_split():
    cfg = model_config_for(DATA, n_layer=1, n_head=2, n_embd=8)
    with pytest.raises(ValueError, match="Ulysses"):
        cm.step_bytes(cfg, 2, 24, 4, "ulysses")             # 2 heads over 4 ranks
    with pytest.raises(ValueError, match="algo"):
        cm.step_bytes(cfg, 2, 24, 2, "tree")
    with pytest.raises(ValueError, match="cp=4"):
        cm.activation_bytes(2, 24, 8, 2, 32, cp=4, algo="ulysses")


# --- attention work per rank ------------------------------------------------------------

@pytest.mark.parametrize("W", [2, 3, 4])
def test_attention_work_zigzag_balanced_contiguous_not_ulysses_flat(W):
    T = 24
    zig, con = cm.attention_scores(T, W, "ring", "zigzag"), cm.attention_scores(T, W, "ring",
                                                                                 "contiguous")
    assert zig == ra.attention_work(T, W, "zigzag") and ra.imbalance(zig) <= 1.05
    assert ra.imbalance(con) == pytest.approx(2 * W / (W + 1), rel=1e-12)
    assert sum(zig) == sum(con) == T * T * (W + 1) // (2 * W)    # the same blocks, spread
    for layout in ("zigzag", "contiguous"):
        uly = cm.attention_scores(T, W, "ulysses", layout)
        assert uly == [T * T // W] * W and ra.imbalance(uly) == 1.0
    assert cm.attention_scores(T, 1) == [T * T]
    # nn/attention.py's cost line for the two matmuls: 2 * 2 * B * H * T * T * D flops
    assert cm.attention_flops(3, 4, 8, T * T) == 2 * 2 * 3 * 4 * T * T * 8


# --- activation memory, against autograd/saved.py -----------------------------------------

def _activations_on_rank(ctx, rows):
    W, out = ctx.world.size, {}
    H = 6 if W == 3 else 4                          # Ulysses: heads split over cp
    for algo in cm.ALGOS:
        for p in (0.0, 0.1):
            cfg = model_config_for(DATA, n_layer=2, n_head=H, n_embd=24, dropout=p)
            out[algo, p > 0] = cm.measure_layer_activations(ctx.world, cfg, rows, algo)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("cp", [pytest.param(1, marks=pytest.mark.slow), 2]
                         + [pytest.param(cp, marks=pytest.mark.slow) for cp in (3, 4)])
def test_activation_formula_equals_what_the_graph_keeps(cp):
    rows, T, C_ = 3, DATA.block_size, 24
    H = 6 if cp == 3 else 4
    runs = spawn(cp, _activations_on_rank, rows)
    for r, got in enumerate(runs):
        for algo in cm.ALGOS:
            for dropout in (False, True):
                want = cm.activation_bytes(rows, T, C_, H, 4 * C_, cp=cp, algo=algo,
                                           itemsize=8, dropout=dropout)
                assert got[algo, dropout] == want, f"rank {r}, {algo}, dropout={dropout}"
    one = tm.activation_bytes(rows, T, C_, H, 4 * C_)
    assert cm.activation_bytes(rows, T, C_, H, 4 * C_) == one      # cp = 1: the single process
    if cp > 1:
        ring, uly = (cm.activation_bytes(rows, T, C_, H, 4 * C_, cp=cp, algo=a)
                     for a in cm.ALGOS)
        assert ring < uly < one


def test_ulysses_divides_the_t2_terms_by_cp_ring_removes_them():
    B, T, C_, H, F, b = 2, 512, 128, 4, 512, 4
    one = tm.activation_terms(B, T, C_, H, F, itemsize=b)
    t2 = one["scores and softmax"]
    for W in (2, 4):
        uly = cm.activation_terms(B, T, C_, H, F, cp=W, algo="ulysses", itemsize=b)
        ring = cm.activation_terms(B, T, C_, H, F, cp=W, algo="ring", itemsize=b)
        assert uly["scores and softmax, H/cp heads, all T"] == t2 // W
        assert not any("scores" in name or "mask" in name for name in ring)
        linear = sum(v for k, v in one.items() if k != "scores and softmax")
        assert sum(uly.values()) == linear // W + t2 // W
        assert sum(ring.values()) == linear // W + B * T // W * (C_ + H) * b
