"""hardware/op_costs.py: FLOPs, compulsory bytes and launches of each op, fused and unfused.

Two references: hand counts at tiny shapes (each pass's elements written out below, one
term per pass, in the order the NumPy twin runs them), and observe/op_flops.py's rules,
which its own tests check against NumPy's ufunc calls (an implementation that shares no
code with op_costs.py)."""

from types import SimpleNamespace

import pytest

from minidist.autograd.fused import CrossEntropy, Gelu, LayerNorm, Softmax
from minidist.hardware import op_costs as oc
from minidist.observe import op_flops


def total(kernels, what):
    return sum(getattr(k, what) for k in kernels)


def check(kernels, *, matmul=0, other, bytes_, launches):
    assert (total(kernels, "matmul"), total(kernels, "other"), total(kernels, "bytes"),
            len(kernels)) == (matmul, other, bytes_, launches)


def test_gemm_hand_counts():
    # (2, 3) @ (3, 4) + b, float32: 2*2*3*4 = 48 matmul FLOPs, 8 bias adds
    fused, unfused = oc.gemm(2, 3, 4, 4, bias=True)
    check(fused, matmul=48, other=8, bytes_=4 * ((6 + 12 + 4) + 8), launches=1)
    check(unfused, matmul=48, other=8, bytes_=4 * ((6 + 12 + 8) + (8 + 4 + 8)), launches=2)
    fused, unfused = oc.gemm(2, 3, 4, 4)
    assert fused == unfused and len(fused) == 1 and fused[0].bytes == 4 * 26


def test_gemm_backward_hand_counts():
    fused, unfused = oc.gemm_backward(2, 3, 4, 4, bias=True)
    dx, dw, db = 4 * (8 + 12 + 6), 4 * (6 + 8 + 12), 4 * (8 + 4)   # g W^T, x^T g, sum g
    check(unfused, matmul=96, other=8 - 4, bytes_=dx + dw + db, launches=3)
    check(fused, matmul=96, other=4, bytes_=dx + dw + 4 * 4, launches=2)   # db in dW's epilogue


def test_layernorm_hand_counts():
    R, C, s = 2, 3, 8                     # n = 6
    fused, unfused = oc.layernorm(R, C, s)
    passes = [6 + 2, 6 + 2 + 6, 6 + 6, 6 + 2, 2 + 2, 2 + 2, 2 + 2, 6 + 2 + 6, 6 + 3 + 6, 6 + 3 + 6]
    check(unfused, other=7 * 6 + 3 * R, bytes_=s * sum(passes), launches=10)
    # read x, w, b; write y, mean, 1/std
    check(fused, other=7 * 6 + 3 * R, bytes_=s * ((6 + 3 + 3) + (6 + 2 + 2)), launches=1)


def test_layernorm_backward_hand_counts():
    R, C, s = 2, 3, 8
    fused, unfused = oc.layernorm_backward(R, C, s)
    passes = [6 + 3 + 6, 6 + 2, 6 + 2 + 6, 12 + 6, 6 + 2, 6 + 2 + 6, 12 + 6, 6 + 2 + 6,
              12 + 6, 6 + 3, 6 + 3]
    check(unfused, other=11 * 6 - 2 * C, bytes_=s * sum(passes), launches=11)
    # read x, g, w, mean, 1/std; write dx, dw, db; +2n FLOPs to rebuild xhat; 2 launches
    check(fused, other=11 * 6 - 2 * C + 12, bytes_=s * ((6 + 6 + 3 + 4) + (6 + 3 + 3)),
          launches=2)


def test_softmax_hand_counts():
    fused, unfused = oc.softmax(2, 3, 4)
    check(unfused, other=5 * 6 - 2 * 2, bytes_=4 * (8 + 14 + 12 + 8 + 14), launches=5)
    check(fused, other=26, bytes_=4 * 12, launches=1)
    fused, unfused = oc.softmax_backward(2, 3, 4)
    check(unfused, other=4 * 6 - 2, bytes_=4 * (18 + 8 + 14 + 18), launches=4)
    check(fused, other=22, bytes_=4 * 18, launches=1)


def test_scaled_masked_softmax_hand_counts():
    R, T, s = 4, 2, 4                              # n = 8; the mask is T x T numbers, added
    fused, unfused = oc.scaled_masked_softmax(R, T, s)
    check(unfused, other=8 + 8 + 5 * 8 - 2 * R,
          bytes_=s * (16 + (16 + T * T) + (12 + 20 + 16 + 12 + 20)), launches=7)
    check(fused, other=8 + 32, bytes_=s * 16, launches=1)
    fused, unfused = oc.scaled_masked_softmax_backward(R, T, s)
    check(unfused, other=4 * 8 - R + 8, bytes_=s * ((24 + 12 + 20 + 24) + 16), launches=5)
    check(fused, other=36, bytes_=s * 24, launches=1)


def test_cross_entropy_hand_counts():
    N, V, s, idx = 2, 3, 4, 4
    fused, unfused = oc.cross_entropy(N, V, s)
    floats = [8, 14, 12, 8, 14, 4, 6, 6, 4, 3]           # every pass but the gather z[t]
    check(unfused, other=5 * 6 + 2 * N - 1,               # ignored rows' store: no FLOP,
          bytes_=s * sum(floats) + N + idx * N + s * 4,   # its mask 1 byte a row
          launches=11)
    _, backward = oc.cross_entropy_backward(N, V, s)
    check(backward, other=6 + 2 * N, bytes_=s * (4 + 14) + idx * N + s * 6, launches=3)
    # one kernel for both: read z and t, write dz (in place) and the row losses
    check(fused, other=33 + 10, bytes_=s * 6 + idx * N + s * (6 + 2), launches=1)
    assert oc.cross_entropy_backward(N, V, s)[0] == ()        # nothing left for a backward


def test_attention_hand_counts():
    B, H, T, D, s = 1, 2, 3, 4, 4                   # n = 18 scores, r = 6 rows, a = 24
    fused, unfused = oc.attention(B, H, T, D, s)
    softmax = [24, 42, 36, 24, 42]
    elements = [48 + 18, 36, 36 + T * T] + softmax + [18 + 24 + 24]     # scale, + mask
    check(unfused, matmul=2 * 2 * 18 * 4, other=18 + 18 + 78, bytes_=s * sum(elements),
          launches=9)
    check(fused, matmul=288, other=96, bytes_=s * (3 * 24 + 24 + 6), launches=1)
    fused, unfused = oc.attention_backward(B, H, T, D, s)
    elements = [48 + 18, 18 + 24 + 24, 36 + 18, 18 + 6, 18 + 6 + 18, 36 + 18, 36, 66, 66]
    check(unfused, matmul=4 * 2 * 18 * 4, other=66 + 18, bytes_=s * sum(elements),
          launches=9)
    check(fused, matmul=10 * 18 * 4, other=6 * 18 + 2 * 24, bytes_=s * (5 * 24 + 6 + 3 * 24),
          launches=1)


def test_bias_gelu_hand_counts():
    R, F, s = 2, 3, 4                                 # n = 6
    fused, unfused = oc.bias_gelu(R, F, s)
    check(unfused, other=6 + 11 * 6, bytes_=s * (15 + 9 * 12 + 2 * 18), launches=12)
    check(fused, other=72, bytes_=s * (6 + 3 + 6), launches=1)
    fused, unfused = oc.bias_gelu_backward(R, F, s)
    check(unfused, other=12 * 6 + 6 - 3, bytes_=s * (8 * 12 + 4 * 18 + 9), launches=13)
    check(fused, other=75 + 9 * 6, bytes_=s * ((6 + 3 + 6) + (6 + 3)), launches=2)


def test_adamw_and_norm_hand_counts():
    fused, unfused = oc.adamw([5, 3], 4)
    check(fused, other=14 * 8, bytes_=4 * 7 * 8, launches=1)       # read p g m v, write p m v
    check(unfused, other=14 * 8, bytes_=4 * 32 * 8, launches=2 * 14)
    fused, unfused = oc.adamw([5, 3], 4, weight_decay=0.1)
    check(fused, other=16 * 8, bytes_=4 * 7 * 8, launches=1)
    check(unfused, other=16 * 8, bytes_=4 * 37 * 8, launches=2 * 16)
    fused, unfused = oc.grad_norm([5, 3], 4)
    check(fused, other=9 + 5, bytes_=4 * (8 + 1), launches=1)
    check(unfused, other=14, bytes_=4 * (5 + 1 + 3 + 1), launches=2)


def test_embedding_hand_counts():
    fused, unfused = oc.embedding(2, 3, 4, 4)             # B T C: n = 24, T C = 12
    check(fused, other=24, bytes_=4 * 6 + 4 * (24 + 12 + 24), launches=1)
    check(unfused, other=24, bytes_=(4 * 6 + 4 * 48) + (4 * 3 + 4 * 24) + 4 * (24 + 12 + 24),
          launches=3)


@pytest.mark.parametrize("R, C", [(2, 3), (7, 16), (64, 5)])
def test_unfused_flops_follow_the_ledger_rules(R, C):
    """The unfused passes do exactly the FLOPs observe/op_flops.py counts for the twin."""
    n = R * C
    ctx = SimpleNamespace(axis=-1, approximate="tanh", reduction="sum")
    fwd, bwd = op_flops.rule_for(LayerNorm)
    assert total(oc.layernorm(R, C, 4)[1], "other") == fwd(ctx, [(R, C), (C,), (C,)], None)[1]
    assert total(oc.layernorm_backward(R, C, 4)[1], "other") == \
        bwd(ctx, [(R, C), (C,), (C,)], None, (True, True, True))[1]
    fwd, bwd = op_flops.rule_for(Softmax)
    assert total(oc.softmax(R, C, 4)[1], "other") == fwd(ctx, [(R, C)], None)[1]
    assert total(oc.softmax_backward(R, C, 4)[1], "other") == \
        bwd(ctx, [(R, C)], None, (True,))[1]
    fwd, bwd = op_flops.rule_for(Gelu)
    assert total(oc.bias_gelu(R, C, 4, bias=False)[1], "other") == fwd(ctx, [(R, C)], None)[1]
    assert total(oc.bias_gelu_backward(R, C, 4, bias=False)[1], "other") == \
        bwd(ctx, [(R, C)], None, (True,))[1]
    fwd, bwd = op_flops.rule_for(CrossEntropy)
    assert total(oc.cross_entropy(R, C, 4)[1], "other") == fwd(ctx, [(R, C)], None)[1]
    assert total(oc.cross_entropy_backward(R, C, 4)[1], "other") == \
        bwd(ctx, [(R, C)], None, (True,))[1]
    assert total(oc.adamw([n, 3], 4, 0.1)[1], "other") == \
        op_flops.optimizer_flops("adamw", n + 3, weight_decay=0.1)
    assert total(oc.grad_norm([n, 3], 4)[1], "other") == op_flops.grad_norm_flops([n, 3])


@pytest.mark.parametrize("s", [8, 4, 2])
def test_fusion_never_moves_more_bytes_nor_launches_more(s):
    for fused, unfused in (oc.gemm(9, 5, 7, s, True), oc.gemm_backward(9, 5, 7, s, True),
                           oc.layernorm(9, 5, s), oc.layernorm_backward(9, 5, s),
                           oc.softmax(9, 5, s), oc.softmax_backward(9, 5, s),
                           oc.scaled_masked_softmax(10, 5, s),
                           oc.scaled_masked_softmax_backward(10, 5, s),
                           oc.attention(2, 3, 5, 4, s), oc.attention_backward(2, 3, 5, 4, s),
                           oc.bias_gelu(9, 5, s), oc.bias_gelu_backward(9, 5, s),
                           oc.cross_entropy(9, 5, s), oc.adamw([9, 5], s),
                           oc.embedding(2, 3, 4, s), oc.grad_norm([9, 5], s)):
        assert total(fused, "bytes") <= total(unfused, "bytes")
        assert len(fused) <= len(unfused)
