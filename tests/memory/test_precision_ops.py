"""Autocast's rounding rules, op by op, against float64 references computed here, and the
master weights' reason to exist: updates below half an ulp of the format accumulate."""

import ml_dtypes
import numpy as np
import pytest

from minidist.autograd import functional as F
from minidist.autograd.tensor import Tensor
from minidist.data import DataConfig, model_config_for
from minidist.memory import fp8
from minidist.memory.master_weights import MasterWeights
from minidist.memory.precision import PRECISIONS, Autocast, Policy, cast_parameters, round_to
from minidist.nn import GPT
from minidist.optim import SGD
from minidist.parallel.compose import Plan

BF16 = np.dtype(ml_dtypes.bfloat16)
ULP = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}             # spacing at 1: 2^-mantissa bits


def _data(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _representable(x, dtype) -> bool:
    return np.array_equal(np.asarray(x, np.float32).astype(dtype).astype(np.float32), x)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matmul_rounds_inputs_and_output_and_accumulates_wide(name):
    policy = Policy(name)
    a = Tensor(_data((2, 5, 64), 0), requires_grad=True)
    w = Tensor(_data((64, 7), 1), requires_grad=True)
    with Autocast(policy):
        y = a @ w
    assert y.data.dtype == policy.dtype                       # stored in the format
    ra, rw = (round_to(v.data, policy.dtype).astype(np.float64) for v in (a, w))
    exact = ra @ rw                                           # float64 on the rounded inputs
    # the output is exact up to one rounding to the format (+ fp32 accumulation, far less)
    err = np.abs(y.data.astype(np.float64) - exact)
    assert np.all(err <= ULP[name] * np.abs(exact) + 1e-6)
    assert not np.array_equal(y.data.astype(np.float32), a.data @ w.data)   # it did round
    g = _data((2, 5, 7), 2)
    y.backward(g)
    rg = round_to(g, policy.dtype).astype(np.float64)
    for got, want in ((a.grad, rg @ rw.T), (w.grad, ra.reshape(-1, 64).T @ rg.reshape(-1, 7))):
        assert got.dtype == np.float32 and _representable(got, policy.dtype)
        assert np.all(np.abs(got - want) <= ULP[name] * np.abs(want) + 1e-6)


def test_fp32_ops_run_on_upcast_inputs_and_keep_fp32_outputs():
    x16 = round_to(_data((3, 8), 3), BF16)
    x = Tensor(x16, requires_grad=True)
    w, b = (Tensor(round_to(v, BF16), requires_grad=True) for v in (_data(8, 4), _data(8, 5)))
    with Autocast(Policy("bf16")):
        outs = [F.softmax(x), F.log_softmax(x), F.layer_norm(x, w, b),
                F.cross_entropy(x, np.array([1, 2, 7]))]
    want = [F.softmax(Tensor(x16.astype(np.float32))), F.log_softmax(
        Tensor(x16.astype(np.float32))), F.layer_norm(Tensor(x16.astype(np.float32)),
                                                      w.data.astype(np.float32),
                                                      b.data.astype(np.float32)),
            F.cross_entropy(Tensor(x16.astype(np.float32)), np.array([1, 2, 7]))]
    for got, ref in zip(outs, want):                          # bitwise the fp32 op
        assert got.data.dtype == np.float32 and np.array_equal(got.data, ref.data)
    outs[-1].backward()
    assert x.grad.dtype == BF16                               # cast at the leaf, as stored


def test_elementwise_ops_follow_numpy_on_the_stored_dtypes():
    a = Tensor(round_to(_data(4, 6), BF16))
    with Autocast(Policy("bf16")):
        assert (a + a).data.dtype == BF16                     # bf16 op bf16 -> bf16
        assert (a * Tensor(np.ones(4, np.float32))).data.dtype == np.float32


def test_fp8_sites_quantise_forward_e4m3_and_gradients_e5m2():
    auto = Autocast(Policy("fp8"))
    a = Tensor(_data((4, 16), 7), requires_grad=True)
    w = Tensor(round_to(_data((16, 3), 8), BF16), requires_grad=True)
    for _ in range(2):                                        # two forwards: the same sites
        with auto:
            y = (a @ w) @ Tensor(round_to(_data((3, 2), 9), BF16))
        y.backward(np.ones((4, 2), np.float32))
    assert len(auto.sites) == 2
    fwd_a, fwd_w, grad = auto.sites[0]
    assert (fwd_a.fmt, fwd_w.fmt, grad.fmt) == (fp8.E4M3, fp8.E4M3, fp8.E5M2)
    assert len(fwd_a.history) == 2 and len(grad.history) == 2
    assert y.data.dtype == BF16
    assert y._node[1].saved_tensors[0].dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_master_weights_keep_updates_below_half_an_ulp():
    """100 SGD steps of 1e-4 on a bf16 weight of 1.0 (ulp 2^-7 = 0.0078): each step alone
    rounds back to 1.0, so only an fp32 master can get to 0.99 (Micikevicius 2018, 3.1)."""
    class P:
        def __init__(self, value):
            self.data, self.grad = np.array([value], BF16), None

    master_p, plain_p = P(1.0), P(1.0)
    mw = MasterWeights([master_p], BF16, lambda ps: SGD(ps, lr=1.0))
    plain = SGD([plain_p], lr=1.0)
    for _ in range(100):
        master_p.grad = np.array([1e-4], np.float32)
        plain_p.grad = np.array([1e-4], BF16)
        mw.step()
        plain.step()
    assert float(plain_p.data[0]) == 1.0                      # every update vanished
    assert abs(float(mw.master[0].data[0]) - 0.99) < 1e-5      # 100 fp32 roundings
    assert master_p.data[0] == BF16.type(0.99)                # the rounding of the master


def test_master_weights_unscale_exactly():
    class P:
        def __init__(self):
            self.data, self.grad = np.array([0.5, -0.25], np.float16), None

    runs = []
    for scale in (1.0, 1024.0):
        p = P()
        mw = MasterWeights([p], np.float16, lambda ps: SGD(ps, lr=0.1))
        mw.inv_scale = 1.0 / scale
        p.grad = np.array([0.125, 3.0], np.float16) * np.float16(scale)
        mw.step()
        runs.append((mw.master[0].data.copy(), p.data.copy()))
    assert all(np.array_equal(x, y) for x, y in zip(*runs))


def test_cast_parameters_stores_the_format_or_fp32_holding_rounded_values():
    cfg = model_config_for(DataConfig(task="sort", length=4), n_layer=1, n_embd=16,
                           n_head=2, dtype="float32")
    low, wide = GPT(cfg, seed=0), GPT(cfg, seed=0)
    cast_parameters(low, Policy("bf16", "low"))
    cast_parameters(wide, Policy("bf16", "fp32"))
    for p, q in zip(low.parameters(), wide.parameters()):
        assert p.data.dtype == BF16 and q.data.dtype == np.float32
        assert np.array_equal(p.data.astype(np.float32), q.data)


def test_policies_and_their_refusals():
    assert PRECISIONS == ("fp32", "bf16", "fp16", "fp8")
    assert Policy("fp16").loss_scaling and not Policy("bf16").loss_scaling
    assert Policy("fp8", "low").storage_dtype == BF16
    assert Policy("fp16", "fp32").storage_dtype == np.float32
    with pytest.raises(ValueError, match="precision='fp64'"):
        Policy("fp64")
    with pytest.raises(ValueError, match="changes nothing"):
        Autocast(Policy("fp32"))
    cfg = model_config_for(DataConfig(task="sort", length=4), n_head=2, dtype="float32")
    Plan(tp=2, precision="bf16").validate(cfg, 8, 10)         # every layout takes it
    with pytest.raises(ValueError, match="async_tp=True"):
        Plan(tp=2, sequence_parallel=True, async_tp=True, precision="bf16").validate(cfg, 8,
                                                                                     10)
    with pytest.raises(ValueError, match="dtype='float64'"):
        Plan(precision="fp16").validate(model_config_for(DataConfig(task="sort")), 8, 10)
    assert Plan(precision="fp32").policy() is None            # fp32: nothing wraps
    with pytest.raises(ValueError, match="precision='fp32' has none"):
        Plan(grad_reduce="low")


def test_train_cli_offers_every_precision():
    from minidist.train_cli import _arguments
    action = next(a for a in _arguments()._actions if a.dest == "precision")
    assert tuple(action.choices) == PRECISIONS
