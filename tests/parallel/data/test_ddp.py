"""Data parallelism must be invisible in the numbers: W ranks, each taking 1/W of every
global batch, train exactly like one process taking all of it, and stay bitwise identical.
The plain engine (one all-reduce per parameter, parallel/data/ddp.py) and the bucketed fast path
(parallel/data/buckets.py) must give the same bits.

The default run takes one representative per sweep (W = 2 or 3, one algorithm, the buckets'
overlap); `-m slow` runs the other cases and the 8-rank run with clipping and a schedule."""

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.collectives import direct_small
from minidist.data import DataConfig, SyntheticData, model_config_for
from minidist.nn import GPT, GPTConfig
from minidist.parallel import micro_batching
from minidist.parallel.compose import build
from minidist.parallel.data.buckets import BucketedDataParallel, plan_buckets
from minidist.parallel.data.ddp import ALGOS, DataParallel, ReplicaDivergence
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_close, assert_runs_match, configs

DATA = DataConfig(task="sort", length=4)
TINY = model_config_for(DATA, n_layer=2, n_embd=16, n_head=2, dtype="float64")
STEPS, GLOBAL_BATCH, LR, WD = 3, 24, 1e-2, 0.01      # 24 splits over W x M in every case
SMALL_BUCKET = 2048                                    # several buckets for the tiny GPT


def _engine(buckets: bool) -> type:
    """The fast path (shared-memory buckets) or the plain engine."""
    return BucketedDataParallel if buckets else DataParallel


CASES = [  # (W, micro_batches, extra Plan fields)
    (1, 1, {}), (1, 2, {}), (2, 1, {}), (2, 2, {"overlap": False}),
    (3, 1, {"algo": "ring"}), (3, 2, {"replica_check_every": 1}),
    (4, 1, {"bucket_bytes": 1 << 20}), (4, 2, {}),
]
# default (by index): W=2 M=2 without overlap, W=3 M=2 with the replica check; rest slow
DEFAULT = (3, 5)
CASES = [c if i in DEFAULT else pytest.param(*c, marks=pytest.mark.slow)
         for i, c in enumerate(CASES)]


@pytest.mark.multiproc
@pytest.mark.parametrize("W, M, extra", CASES)
def test_dp_training_matches_single_process(W, M, extra):
    ref = train_single_process(TINY, DATA, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                               weight_decay=WD, grad_accum=M)           # the ground truth
    plan = Plan(**{"dp": W, "micro_batches": M, "bucket_bytes": SMALL_BUCKET, **extra})
    runs = spawn(W, train_on_rank, TINY, DATA, plan,
                 RunConfig(steps=STEPS, global_batch=GLOBAL_BATCH),
                 OptimizerConfig(lr=LR, weight_decay=WD))
    assert_runs_match(runs, ref, f"W={W} M={M} {extra}")


@pytest.mark.slow       # clipping under dp: test_gradient_clipping_uses_the_global_norm (ZeRO)
@pytest.mark.multiproc
def test_dp_on_8_ranks_with_clipping_and_a_schedule():
    kw = dict(steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip_grad=0.5, warmup_steps=1,
              lr_schedule="cosine", min_lr=1e-3)
    ref = train_single_process(TINY, DATA, **kw)
    runs = spawn(8, train_on_rank, TINY, DATA, Plan(dp=8, bucket_bytes=SMALL_BUCKET),
                 *configs(**kw))
    assert max(ref.grad_norms) > 0.5                     # clipping really happened
    assert_runs_match(runs, ref, "W=8 clip 0.5, cosine")


def _shares(n, W):
    return [len(c) for c in np.array_split(np.empty(n), W)]


@pytest.mark.multiproc
@pytest.mark.parametrize("algo", ["direct", pytest.param("ring", marks=pytest.mark.slow)])
def test_bytes_per_step_equal_the_formula(algo):
    W = 3                                                 # Ψ and buckets not divisible by 3
    runs = spawn(W, train_on_rank, TINY, DATA,
                 Plan(dp=W, bucket_bytes=SMALL_BUCKET,
                                                    algo=algo),
                 RunConfig(steps=2, global_batch=GLOBAL_BATCH), OptimizerConfig(lr=LR))
    params = GPT(TINY).parameters()
    psi = sum(p.size for p in params)
    sizes = [sum(params[i].size for i in b) for b in plan_buckets(params, SMALL_BUCKET)]
    assert len(sizes) > 2 and psi % W
    for step in range(2):
        sent = [run.bytes_per_step[step]["sent"] for run in runs]
        recv = [run.bytes_per_step[step]["recv"] for run in runs]
        # DP moves 2(W-1)/W Ψ elements per rank per step: exactly, summed over the ranks.
        assert sum(sent) == sum(recv) == 2 * (W - 1) * psi * 8
        for r in range(W):
            if algo == "direct":        # peers read N - n_r of my inputs, W-1 times my share
                elems = sum(n + (W - 2) * _shares(n, W)[r] for n in sizes)
            else:                       # ring: every chunk but mine, then all but my right's
                elems = sum(2 * n - _shares(n, W)[r] - _shares(n, W)[(r + 1) % W]
                            for n in sizes)
            assert sent[r] == elems * 8, f"{algo}: rank {r} sent {sent[r]} B"
            assert abs(sent[r] / 8 - 2 * (W - 1) / W * psi) <= (W - 2) * len(sizes)


def _overlap_probe(ctx, overlap, fast):
    """Return (no_sync stayed silent, collectives started when backward returned, total)."""
    model = GPT(TINY)
    dp = _engine(fast)(model, ctx.world, lr=LR, bucket_bytes=SMALL_BUCKET, overlap=overlap)
    assert isinstance(dp, BucketedDataParallel) is fast
    started = (lambda: dp._next) if fast else (lambda: len(dp._works))
    x, y = SyntheticData(DATA).global_batch(0, 4)                # (4, T) each
    sent0 = ctx.world.stats["bytes_sent"]
    with dp.no_sync():
        dp.forward(x, y, n_tokens=16)[1].backward()
    quiet = ctx.world.stats["bytes_sent"] == sent0 and started() == 0
    dp.forward(x, y, n_tokens=16)[1].backward()
    launched = started()
    dp.step(LR)
    return quiet, launched, len(dp.buckets) if fast else len(dp.params)


@pytest.mark.multiproc
@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["buckets", "plain"])           # the fast path by default
def test_all_reduces_start_during_backward_and_no_sync_stays_silent(fast):
    for overlap, expect_all in ((True, True), (False, False)):
        for quiet, launched, n in spawn(2, _overlap_probe, overlap, fast):
            assert quiet, "no_sync() backward communicated or launched an all-reduce"
            assert n > 2 and launched == (n if expect_all else 0), (overlap, launched, n)


def _diverge_on_rank(ctx):
    model = GPT(TINY)
    dp = DataParallel(model, ctx.world, lr=LR, replica_check_every=1)
    dp.check_replicas()                                  # identical from the seed: passes
    if ctx.rank == 2:
        model.blocks[1].mlp.fc.weight.data[0, 0] += 1e-15
    dp.check_replicas()


@pytest.mark.multiproc
def test_replica_check_names_the_rank_and_tensor_that_drifted():
    with pytest.raises(RankFailure, match=r"dp ranks \[2\] differ.*blocks\.1\.mlp\.fc\.weight"):
        spawn(3, _diverge_on_rank)
    assert issubclass(ReplicaDivergence, RuntimeError)


def test_buckets_are_reverse_order_and_bounded():
    params = GPT(TINY).parameters()
    buckets = plan_buckets(params, SMALL_BUCKET)
    flat = [i for b in buckets for i in b]
    assert flat == list(reversed(range(len(params))))          # every parameter, once
    for b in buckets:
        nbytes = sum(params[i].data.nbytes for i in b)
        assert nbytes <= SMALL_BUCKET or len(b) == 1
    assert [len(b) for b in plan_buckets(params, 1)] == [1] * len(params)
    assert len(plan_buckets(params, 1 << 30)) == 1


@pytest.mark.parametrize("bad", [0, -8, 1.5, True])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(GPT(TINY).parameters(), bad)
    with pytest.raises(ValueError, match="bucket_bytes"):
        Plan(bucket_bytes=bad)


def _backward_twice(ctx, fast):
    dp = _engine(fast)(GPT(TINY), ctx.world, lr=LR, bucket_bytes=SMALL_BUCKET)
    x, y = SyntheticData(DATA).global_batch(0, 2)
    dp.forward(x, y, n_tokens=8)[1].backward()             # launches every all-reduce
    with pytest.raises(RuntimeError, match="after its all-reduce started; call step"):
        with dp.no_sync():
            dp.forward(x, y, n_tokens=8)[1].backward()
    dp.step(LR)
    dp.forward(x, y, n_tokens=8)[1].backward()             # fine again after step()
    dp.step(LR)
    if fast:                                               # .grad is a view into a bucket
        dp.params[0].grad = None
        with pytest.raises(RuntimeError, match="was replaced"):
            dp.step(LR)
    return True


@pytest.mark.multiproc
@pytest.mark.parametrize("fast", [True, False], ids=["buckets", "plain"])
def test_backward_into_a_gradient_being_reduced_is_refused(fast):
    assert spawn(2, _backward_twice, fast) == [True, True]


# --- the plain engine and the fast path -------------------------------------------------

def _train_both_paths(ctx, M, algo="direct", paths=(False, True)):
    """Train 3 AdamW steps with the plain engine, then with the buckets, from one seed."""
    W, data, out = ctx.world_size, SyntheticData(DATA), {}
    for fast in paths:
        dp = _engine(fast)(GPT(TINY), ctx.world, lr=LR, weight_decay=WD, algo=algo,
                           bucket_bytes=SMALL_BUCKET)
        assert type(dp) is (BucketedDataParallel if fast else DataParallel)
        norms, sent = [], []
        for step in range(STEPS):
            batches, n = micro_batching.micro_batches(data, step, GLOBAL_BATCH, W, ctx.rank, M, 0)
            before = ctx.world.stats["bytes_sent"]
            micro_batching.grad_accumulation(dp, batches, n)
            norms.append(dp.step(LR))
            sent.append(ctx.world.stats["bytes_sent"] - before)
        out[fast] = (dp.full_params(), norms, sent, dp.full_optimizer_state())
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_plain_and_bucketed_paths_give_the_same_bits(W):
    M = 2
    runs = spawn(W, _train_both_paths, M)
    ref = train_single_process(TINY, DATA, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                               weight_decay=WD, grad_accum=M)
    psi = sum(p.size for p in GPT(TINY).parameters())
    for rank, run in enumerate(runs):
        (plain, plain_norms, _, plain_state), (fast, fast_norms, _, fast_state) = \
            run[False], run[True]
        assert plain.keys() == fast.keys() == ref.params.keys()
        for name, p in plain.items():     # bitwise: both fold each element in rank order
            assert p.tobytes() == fast[name].tobytes(), f"W={W} rank {rank}: {name} differs"
            assert_close(p, ref.params[name], atol=1e-12, what=f"rank {rank}: {name}")
        for key, s in plain_state.items():
            assert np.asarray(s).tobytes() == np.asarray(fast_state[key]).tobytes(), \
                f"W={W} rank {rank}: state {key}"
        assert plain_norms == fast_norms
        assert_close(plain_norms, ref.grad_norms, atol=1e-12, what="grad norm")
    # Bytes summed over the ranks: a bucket costs 2(W-1) N (direct.all_reduce_shared), and so
    # does a parameter, except one of at most SMALL_BYTES, which every peer reads whole
    # (collectives/direct_small.py): W(W-1) N.
    small = direct_small.SMALL_BYTES
    per_param = sum((W * (W - 1) if p.data.nbytes <= small else 2 * (W - 1)) * p.data.nbytes
                    for p in GPT(TINY).parameters())
    for step in range(STEPS):
        assert sum(run[True][2][step] for run in runs) == 2 * (W - 1) * psi * 8
        assert sum(run[False][2][step] for run in runs) == per_param


@pytest.mark.multiproc
@pytest.mark.parametrize("algo", ["ring", pytest.param("tree", marks=pytest.mark.slow),
                                  pytest.param("halving", marks=pytest.mark.slow)])
def test_plain_path_with_message_algorithms_matches_single_process(algo):
    W, M = 3, 2                   # the algorithms the plain path runs over MPI, here on 3 ranks
    runs = [run[False] for run in spawn(W, _train_both_paths, M, algo, paths=(False,))]
    ref = train_single_process(TINY, DATA, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                               weight_decay=WD, grad_accum=M)
    for rank, (params, norms, _, _) in enumerate(runs):
        assert_close(norms, ref.grad_norms, atol=1e-12, what=f"{algo}, rank {rank}: norm")
        for name, p in ref.params.items():
            assert_close(params[name], p, atol=1e-12, what=f"{algo}, rank {rank}: {name}")
            assert np.array_equal(params[name], runs[0][0][name]), f"rank {rank} drifted"


def _hooks_in_rank_order(ctx):
    """Fire the hooks by hand, in an order that differs per rank, one parameter missing."""
    dp = DataParallel(GPT(TINY), ctx.world, lr=LR, algo="direct")
    order = dp.params if ctx.rank % 2 else dp.params[::-1]
    for i, p in enumerate(order):
        if ctx.rank == 1 and i == 3:
            continue                                      # no gradient on rank 1: zeros
        p.grad = np.full(p.shape, float(ctx.rank + 1))
        dp._on_grad_ready(p)
    dp._summed_grads()                                    # starts the rest, waits
    return [p.grad for p in dp.params]


@pytest.mark.multiproc
def test_plain_path_starts_all_reduces_in_one_order_whatever_the_hook_order():
    W = 3                                   # a different order would be a CollectiveMismatch
    runs = spawn(W, _hooks_in_rank_order)
    missing = 3                             # rank 1 (forward order) skipped params[3]
    for grads in runs:
        for i, g in enumerate(grads):
            want = sum(range(1, W + 1)) - (2 if i == missing else 0)
            assert np.all(g == want), (i, g.ravel()[:3], want)


class _GroupWithoutSharedMemory:
    """What compose.build hands DataParallel under mpiexec, as far as the choice goes."""

    name, rank, size, prefix, supports_shared = "dp0", 0, 1, "[rank 0/1]", False


def test_the_plain_engine_runs_without_shared_memory_and_the_buckets_do_not():
    plain = DataParallel(GPT(TINY), _GroupWithoutSharedMemory(), lr=LR, algo="ring")
    assert type(plain) is DataParallel and not hasattr(plain, "buckets")
    with pytest.raises(ValueError, match="no shared memory .* use the plain DataParallel"):
        BucketedDataParallel(GPT(TINY), _GroupWithoutSharedMemory(), lr=LR)
    assert plain._algo == "ring" and [id(p) for p in plain.order] == \
        [id(p) for p in reversed(plain.params)]                 # the buckets' order
    auto = DataParallel(GPT(TINY), _GroupWithoutSharedMemory(), lr=LR)
    assert auto._algo == "auto"             # collectives choose ring/tree/halving
    with pytest.raises(ValueError, match="algo='direct'.*no shared memory.*'ring'"):
        DataParallel(GPT(TINY), _GroupWithoutSharedMemory(), lr=LR, algo="direct")
    with pytest.raises(ValueError, match="algo='fastest' is unknown"):
        DataParallel(GPT(TINY), _GroupWithoutSharedMemory(), lr=LR, algo="fastest")
    assert "fastest" not in ALGOS


def _engine_types(ctx, ep):
    cfg = TINY if ep == 1 else GPTConfig(**{**TINY.__dict__, "moe_every": 1, "n_experts": 2})
    lay = build(ctx, Plan(dp=ctx.world_size, ep=ep), cfg, seed=0, optimizer="adamw", lr=LR,
                weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0)
    return type(lay.engine).__name__


@pytest.mark.multiproc
def test_the_layout_picks_the_bucketed_fast_path_on_shared_memory():
    """compose.build chooses the engine: the buckets on shared memory, with expert
    parallelism too (the experts' buckets sum over their own group)."""
    assert spawn(1, _engine_types, 1) == ["BucketedDataParallel"]
    assert spawn(2, _engine_types, 2) == ["BucketedDataParallel"] * 2
    assert issubclass(BucketedDataParallel, DataParallel)
