"""bench/autograd.py: the profiler counts what ran and leaves no trace; the PyTorch twin
computes the same loss and gradients as nn/gpt.py (an independent implementation)."""

import numpy as np
import pytest

from minidist.autograd import Function
from minidist.bench import autograd as bench
from minidist.nn import GPT, GPTConfig

CFG = GPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8)     # float64


def test_profiler_counts_ops_and_restores_function_apply():
    apply_before = Function.__dict__["apply"]
    x, y = bench.make_batch(CFG)
    ops = bench.op_breakdown(GPT(CFG, seed=0), x, y, steps=2)
    assert Function.__dict__["apply"] is apply_before
    # per layer: qkv, proj, fc and mlp proj as Linear (+ bias), q @ k^T and att @ v as
    # MatMul; plus the tied LM head
    assert ops[("Linear", "fwd")].calls == ops[("Linear", "bwd")].calls == 4 * CFG.n_layer
    assert ops[("MatMul", "fwd")].calls == ops[("MatMul", "bwd")].calls == 2 * CFG.n_layer + 1
    assert ops[("CrossEntropy", "fwd")].calls == 1 and all(c.ms >= 0 for c in ops.values())


def test_each_op_s_flops_and_bytes_are_those_of_its_shapes():
    """The Linears of one step: forward 2 M C (3C + C + 4C + 4C) matmul FLOPs per layer
    (M = B T rows), and at least x, W, b and y moved per call; the backward twice the
    FLOPs. A matmul op is rated against the GEMM rate, an elementwise one against copy."""
    x, y = bench.make_batch(CFG)
    ops = bench.op_breakdown(GPT(CFG, seed=0), x, y, steps=2)
    M, C, item = x.size, CFG.n_embd, np.dtype(CFG.dtype).itemsize
    fwd, bwd = ops[("Linear", "fwd")], ops[("Linear", "bwd")]
    assert fwd.matmul_flops == CFG.n_layer * 2 * M * C * 12 * C
    assert bwd.matmul_flops == 2 * fwd.matmul_flops
    floor = CFG.n_layer * item * sum(M * k + k * n + n + M * n for k, n in
                                     ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)))
    assert fwd.bytes == floor                        # each array once, nothing else
    assert "of GEMM" in fwd.rate(1e9, 1e9) and "of copy" in ops[("Gelu", "fwd")].rate(1e9, 1e9)
    gemm, copy = bench.machine_rates(CFG, batch=2, repeats=2)
    assert gemm > 0 and copy > 0


def test_torch_twin_matches_loss_and_gradients():
    torch = pytest.importorskip("torch")
    model = GPT(CFG, seed=3)
    x, y = bench.make_batch(CFG, seed=1)
    y[:, :2] = -100                                       # ignored targets, as in the tasks
    _, loss = model(x, y)
    loss.backward()
    P = {n: torch.tensor(v, requires_grad=True) for n, v in model.state_dict().items()}
    ref = bench.torch_loss(P, torch.tensor(x), torch.tensor(y), CFG)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-13)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, P[name].grad.numpy(), rtol=0, atol=1e-13,
                                   err_msg=name)


def test_main_prints_a_table(capsys):
    assert bench.main(["--sizes", "tiny", "--repeats", "1", "--no-torch"]) == 0
    out = capsys.readouterr().out
    for word in ("== tiny", "forward", "backward", "optimizer", "MatMul"):
        assert word in out
