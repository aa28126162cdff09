"""Every layout loads the global training state, the inverse of full_params /
full_optimizer_state: the single-process run's state after k steps, or another layout's,
loaded under any Plan, reads back bitwise and trains on exactly like one process
(float64, AdamW with clipping, weight decay and dropout; SGD with momentum).

By default one layout of LAYOUTS loads and continues (DEFAULT_LAYOUT), one reshard, one
resume, one untied head and every cheap test run; the other cases are marked slow (run them
with -m slow)."""

import functools
import re

import numpy as np
import pytest

from minidist import optim
from minidist.baseline import train_single_process
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.nn import GPT
from minidist.parallel import micro_batching
from minidist.parallel import placement
from minidist.parallel.compose import build
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, _global_loss, train_on_rank
from tests.helpers import assert_close

DATA = DataConfig(task="sort", length=6, seed=2)      # V = 11 (padded under tp), T = 12
K, J, M, BATCH, LR, CLIP, WD, SEED = 2, 2, 2, 24, 1e-2, 0.05, 0.01, 0   # B / (dp M)


def _cfg(moe: bool = False, n_layer: int = 2, tied: bool = True):
    extra = dict(moe_every=1, n_experts=4, top_k=1, capacity_factor=0.8, aux_loss_coef=0.1,
                 z_loss_coef=0.01) if moe else {}
    return model_config_for(DATA, n_layer=n_layer, n_head=2, n_embd=16, dropout=0.1,
                            tie_weights=tied, **extra)


OPT = {"adamw": dict(optimizer="adamw", betas=(0.9, 0.999), momentum=0.0),
       "sgd": dict(optimizer="sgd", betas=(0.9, 0.999), momentum=0.9)}


@functools.lru_cache(maxsize=None)
def _baseline(moe: bool, n_layer: int, steps: int, opt: str = "adamw", schedule="constant",
              tied: bool = True):
    """The ground truth after `steps` steps (constant lr: its first k steps are the first k
    of any longer run)."""
    return train_single_process(_cfg(moe, n_layer, tied), DATA, steps=steps, global_batch=BATCH,
                                lr=LR, grad_accum=M, clip_grad=CLIP, weight_decay=WD,
                                lr_schedule=schedule, warmup_steps=1, **OPT[opt])


def _continue_on_rank(ctx, cfg, plan: Plan, params: dict, state: dict, *, start: int,
                      steps: int, opt: str = "adamw", schedule: str = "constant",
                      total: int = 0):
    """Build the layout, load the global state, read it back; then train `steps` steps from
    step `start` as train_on_rank does (data, dropout and lr addressed by the global step
    index; lr_at over `total` steps). Returns (loaded params, loaded state, losses, norms,
    lrs, params, state)."""
    plan.validate(cfg, BATCH, DATA.block_size)
    placement.set_checking(plan.checks)
    lay = build(ctx, plan, cfg, SEED, lr=LR, weight_decay=WD, **OPT[opt])
    engine, data = lay.engine, SyntheticData(DATA)
    engine.load_full_state(params, state)
    loaded = engine.full_params(), engine.full_optimizer_state()
    positions = None if lay.context is None else lay.context.positions(DATA.block_size)
    local, norms, lrs = [], [], []
    for step in range(start, start + steps):
        lr_s = LR if schedule == "constant" else optim.lr_at(
            step, lr=LR, warmup_steps=1, total_steps=total, min_lr=0.0)
        batches, n_tokens = micro_batching.micro_batches(data, step, BATCH, plan.dp,
                                                    lay.dp_group.rank, plan.micro_batches,
                                                    SEED, positions)
        if lay.pipeline is None:
            local.append(micro_batching.grad_accumulation(engine, batches, n_tokens))
        else:
            local.append(lay.pipeline.step(engine, batches, n_tokens))
        norms.append(float(engine.step(lr_s, CLIP)))
        lrs.append(lr_s)
    canonical = "direct" if getattr(lay.grad_group, "supports_shared", False) else "auto"
    losses = tuple(_global_loss(local, lay.grad_group, lay.pp_group, canonical))
    return (*loaded, losses, tuple(norms), tuple(lrs), engine.full_params(),
            engine.full_optimizer_state())


def _assert_bitwise(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: keys {sorted(got)} != {sorted(expected)}"
    for key, value in expected.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype and np.array_equal(got[key], value), \
                f"{what}: {key} differs (max |Δ| = {np.max(np.abs(got[key] - value)):.1e})"
        else:
            assert type(got[key]) is int and got[key] == value, f"{what}: {key} = {got[key]!r}"


def _assert_close_state(got: dict, expected: dict, what: str, atol: float) -> None:
    if atol == 0:
        return _assert_bitwise(got, expected, what)
    assert got.keys() == expected.keys(), f"{what}: keys"
    for key, value in expected.items():
        if isinstance(value, np.ndarray):
            assert_close(got[key], value, atol=atol, what=f"{what}: {key}")
        else:
            assert got[key] == value, f"{what}: {key} = {got[key]!r}, expected {value!r}"


def _assert_continues(runs, ref, what: str) -> None:
    """Every rank trained on from step K like the baseline's steps K..K+J-1."""
    for rank, (*_, losses, norms, lrs, params, state) in enumerate(runs):
        tag = f"{what}, rank {rank}"
        assert_close(losses, ref.losses[K:], atol=1e-12, what=f"{tag}: loss per step")
        assert_close(norms, ref.grad_norms[K:], atol=1e-12, what=f"{tag}: grad norm")
        assert lrs == ref.lrs[K:], f"{tag}: learning rates"
        _assert_close_state(params, ref.params, f"{tag}: params", 1e-12)
        _assert_close_state(state, ref.optimizer_state, f"{tag}: optimizer state", 1e-12)
        _assert_bitwise(params, runs[0][-2], f"{tag}: params against rank 0")


def _plan(**kw) -> Plan:
    return Plan(micro_batches=M, **kw)


# name: (Plan, MoE model, layers, optimizer)
LAYOUTS = {
    "1 rank": (_plan(), False, 2, "adamw"),
    "dp2": (_plan(dp=2), False, 2, "adamw"),                   # the buckets fast path
    "dp2 sgd": (_plan(dp=2), False, 2, "sgd"),
    "dp2 zero1": (_plan(dp=2, zero=1), False, 2, "adamw"),
    "dp2 zero2": (_plan(dp=2, zero=2), False, 2, "adamw"),
    "dp2 zero3": (_plan(dp=2, zero=3), False, 2, "adamw"),
    "dp2 zero1 sgd": (_plan(dp=2, zero=1), False, 2, "sgd"),
    "dp3 zero3": (_plan(dp=3, zero=3), False, 2, "adamw"),     # units padded to 3 shards
    "dp3 zero2 sgd": (_plan(dp=3, zero=2), False, 2, "sgd"),
    "tp2": (_plan(tp=2), False, 2, "adamw"),                   # V = 11 rows padded to 12
    "tp2 sp": (_plan(tp=2, sequence_parallel=True), False, 2, "adamw"),
    "cp2": (_plan(cp=2), False, 2, "adamw"),
    "cp2 contiguous x tp2": (_plan(cp=2, tp=2, cp_layout="contiguous"), False, 2, "adamw"),
    "pp2 1f1b": (_plan(pp=2), False, 2, "adamw"),
    "pp2 interleaved": (_plan(pp=2, schedule="interleaved"), False, 4, "adamw"),
    "pp2 gpipe zero2": (_plan(pp=2, zero=2, schedule="gpipe"), False, 2, "adamw"),
    "pp2 zb-h1 x tp2": (_plan(pp=2, tp=2, schedule="zb-h1"), False, 2, "adamw"),
    "ep2 MoE": (_plan(dp=2, ep=2), True, 2, "adamw"),
    "ep2 zero3 MoE": (_plan(dp=2, ep=2, zero=3), True, 2, "adamw"),
    "dp4 ep2 zero2 MoE": (_plan(dp=4, ep=2, zero=2), True, 2, "adamw"),  # experts over edp
    "dp2 ep2 x tp2 zero1 MoE": (_plan(dp=2, ep=2, tp=2, zero=1), True, 2, "adamw"),
    "pp2 x dp2 ep2 MoE": (_plan(pp=2, dp=2, ep=2), True, 2, "adamw"),
    "dp2 x tp2": (_plan(dp=2, tp=2), False, 2, "adamw"),
    "dp2 x tp2 sp zero3": (_plan(dp=2, tp=2, zero=3, sequence_parallel=True), False, 2,
                           "adamw"),
    "dp2 x cp2 zero3": (_plan(dp=2, cp=2, zero=3), False, 2, "adamw"),
    "dp2 x pp2 zero1": (_plan(dp=2, pp=2, zero=1), False, 2, "adamw"),
}

# the sweep: layouts of up to 4 ranks x every supported ZeRO stage x AdamW and SGD
_BASES = [(dict(dp=2), False, 2), (dict(dp=3), False, 2), (dict(dp=4), False, 2),
          (dict(tp=2), False, 2), (dict(tp=2, sequence_parallel=True), False, 2),
          (dict(cp=2), False, 2), (dict(dp=2, tp=2), False, 2), (dict(dp=2, cp=2), False, 2),
          (dict(cp=2, tp=2), False, 2), (dict(pp=2), False, 2),
          (dict(pp=2, schedule="interleaved"), False, 4), (dict(pp=2, schedule="gpipe"), False,
                                                          2),
          (dict(pp=2, schedule="zb-h1"), False, 2), (dict(pp=2, dp=2), False, 2),
          (dict(pp=2, tp=2, sequence_parallel=True), False, 2), (dict(pp=3), False, 3),
          (dict(pp=4), False, 4), (dict(dp=2, ep=2), True, 2), (dict(dp=4, ep=2), True, 2),
          (dict(dp=4, ep=4), True, 2), (dict(dp=2, ep=2, tp=2), True, 2),
          (dict(pp=2, dp=2, ep=2), True, 2)]
SLOW_LAYOUTS = {
    f"{_plan(**kw).describe()} zero{zero} {opt}{' MoE' if moe else ''}":
        (_plan(zero=zero, **kw), moe, n_layer, opt)
    for kw, moe, n_layer in _BASES for zero in range(3 if kw.get("pp", 1) > 1 else 4)
    for opt in ("adamw", "sgd")}
SLOW_LAYOUTS = {k: v for k, v in SLOW_LAYOUTS.items() if v not in LAYOUTS.values()}

# run by default: ZeRO-3's sharded params and AdamW state (the other LAYOUTS are slow; a
# cross-plan load runs by default below)
DEFAULT_LAYOUT = "dp2 zero3"


def _names(kept: str):
    """LAYOUTS' names, all but `kept` marked slow."""
    return [n if n == kept else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS]


@functools.lru_cache(maxsize=None)
def _loaded_and_continued(name: str):
    """Spawn the layout once: load the baseline's state after K steps, train J more."""
    plan, moe, n_layer, opt = {**LAYOUTS, **SLOW_LAYOUTS}[name]
    start = _baseline(moe, n_layer, K, opt)
    runs = spawn(plan.world_size, _continue_on_rank, _cfg(moe, n_layer), plan, start.params,
                 start.optimizer_state, start=K, steps=J, opt=opt)
    return start, runs, _baseline(moe, n_layer, K + J, opt)


def _round_trip(name: str) -> None:
    start, runs, _ = _loaded_and_continued(name)
    assert start.optimizer_state.get("step", K) == K
    for rank, (params, state, *_) in enumerate(runs):
        _assert_bitwise(params, start.params, f"{name}, rank {rank}: loaded params")
        _assert_bitwise(state, start.optimizer_state, f"{name}, rank {rank}: loaded state")


def _continuation(name: str) -> None:
    _, runs, ref = _loaded_and_continued(name)
    _assert_continues(runs, ref, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", _names(DEFAULT_LAYOUT))
def test_loaded_state_reads_back_bitwise(name):
    _round_trip(name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", _names(DEFAULT_LAYOUT))
def test_training_continues_from_a_loaded_state_like_one_process(name):
    _continuation(name)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_more_layouts_load_and_continue(name):
    _round_trip(name)
    _continuation(name)


@pytest.mark.multiproc
def test_lr_schedule_continues_at_the_global_step():
    # cosine over K + J steps: a layout trains the first K from the initial state (step 0
    # loaded too), another loads that and trains the last J at lr_at(K..K+J-1)
    cfg, total = _cfg(), K + J
    init = _baseline(False, 2, 0)
    ref = _baseline(False, 2, total, "adamw", "cosine")
    first = spawn(2, _continue_on_rank, cfg, _plan(dp=2, zero=2), init.params,
                  init.optimizer_state, start=0, steps=K, schedule="cosine", total=total)
    *_, lrs, params, state = first[0]
    assert lrs == ref.lrs[:K]
    runs = spawn(2, _continue_on_rank, cfg, _plan(tp=2), params, state,
                 start=K, steps=J, schedule="cosine", total=total)
    _assert_continues(runs, ref, "cosine: dp2 zero2 for K steps, then tp2")


@pytest.mark.multiproc
@pytest.mark.parametrize("plan", [_plan(tp=2),                                 # default: tp2
                                  pytest.param(_plan(pp=2, tp=2, zero=1), marks=pytest.mark.slow),
                                  pytest.param(_plan(dp=2, zero=3), marks=pytest.mark.slow)],
                         ids=["tp2", "pp2 x tp2 zero1", "dp2 zero3"])
def test_an_untied_head_loads_too(plan):
    # lm_head (C, V) is Shard(1) under tp: V = 11 columns padded to 12; under pp it lives on
    # the last stage only, wte on the first
    start, ref = _baseline(False, 2, K, tied=False), _baseline(False, 2, K + J, tied=False)
    assert "lm_head.weight" in start.params
    runs = spawn(plan.world_size, _continue_on_rank, _cfg(tied=False), plan, start.params,
                 start.optimizer_state, start=K, steps=J)
    for rank, (params, state, *_) in enumerate(runs):
        _assert_bitwise(params, start.params, f"rank {rank}: loaded params")
        _assert_bitwise(state, start.optimizer_state, f"rank {rank}: loaded state")
    _assert_continues(runs, ref, f"untied {plan.describe()}")


# --- reshard: the state of layout A after K steps, loaded into layout B ----------------

# (A, B, MoE model). No multi-rank layout is bitwise equal to the baseline (its sums run in
# another order, ~1e-16), so A's state is compared within 1e-12; the 1-rank Plan is bitwise.
RESHARD = [
    (_plan(dp=2, zero=3), _plan(tp=2), False),
    (_plan(pp=2), _plan(dp=2, zero=2), False),
    (_plan(tp=2, sequence_parallel=True), _plan(pp=2), False),
    (_plan(dp=2, ep=2), _plan(dp=2), True),
    (_plan(), _plan(dp=2, tp=2, zero=1), False),
]


def _describe(plan: Plan) -> str:
    return f"{plan.describe()}{f' zero={plan.zero}' if plan.zero else ''}"


# run by default: pp=2 -> dp=2 zero=2 (reshard, cheapest) and resuming pp=2 (it reuses that
# run's K steps); the other cases are slow
RESHARD_KEPT = 1


def _slow_but(kept: int, cases):
    return [c if i == kept else pytest.param(*c, marks=pytest.mark.slow)
            for i, c in enumerate(cases)]


@functools.lru_cache(maxsize=None)
def _trained(plan: Plan, moe: bool, steps: int):
    """train_on_rank's results on every rank, `steps` steps from the start."""
    runs = spawn(plan.world_size, train_on_rank, _cfg(moe), DATA, plan,
                 RunConfig(steps=steps, global_batch=BATCH),
                 OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP))
    for rank, run in enumerate(runs[1:], start=1):
        _assert_bitwise(run.params, runs[0].params, f"{_describe(plan)}: rank {rank}")
    return runs


@pytest.mark.multiproc
@pytest.mark.parametrize("a, b, moe", _slow_but(RESHARD_KEPT, RESHARD),
                         ids=[f"{_describe(a)} -> {_describe(b)}" for a, b, _ in RESHARD])
def test_state_saved_under_one_plan_loads_under_another(a, b, moe):
    saved = _trained(a, moe, K)[0]
    start, atol = _baseline(moe, 2, K), 0 if a.world_size == 1 else 1e-12
    _assert_close_state(saved.params, start.params, "A's params", atol)
    _assert_close_state(saved.optimizer_state, start.optimizer_state, "A's state", atol)
    runs = spawn(b.world_size, _continue_on_rank, _cfg(moe), b, saved.params,
                 saved.optimizer_state, start=K, steps=J)
    for rank, (p, s, *_) in enumerate(runs):
        _assert_bitwise(p, saved.params, f"B rank {rank}: loaded params")
        _assert_bitwise(s, saved.optimizer_state, f"B rank {rank}: loaded state")
    _assert_continues(runs, _baseline(moe, 2, K + J), f"{_describe(a)} -> {_describe(b)}")


@pytest.mark.multiproc
@pytest.mark.parametrize("plan, moe",
                         _slow_but(RESHARD_KEPT, [(a, moe) for a, _, moe in RESHARD[:4]]),
                         ids=[_describe(a) for a, *_ in RESHARD[:4]])
def test_resuming_under_the_same_plan_is_bitwise_the_uninterrupted_run(plan, moe):
    # what a step leaves in the engine (shards, flat copies, padding, m, v, t) is exactly
    # what the load writes, so K steps + save + load + J steps = K + J steps, bit for bit
    saved, straight = _trained(plan, moe, K)[0], _trained(plan, moe, K + J)
    runs = spawn(plan.world_size, _continue_on_rank, _cfg(moe), plan, saved.params,
                 saved.optimizer_state, start=K, steps=J)
    for rank, (*_, losses, norms, lrs, params, state) in enumerate(runs):
        tag = f"{_describe(plan)}, rank {rank}"
        assert losses == straight[rank].losses[K:], f"{tag}: losses"
        assert norms == straight[rank].grad_norms[K:], f"{tag}: grad norms"
        _assert_bitwise(params, straight[rank].params, f"{tag}: params")
        _assert_bitwise(state, straight[rank].optimizer_state, f"{tag}: optimizer state")


# --- engines built by hand, without a ModelSharding ------------------------------------

def _bare_engine_on_rank(ctx, zero: int, params: dict, state: dict):
    from minidist.parallel.data.buckets import BucketedDataParallel
    from minidist.parallel.zero.engine import ZeroEngine
    model = GPT(_cfg(), SEED)
    engine = BucketedDataParallel(model, ctx.world, lr=LR) if zero == 0 else \
        ZeroEngine(model, ctx.world, zero, lr=LR)
    engine.load_full_state(params, state)
    return engine.full_params(), engine.full_optimizer_state()


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [0, 3])
def test_engines_without_sharding_load_the_whole_model(zero):
    start = _baseline(False, 2, K)
    for rank, (p, s) in enumerate(spawn(2, _bare_engine_on_rank, zero, start.params,
                                        start.optimizer_state)):
        _assert_bitwise(p, start.params, f"zero={zero} rank {rank}: params")
        _assert_bitwise(s, start.optimizer_state, f"zero={zero} rank {rank}: state")


# --- validation: what cannot be loaded is a ValueError naming the key ------------------

def _bad_inputs(params: dict, state: dict, sgd_state: dict):
    """(what, params, state, the message expected) of every way a load must fail."""
    def without(d, key):
        return {k: v for k, v in d.items() if k != key}

    def replaced(d, key, value):
        return {**d, key: value}

    return [
        ("missing param", without(params, "blocks.1.mlp.fc.bias"), state,
         r"params has no 'blocks.1.mlp.fc.bias'"),
        ("unexpected param", {**params, "blocks.7.attn.qkv.weight": params["wte.weight"]},
         state, r"unexpected key 'blocks.7.attn.qkv.weight'"),
        ("wrong shape", replaced(params, "wpe.weight", params["wpe.weight"].T.copy()), state,
         r"params\['wpe.weight'\] has shape \(16, 12\).*expected .*shape \(12, 16\)"),
        ("wrong dtype", replaced(params, "ln_f.bias", params["ln_f.bias"].astype(np.float32)),
         state, r"params\['ln_f.bias'\] .*dtype float32.*dtype float64"),
        ("not an array", replaced(params, "ln_f.weight", params["ln_f.weight"].tolist()), state,
         r"params\['ln_f.weight'\] is a list"),
        ("missing state", params, without(state, "v.3"), r"no 'v.3' \(the state of parameter 3"),
        ("unexpected state", params, {**state, "m.99": state["m.0"]},
         r"unexpected key 'm.99'; AdamW keeps 'step', 'm.i', 'v.i' \(i < 28\)"),
        ("state shape", params, replaced(state, "m.0", state["m.0"][:3]),
         r"optimizer_state\['m.0'\] \(parameter 'wte.weight'\) has shape \(3, 16\)"),
        ("state dtype", params, replaced(state, "v.5", state["v.5"].astype(np.float32)),
         r"optimizer_state\['v.5'\].*dtype float32"),
        ("no step", params, without(state, "step"),
         r"optimizer_state has no 'step'; AdamW keeps 'step'"),
        ("bad step", params, replaced(state, "step", 2.0), r"'step' an int >= 0"),
        ("SGD into AdamW", params, sgd_state,
         r"holds \['momentum_buffer'\] state, but this engine's optimizer is AdamW"),
    ]


def _validation_on_rank(ctx, plan: Plan, init, params: dict, state: dict, sgd_state: dict):
    """Load `init`, try every bad load (of the other arrays), then AdamW state into an SGD
    engine; the messages, and the state after them (a refused load writes nothing)."""
    placement.set_checking(plan.checks)
    lay = build(ctx, plan, _cfg(), SEED, lr=LR, weight_decay=WD, **OPT["adamw"])
    lay.engine.load_full_state(init.params, init.optimizer_state)
    messages = {}
    for what, p, s, _ in _bad_inputs(params, state, sgd_state):
        try:
            lay.engine.load_full_state(p, s)
            messages[what] = None
        except ValueError as e:
            messages[what] = str(e)
    after = lay.engine.full_params(), lay.engine.full_optimizer_state()
    sgd = build(ctx, plan, _cfg(), SEED, lr=LR, weight_decay=WD, **OPT["sgd"])
    try:
        sgd.engine.load_full_state(params, state)
        messages["AdamW into SGD"] = None
    except ValueError as e:
        messages["AdamW into SGD"] = str(e)
    return messages, after


@pytest.mark.multiproc
@pytest.mark.parametrize("plan", [Plan(dp=2, micro_batches=M),
                                  Plan(tp=2, zero=0, micro_batches=M),
                                  Plan(dp=2, zero=3, micro_batches=M)],
                         ids=["dp2", "tp2", "dp2 zero3"])
def test_what_cannot_be_loaded_is_a_value_error_naming_the_key(plan):
    init, start, sgd = _baseline(False, 2, 0), _baseline(False, 2, K), \
        _baseline(False, 2, K, "sgd")
    cases = _bad_inputs(start.params, start.optimizer_state, sgd.optimizer_state)
    for rank, (messages, (params, state)) in enumerate(spawn(
            plan.world_size, _validation_on_rank, plan, init, start.params,
            start.optimizer_state, sgd.optimizer_state)):
        for what, _, _, pattern in cases:
            assert messages[what] is not None, f"rank {rank}: {what} was loaded"
            assert re.search(pattern, messages[what]), \
                f"rank {rank}: {what}: {messages[what]!r} does not match {pattern!r}"
        assert "optimizer is SGD (momentum=0.9)" in messages["AdamW into SGD"], messages
        assert "kind mismatch" in messages["AdamW into SGD"]
        _assert_bitwise(params, init.params, f"rank {rank}: params after refused loads")
        _assert_bitwise(state, init.optimizer_state, f"rank {rank}: state after refused loads")


def _pieces_on_rank(ctx):
    """(this tp rank's initialised parameters, local_values of the full draw)."""
    lay = build(ctx, Plan(tp=2, micro_batches=M), _cfg(), SEED, lr=LR, weight_decay=WD,
                **OPT["adamw"])
    full = GPT(_cfg(), SEED).state_dict()
    return ({n: p.data.copy() for n, p in zip(lay.sharding.names, lay.sharding.params)},
            lay.sharding.local_values(full))


@pytest.mark.multiproc
def test_local_values_cut_like_initialisation():
    # the pieces of the full draw are exactly the parameters each tp rank initialised with
    # (placement.shard, the padded vocabulary rows zero)
    for rank, (mine, cut) in enumerate(spawn(2, _pieces_on_rank)):
        assert list(mine) == list(cut), f"rank {rank}: names"
        for name in mine:
            assert np.array_equal(mine[name], cut[name]), f"rank {rank}: {name}"
