"""Activation recomputation changes memory and time, never a number: full and selective
recomputation give bitwise the loss, gradients and trained parameters of no recomputation
(dropout and MoE on), in one process and under dp, ZeRO 1-3, tp (+SP), pp, ep and (full
only) cp; what a layer keeps for its backward equals recompute.kept_terms' formula;
checkpoint() is exact for any function, counts MoE routing once and nests without a third
forward.

The default run takes two parallel layouts (tp + SP, and cp with full recomputation) and
the tp + SP kept bytes; `-m slow` adds the other layouts and tp without SP."""

import dataclasses

import numpy as np
import pytest

from minidist import train_cli as train, train_options
from minidist.autograd import Tensor, no_grad
from minidist.autograd.saved import saved_bytes
from minidist.baseline import train_single_process
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.memory import recompute as rc
from minidist.nn import GPT, DropoutKey, GPTConfig, Linear
from minidist.parallel.context.context_parallel import ContextParallel, apply_context
from minidist.parallel.tensor import memory as tm
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

DATA = DataConfig(task="sort", length=4, seed=1)                  # V = 11, T = 8
STEPS, M = 2, 2
NAMES = {"full": "Block.layers", "selective": "attention_weights"}


def _cfg(moe_every: int = 2, recompute: str = "none", **kw) -> GPTConfig:
    return model_config_for(DATA, n_layer=2, n_head=2, n_embd=16, dropout=0.1, top_k=2,
                            moe_every=moe_every, z_loss_coef=0.01 if moe_every else 0.0,
                            recompute=recompute, **kw)


def _bitwise(a, b, what: str) -> None:
    """Two runs (TrainResult or RankResult) hold bitwise the same numbers."""
    assert a.losses == b.losses, f"{what}: losses {a.losses} != {b.losses}"
    assert a.grad_norms == b.grad_norms, f"{what}: grad norms"
    for name, p in a.params.items():
        assert np.array_equal(p, b.params[name]), f"{what}: param {name}"
    for key, s in a.optimizer_state.items():
        assert np.array_equal(np.asarray(s), np.asarray(b.optimizer_state[key])), \
            f"{what}: optimizer state {key}"


def _delta(before: dict, name: str) -> int:
    return rc.counts().get(name, 0) - before.get(name, 0)


# --- the switch ----------------------------------------------------------------------------

def test_config_accepts_the_three_policies_and_refuses_others():
    assert [_cfg(recompute=m).recompute for m in rc.MODES] == ["none", "selective", "full"]
    assert GPTConfig().recompute == "none"
    with pytest.raises(ValueError, match="recompute='partial' is not a policy; choose 'none'"):
        _cfg(recompute="partial")
    # an execution choice: it stays out of repr, which a checkpoint must agree on to resume
    assert repr(_cfg(recompute="full")) == repr(_cfg())


def test_cli_passes_recompute_and_refuses_selective_with_context_parallelism():
    args = ["--task", "sort", "--length", "4", "--n-embd", "16", "--n-head", "2"]
    job = train_options.resolve(train._arguments().parse_args(args + ["--recompute", "full"]))
    assert job.cfg.recompute == "full"
    with pytest.raises(ValueError, match="--recompute selective .* use --recompute full"):
        train_options.resolve(train._arguments().parse_args(args + ["--recompute", "selective",
                                                                    "--cp", "2"]))


def test_selective_attention_under_context_parallelism_is_refused():
    model = GPT(_cfg(0, "selective"), seed=0)
    with pytest.raises(ValueError, match="context parallelism: selective recomputation"):
        apply_context(model, ContextParallel(group=None))


# --- one process -----------------------------------------------------------------------------

@pytest.mark.parametrize("moe_every", [0, 2])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_training_is_bitwise_equal_to_no_recomputation(mode, moe_every):
    kw = dict(steps=STEPS, global_batch=4, lr=1e-2, grad_accum=M, clip_grad=0.05)
    ref = train_single_process(_cfg(moe_every), DATA, **kw)
    before = rc.counts()
    run = train_single_process(_cfg(moe_every, mode), DATA, **kw)
    _bitwise(ref, run, f"recompute={mode}, moe_every={moe_every}")
    assert _delta(before, NAMES[mode]) == 2 * M * STEPS            # layers x micro-batches


@pytest.mark.parametrize("mode", rc.MODES)
def test_moe_routing_and_aux_loss_are_counted_once(mode):
    cfg = _cfg(moe_every=1, recompute=mode)                      # both blocks are MoE
    model = GPT(cfg, 0)
    idx, targets = SyntheticData(DATA).global_batch(0, 4)
    _, loss = model(idx, targets, dropout_key=DropoutKey(0, 0, tuple(range(4))))
    loss.backward()
    ref = GPT(_cfg(moe_every=1), 0)
    with no_grad():                                   # one forward, nothing recomputed
        _, ref_loss = ref(idx, targets, dropout_key=DropoutKey(0, 0, tuple(range(4))))
    assert loss.item() == ref_loss.item()
    for block, plain in zip(model.blocks, ref.blocks):
        got, want = block.moe.take_totals(), plain.moe.take_totals()
        assert np.array_equal(got, want), f"{mode}: routing totals {got} != {want}"
        assert got[-1] == 4 * DATA.block_size // cfg.routing_group     # groups, once


B, T, C, H = 3, 8, 16, 2


def _block_bytes(cfg: GPTConfig, layer: int = 0) -> int:
    model = GPT(cfg, 0)
    x = Tensor(np.random.default_rng(0).standard_normal((B, T, C)), requires_grad=True)
    key = DropoutKey(0, 0, tuple(range(B))) if cfg.dropout else None
    y, _ = model.blocks[layer](x, key)
    return saved_bytes(y, exclude=model.parameters())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", rc.MODES)
def test_kept_bytes_per_layer_equal_the_formula(mode, dropout):
    cfg = GPTConfig(vocab_size=11, block_size=T, n_embd=C, n_head=H, dropout=dropout,
                    recompute=mode)
    assert _block_bytes(cfg) == rc.kept_bytes(mode, B, T, C, H, 4 * C, dropout=dropout > 0)
    none = tm.activation_terms(B, T, C, H, 4 * C, dropout=dropout > 0)
    assert rc.kept_terms("none", B, T, C, H, 4 * C, dropout=dropout > 0) == none
    T2 = 2 * B * H * T * T * 8 * (2 if dropout else 1)           # the T^2 terms, by hand
    assert rc.kept_bytes("selective", B, T, C, H, 4 * C, dropout=dropout > 0) == \
        sum(none.values()) - T2 + 8 * T
    assert rc.kept_bytes("full", B, T, C, H, 4 * C) == B * T * C * 8


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (4, True)])
def test_no_recomputation_terms_equal_tensor_memorys(tp, sp):
    for dropout in (False, True):                 # two writings of one formula, term by term
        assert rc.kept_terms("none", 2, 8, 16, 4, 64, tp=tp, sp=sp, dropout=dropout) == \
            tm.activation_terms(2, 8, 16, 4, 64, tp=tp, sp=sp, dropout=dropout)
    with pytest.raises(ValueError, match="divide by tp=3"):
        rc.kept_terms("full", 2, 8, 16, 4, 64, tp=3)


def test_full_recomputation_keeps_only_the_input_of_a_moe_block():
    cfg = GPTConfig(vocab_size=11, block_size=T, n_embd=C, n_head=H, dropout=0.1,
                    moe_every=1, recompute="full")
    assert _block_bytes(cfg) == B * T * C * 8
    assert _block_bytes(dataclasses.replace(cfg, recompute="none")) > 20 * B * T * C * 8


def _layer_bytes_on_rank(ctx, sp):
    out = {}
    for mode in rc.MODES:
        for p in (0.0, 0.1):
            cfg = model_config_for(DataConfig(task="sort", length=6), n_layer=1, n_head=4,
                                   n_embd=16, dropout=p, recompute=mode)       # T = 12
            out[mode, p] = tm.measure_layer_activations(ctx.world, cfg, 2, sp)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True])
def test_kept_bytes_under_tensor_parallelism_equal_the_formula(sp):
    for rank, got in enumerate(spawn(2, _layer_bytes_on_rank, sp)):
        for (mode, p), measured in got.items():
            want = rc.kept_bytes(mode, 2, 12, 16, 4, 64, tp=2, sp=sp, dropout=p > 0)
            assert measured == want, f"rank {rank}, {mode}, dropout {p}, sp={sp}"


# --- checkpoint() on any function ------------------------------------------------------------

def _fn_and_inputs(returns: str):
    lin = Linear(4, 4)
    lin.weight.data[...] = np.random.default_rng(1).standard_normal((4, 4))
    lin.bias.data[...] = 0.1
    xs = [Tensor(np.random.default_rng(s).standard_normal((3, 4)), requires_grad=True)
          for s in (2, 3)]

    def fn(a, scale, b):
        y = (lin(a) * scale).tanh() + b * b
        if returns == "tensor":
            return y
        return (y, (y * y).mean()) if returns == "pair" else (y, None)
    return lin, xs, fn


def _grads(lin, xs, out) -> list:
    y, aux = out if isinstance(out, tuple) else (out, None)
    loss = (y * y).sum() + (aux * 3.0 if aux is not None else 0.0)
    loss.backward()
    return [loss.data, lin.weight.grad, lin.bias.grad, *[x.grad for x in xs]]


@pytest.mark.parametrize("returns", ["tensor", "pair", "with_none"])
def test_checkpoint_gives_the_plain_gradients_bitwise(returns):
    lin, xs, fn = _fn_and_inputs(returns)
    want = _grads(lin, xs, fn(xs[0], 0.5, xs[1]))
    lin.zero_grad()
    for x in xs:
        x.zero_grad()
    out = rc.checkpoint(fn, xs[0], 0.5, xs[1])
    if returns == "with_none":
        assert out[1] is None
    got = _grads(lin, xs, out)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert saved_bytes(out[0] if isinstance(out, tuple) else out) >= 2 * 3 * 4 * 8


def test_checkpoint_reaches_the_parameters_when_no_input_needs_a_gradient():
    lin, xs, fn = _fn_and_inputs("tensor")
    frozen = [Tensor(x.data) for x in xs]
    want = _grads(lin, [], fn(frozen[0], 2.0, frozen[1]))
    lin.zero_grad()
    got = _grads(lin, [], rc.checkpoint(fn, frozen[0], 2.0, frozen[1]))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_checkpoint_without_a_graph_or_nested_runs_the_function_once():
    lin, xs, fn = _fn_and_inputs("tensor")
    with no_grad():
        y = rc.checkpoint(fn, xs[0], 1.0, xs[1])
    assert y._node is None and y.data.shape == (3, 4)
    calls = []

    def inner(a, b):
        calls.append("inner")
        return fn(a, 1.0, b)

    def outer(a, b):
        calls.append("outer")
        return rc.checkpoint(inner, a, b) * 2.0
    want = _grads(lin, xs, outer(xs[0], xs[1]))
    lin.zero_grad()
    for x in xs:
        x.zero_grad()
    calls.clear()
    got = _grads(lin, xs, rc.checkpoint(outer, xs[0], xs[1]))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # forward once (no graph: inner runs plainly), recomputation once (inner plain again)
    assert calls == ["outer", "inner", "outer", "inner"]


def test_checkpoint_refuses_what_cannot_travel_as_one_tensor():
    x = Tensor(np.ones(3), requires_grad=True)
    with pytest.raises(ValueError, match="returned list"):
        rc.checkpoint(lambda a: [a * 2.0], x)
    with pytest.raises(ValueError, match="all of one dtype"):
        rc.checkpoint(lambda a: (a * 2.0, Tensor(np.ones(1, np.float32))), x)
    with pytest.raises(ValueError, match="recompute='some' is not a policy"):
        rc.kept_bytes("some", 1, 2, 4, 2, 16)


def test_on_recompute_sees_each_rebuild_before_its_backward():
    lin, xs, fn = _fn_and_inputs("tensor")
    seen = []
    with rc.on_recompute(lambda name, out: seen.append((name, out.shape, saved_bytes(out)))):
        _grads(lin, xs, rc.checkpoint(fn, xs[0], 1.0, xs[1]))
    assert [s[:2] for s in seen] == [(fn.__qualname__, (3, 4))] and seen[0][2] > 0
    _grads(lin, xs, rc.checkpoint(fn, xs[0], 1.0, xs[1]))
    assert len(seen) == 1                                   # the watcher is gone


# --- parallel layouts: the same Plan with and without recomputation -------------------------

def _policies_on_rank(ctx, cfg, plan, batch, modes):
    out = {}
    for mode in modes:
        before = rc.counts()
        run = train_on_rank(ctx, dataclasses.replace(cfg, recompute=mode), DATA, plan,
                            RunConfig(steps=STEPS, global_batch=batch),
                            OptimizerConfig(lr=1e-2, clip_grad=0.05))
        out[mode] = run, {n: _delta(before, n) for n in NAMES.values()}
    return out


LAYOUTS = [dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
           dict(tp=2), dict(tp=2, sequence_parallel=True), dict(pp=2),
           dict(pp=2, schedule="zb-h1"), dict(dp=2, ep=2), dict(cp=2),
           dict(cp=2, cp_algo="ulysses")]
DEFAULT_LAYOUTS = (dict(tp=2, sequence_parallel=True), dict(cp=2))    # the rest: slow


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [d if d in DEFAULT_LAYOUTS else
                                    pytest.param(d, marks=pytest.mark.slow) for d in LAYOUTS],
                         ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_every_layout_trains_bitwise_equal_with_recomputation(layout):
    plan = Plan(micro_batches=M, **layout)
    cfg = _cfg(moe_every=0 if plan.sequence_parallel or plan.cp > 1 else 2)   # MoE where
    modes = rc.MODES if plan.cp == 1 else ("none", "full")    # it may go; cp: no selective
    runs = spawn(plan.world_size, _policies_on_rank, cfg, plan, 2 * M * plan.dp, modes)
    layers = cfg.n_layer // plan.pp
    for rank, out in enumerate(runs):
        for mode in modes[1:]:
            _bitwise(out["none"][0], out[mode][0], f"{layout}, rank {rank}, {mode}")
            want = layers * M * STEPS                 # ZeRO-3 too: it keeps the graphs
            assert out[mode][1][NAMES[mode]] == want, f"{layout}, rank {rank}, {mode}"
