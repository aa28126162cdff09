"""The FLOP ledger counts what executes. Two references: hand counts per op (the matmul
2*M*K*N, the passes of each fused op), and NumPy itself: every op also runs on `Counted`,
an ndarray subclass that counts each ufunc call (one FLOP per output element, n - 1 per
reduction of n, 2*K per matmul output, one per add.at value; floating point only), an
implementation that shares no code with observe/op_flops.py."""

import math

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor, no_grad
from minidist.autograd import functional as F
from minidist.autograd import tensor as autograd_tensor
from minidist.autograd.tensor import Function
from minidist.autograd.split import backward_input
from minidist.nn import GPT, GPTConfig
from minidist.observe import op_flops
from minidist.observe.flops import FlopLedger
from minidist.optim import SGD, AdamW
from minidist.optim.adamw import adamw_step
from minidist.optim.sgd import sgd_step

FLOPS = [0]


def _is_float(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "fc"


def _raw(x):
    if isinstance(x, Counted):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_raw(i) for i in x)
    return x


def _wrap(r):
    if isinstance(r, np.ndarray):
        return r.view(Counted)
    if isinstance(r, np.generic) and r.dtype.kind in "fcb":
        return np.asarray(r).view(Counted)
    return r


class Counted(np.ndarray):
    """An ndarray that adds the FLOPs of each floating-point ufunc call it meets to FLOPS."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        raw = [_raw(x) for x in inputs]
        if out is not None:
            kw["out"] = tuple(_raw(o) for o in out)
        result = getattr(ufunc, method)(*raw, **kw)
        res = np.asarray(result) if result is not None else None
        if any(_is_float(x) for x in raw) or (res is not None and res.dtype.kind in "fc"):
            if method == "__call__":
                FLOPS[0] += res.size * (2 * raw[0].shape[-1] if ufunc is np.matmul else 1)
            elif method == "reduce":
                FLOPS[0] += max(raw[0].size - res.size, 0)     # 0 numbers: no add
            elif method == "at":
                FLOPS[0] += np.asarray(raw[2]).size
            else:
                raise AssertionError(f"Counted: {ufunc.__name__}.{method} is not counted")
        if method == "at":
            return None
        return out[0] if out is not None else _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        result = func(*_raw(args), **{k: _raw(v) for k, v in kwargs.items()})
        return _wrap(result) if not isinstance(result, (list, tuple)) else \
            type(result)(_wrap(r) for r in result)


class _CountingNumpy:
    """numpy, except that zeros and asarray keep arrays Counted (a gradient that starts as
    zeros, e.g. GetItem's, must be counted in the ops that use it later)."""

    def __getattr__(self, name):
        return getattr(np, name)

    def zeros(self, *args, **kwargs):
        return np.zeros(*args, **kwargs).view(Counted)

    def asarray(self, a, *args, **kwargs):
        return a if isinstance(a, Counted) and not args and not kwargs else \
            np.asarray(a, *args, **kwargs)


def numpy_count(fn) -> int:
    """FLOPs NumPy executed while fn() ran, as counted by Counted."""
    FLOPS[0] = 0
    saved, backend.xp = backend.xp, _CountingNumpy()
    try:
        fn()
    finally:
        backend.xp = saved
    return FLOPS[0]


def leaf(shape, seed=0, counted=True, grad=True):
    data = np.random.default_rng(seed).standard_normal(shape)
    return Tensor(data.view(Counted) if counted else data, requires_grad=grad)


def ledger_and_numpy(make):
    """Run make() -> output Tensor, then its backward (sum of out * a fixed weight), once
    under a ledger and counted by NumPy: ((fwd, bwd) ledger, (fwd, bwd) NumPy) in FLOPs,
    each op's own FLOPs only (the weighting outside the ledger's block)."""
    led = FlopLedger()
    with led:
        holder = []
        fwd_np = numpy_count(lambda: holder.append(make()))
        out = holder[0]
        g = np.random.default_rng(9).standard_normal(out.shape).view(Counted)
        bwd_np = numpy_count(lambda: out.backward(Tensor(g)))
    fwd = led.total("all", ("forward",))
    bwd = led.total("all", ("backward",))
    return (fwd, bwd), (fwd_np, bwd_np), led


# --- hand counts and NumPy agree with the ledger, op by op ----------------------------

B, T, C, V = 2, 5, 6, 7


@pytest.mark.parametrize("name, make, hand", [
    ("matmul", lambda: leaf((B, T, C)) @ leaf((C, V), 1),
     (2 * B * T * C * V, 4 * B * T * C * V)),
    ("batched matmul", lambda: leaf((B, 3, T, C)) @ leaf((B, 3, C, T), 1),
     (2 * B * 3 * T * C * T, 4 * B * 3 * T * C * T)),
    ("broadcast matmul", lambda: leaf((B, T, C)) @ leaf((1, C, V), 1),
     (2 * B * T * C * V, 4 * B * T * C * V + (B - 1) * C * V)),
    ("vector matmul", lambda: leaf((C,)) @ leaf((C, V), 1), (2 * C * V, 4 * C * V)),
    ("linear", lambda: leaf((B, T, C)) @ leaf((C, V), 1) + leaf((V,), 2),
     (2 * B * T * C * V + B * T * V, 4 * B * T * C * V + (B * T - 1) * V)),
    ("fused linear", lambda: F.linear(leaf((B, T, C)), leaf((C, V), 1), leaf((V,), 2)),
     (2 * B * T * C * V + B * T * V, 4 * B * T * C * V + (B * T - 1) * V)),
    ("layer norm", lambda: F.layer_norm(leaf((B, T, C)), leaf((C,), 1), leaf((C,), 2)),
     (7 * B * T * C + 3 * B * T, 8 * B * T * C + 2 * B * T * C - C + B * T * C - C)),
    ("softmax", lambda: F.softmax(leaf((B, T, C)), axis=-1),
     (5 * B * T * C - 2 * B * T, 4 * B * T * C - B * T)),
    ("log softmax", lambda: F.log_softmax(leaf((B, T, C)), axis=1),
     (5 * B * T * C - B * C, 4 * B * T * C - B * C)),
    ("gelu tanh", lambda: F.gelu(leaf((B, T, C))), (11 * B * T * C, 12 * B * T * C)),
    ("relu", lambda: F.relu(leaf((B, T, C))), (B * T * C, 2 * B * T * C)),
    ("cross entropy", lambda: F.cross_entropy(leaf((B, T, V)), np.arange(B * T).reshape(
        B, T) % V, reduction="sum"), (5 * B * T * V + 2 * B * T - 1, B * T * V + 2 * B * T)),
    ("embedding", lambda: F.embedding(leaf((V, C)), np.array([[1, 2, 1], [0, 6, 1]])),
     (0, 6 * C)),
    ("broadcast mul", lambda: leaf((B, T, C)) * leaf((T, 1), 1),
     (B * T * C, 2 * B * T * C + B * T * C - T)),
    ("div", lambda: leaf((B, C)) / (leaf((C,), 1, grad=False) + 3.0),
     (B * C + C, B * C)),
])
def test_ledger_equals_hand_count_and_numpy(name, make, hand):
    ledger, numpy_, led = ledger_and_numpy(make)
    assert ledger == hand, f"{name}: ledger {ledger} != hand count {hand}\n{led.table()}"
    assert ledger == numpy_, f"{name}: ledger {ledger} != NumPy's count {numpy_}"


def test_every_elementwise_and_reduction_rule_matches_numpy():
    x = lambda: leaf((3, 4, 5))                                         # noqa: E731
    cases = {"exp": lambda: x().exp(), "log": lambda: (x() * x()).log(),
             "tanh": lambda: x().tanh(), "neg": lambda: -x(), "sub": lambda: x() - x()[0],
             "pow2": lambda: x() ** 2, "pow3": lambda: x() ** 3, "sum": lambda: x().sum(1),
             "mean": lambda: x().mean((0, 2), keepdims=True), "max": lambda: x().max(-1),
             "mean all": lambda: x().mean(), "div both": lambda: x() / (x() * x() + 1.0),
             "masked": lambda: F.masked_fill(x(), np.eye(4, 5, dtype=bool), -1.0),
             "where": lambda: F.where(np.eye(4, 5, dtype=bool), x(), x()[:, :1]),
             "index": lambda: x()[[0, 0, 2]], "slice": lambda: x()[1:, ::2],
             "concat": lambda: F.concatenate([x(), x()], axis=1),
             "layer norm no affine": lambda: F.layer_norm(x(), None, None),
             "normalize": lambda: F.normalize(x() * x() + 1.0, axis=1),
             "sigmoid": lambda: F.sigmoid(x()),
             "cross entropy mean": lambda: F.cross_entropy(x()[0], np.array([0, 4, -100, 2])),
             "cross entropy none": lambda: F.cross_entropy(x()[0], np.array([1, 1, 3, 0]),
                                                           reduction="none")}
    for name, make in cases.items():
        ledger, numpy_, led = ledger_and_numpy(make)
        assert ledger == numpy_, f"{name}: ledger {ledger} != NumPy's count {numpy_}\n" \
                                 f"{led.table()}"


def test_exact_gelu_counts_erf_as_one_flop():
    """erf is one pass (without SciPy backend.erf leaves NumPy, so hand counts only)."""
    led = FlopLedger()
    with led:
        F.gelu(leaf((3, 4)), approximate="none").sum().backward()
    assert led.entries[("Gelu", "forward")][1] == 5 * 12             # x/sqrt2, erf, +1, *.5, *x
    assert led.entries[("Gelu", "backward")][1] == 9 * 12


def test_matmul_backward_is_twice_its_forward_unless_one_input_needs_no_gradient():
    for shapes in [((8, 6), (6, 5)), ((2, 8, 6), (6, 5)), ((2, 3, 8, 6), (2, 3, 6, 8))]:
        led = FlopLedger()
        with led:
            (leaf(shapes[0]) @ leaf(shapes[1], 1)).sum().backward()
        fwd = led.total("matmul", ("forward",))
        assert fwd == 2 * math.prod(shapes[0]) * shapes[1][-1]
        assert led.total("matmul", ("backward",)) == 2 * fwd, shapes
    led = FlopLedger()
    with led:                                           # a constant input: dW only
        (leaf((8, 6), grad=False) @ leaf((6, 5), 1)).sum().backward()
    assert led.total("matmul", ("backward",)) == led.total("matmul", ("forward",)) == 480


def test_split_backward_counts_each_half_once():
    """Zero-bubble's B and W halves call the same backward rule, masked: together they
    count what one full backward counts (MatMul's dx in B, dW in W)."""
    def run(split: bool) -> int:
        x, w = leaf((4, 6)), leaf((6, 3), 1)
        led = FlopLedger()
        with led:
            h = F.gelu(x @ w)
            out = (h @ leaf((3, 2), 2)).sum()
            if split:
                _, weight_grad = backward_input(out, None, [x])
                weight_grad.run()
            else:
                out.backward()
        return led.total("matmul", ("backward",))
    assert run(True) == run(False) == 2 * (2 * 4 * 6 * 3 + 2 * 4 * 3 * 2)


# --- phases, hooks, the engine's sums ----------------------------------------------------

class Checkpointed(Function):
    """y = gelu(x @ w) without saving h = x @ w: the backward recomputes it (activation
    recomputation in miniature)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with no_grad():
            return F.gelu(Tensor(x) @ Tensor(w)).data

    @staticmethod
    def backward(ctx, g):
        x, w = (Tensor(a, requires_grad=True) for a in ctx.saved_tensors)
        F.gelu(x @ w).backward(g)                                # recompute, then backward
        return x.grad, w.grad


def test_a_forward_inside_a_backward_is_recomputation():
    op_flops.RULES[f"{__name__}.Checkpointed"] = (op_flops._zero, op_flops._zero)
    try:
        led = FlopLedger()
        with led:
            Checkpointed.apply(leaf((4, 6)), leaf((6, 3), 1)).sum().backward()
    finally:
        del op_flops.RULES[f"{__name__}.Checkpointed"]
    mm = 2 * 4 * 6 * 3
    gelu = 11 * 4 * 3
    assert led.total("matmul", ("forward",)) == mm
    assert led.total("matmul", ("recompute",)) == mm
    assert led.total("other", ("recompute",)) == gelu
    assert led.total("matmul", ("backward",)) == 2 * mm
    assert led.model_flops() == 3 * mm                            # recomputation not in it
    assert led.hardware_flops() == 4 * mm + led.total("other")


def test_memory_recompute_shows_as_recomputation_with_the_same_model_flops():
    """memory/recompute.py: checkpoint(fn) runs fn's forward again in the backward;
    selective_attention rebuilds the attention weights and calls MatMul's backward rule
    for att @ v itself. Model FLOPs stay those of the plain graph."""
    rc = pytest.importorskip("minidist.memory.recompute")
    w = leaf((6, 6), 3)
    block = lambda x: F.gelu(x @ w) @ w                                # noqa: E731
    weights = lambda q, k: F.softmax(q @ k.transpose(0, 1, 3, 2), axis=-1)   # noqa: E731
    runs = {}
    for name, run in {"plain": lambda x, q, k, v: (block(x), weights(q, k) @ v),
                      "recompute": lambda x, q, k, v: (
                          rc.checkpoint(block, x), rc.selective_attention(weights, q, k, v))
                      }.items():
        led = FlopLedger()
        with led:
            y, a = run(leaf((4, 6)), leaf((2, 3, 5, 4), 4), leaf((2, 3, 5, 4), 5),
                       leaf((2, 3, 5, 4), 6))
            (y.sum() + a.sum()).backward()
        runs[name] = led
    plain, again = runs["plain"], runs["recompute"]
    assert again.model_flops() == plain.model_flops()
    assert again.total("matmul", ("recompute",)) == 2 * (2 * 4 * 6 * 6) + 2 * 2 * 3 * 5 * 4 * 5
    assert not again.unknown and not plain.unknown


def test_the_engines_gradient_sums_are_counted():
    """x used twice: its two gradients are added (6 adds); the second backward into the
    same leaf adds into .grad (6 more)."""
    x = leaf((2, 3))
    led = FlopLedger()
    with led:
        (x * x).sum().backward()
        (x * 2.0).sum().backward()
    assert led.entries[("grad_sum", "backward")][:2] == [0, 6 + 6]


def test_hooks_off_outside_the_block_nothing_counted_and_backward_untouched():
    before = autograd_tensor.observers            # the placement check's, in check mode
    led = FlopLedger()
    with led:
        assert autograd_tensor.observers == before + (led,)
        (leaf((3, 4)) @ leaf((4, 2), 1)).sum().backward()
        inside = led.entries.copy()
    assert autograd_tensor.observers == before
    y = leaf((3, 4)) @ leaf((4, 2), 1)
    assert y._node[0] is F.MatMul.backward                    # the plain rule, no wrapper
    with led:
        z = leaf((3, 4)) @ leaf((4, 2), 1)
    assert z._node[0] is not F.MatMul.backward                # wrapped while counting, and
    assert z._node[0].__qualname__ == "MatMul.backward"       # named as before (saved.py)
    led.reset()
    y.sum().backward()
    z.sum().backward()                                         # its wrapper, ledger stopped
    assert led.entries == {}                                   # nothing counted
    assert inside[("MatMul", "backward")][0] == 2 * 2 * 3 * 4 * 2


def test_one_ledger_at_a_time_and_unknown_ops_listed():
    class Scale(Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return (2 * g,)
    led = FlopLedger()
    with led:
        with pytest.raises(RuntimeError, match="one ledger at a time"):
            with FlopLedger():
                pass
        Scale.apply(leaf((2, 2))).sum().backward()
    assert led.unknown == {"Scale": 1}
    assert "not counted (no rule in observe/op_flops.py): Scale x1" in led.table()


# --- the optimizer ------------------------------------------------------------------------

@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_and_sgd_formulas_match_numpy(wd):
    p, g, m, v = (leaf((5, 4), s, grad=False).data for s in range(4))
    v = v * v                                                   # a second moment is >= 0
    n = numpy_count(lambda: adamw_step(p, g, m, v, lr=1e-3, b1=0.9, b2=0.99, eps=1e-8,
                                       wd=wd, t=3))
    assert n == op_flops.optimizer_flops("adamw", 20, weight_decay=wd) == (14 + 2 * bool(wd)) * 20
    for mom in (0.0, 0.9):
        buf = leaf((5, 4), 5, grad=False).data if mom else None
        n = numpy_count(lambda: sgd_step(p, g, buf, lr=0.1, momentum=mom, weight_decay=wd))
        assert n == op_flops.optimizer_flops("sgd", 20, weight_decay=wd, momentum=mom)


def test_count_optimizer_counts_the_parameters_with_a_gradient():
    a, b = leaf((3, 4)), leaf((5,), 1)
    a.grad = np.ones((3, 4))
    led = FlopLedger()
    assert led.count_optimizer(AdamW([a, b], lr=1e-3, weight_decay=0.1)) == 16 * 12 + 23
    assert led.count_optimizer(SGD([a, b], lr=1e-3), grad_norm=False) == 2 * 12
    assert led.total("other", ("optimizer",)) == 16 * 12 + 23 + 24
    with pytest.raises(ValueError, match="'adamw' or 'sgd'"):
        op_flops.optimizer_flops("lion", 3)


# --- a whole GPT step ------------------------------------------------------------------------

@pytest.mark.parametrize("tie, bias", [(True, True), (False, False)])
def test_gpt_step_all_flops_equal_numpys_count(tie, bias):
    """Every FLOP NumPy ran in a forward and backward of the GPT is in the ledger."""
    cfg = GPTConfig(vocab_size=9, block_size=8, n_layer=2, n_head=2, n_embd=8,
                    tie_weights=tie, bias=bias)
    model = GPT(cfg, 0)
    for p in model.parameters():
        p.data = p.data.view(Counted)
    x = np.arange(3 * 7).reshape(3, 7) % 9
    y = np.where(x % 3 == 0, -100, (x + 1) % 9)
    led = FlopLedger()
    with led:
        n = numpy_count(lambda: model(x, y)[1].backward())
    assert led.total("all", ("forward", "backward")) == n
    assert led.total("all", ("forward", "backward")) == led.hardware_flops()
