"""Every layout on the mesh must be invisible in the numbers: pp x dp x cp x tp ranks, with
or without sequence parallelism, ring attention or Ulysses over cp, ZeRO 0-3 over dp x cp
(0-2 with pipeline stages), every pipeline schedule, train exactly like one process
(float64, 3 AdamW steps with gradient accumulation, clipping and dropout).

By default a few cheap representatives run (one per axis and a few compositions, see
DEFAULT_KEPT and PIPELINE_DEFAULT_KEPT); every other case of DEFAULT and PIPELINE_DEFAULT,
and the full sweeps, are marked slow (run them with -m slow)."""

import functools

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.parallel.pipeline import family
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_runs_match, slow_unless_kept

DATA = DataConfig(task="sort", length=6, seed=2)   # V = 11 (divisible by no tp > 1), T = 12
STEPS, M, LR, CLIP = 3, 2, 1e-2, 0.05


def _data(cp: int = 1) -> DataConfig:
    """T = 12, or T = 2 cp where 12 does not split into 2 cp zig-zag chunks."""
    return DATA if 12 % (2 * cp) == 0 else DataConfig(task="sort", length=cp, seed=2)


def _cfg(tp: int, cp: int = 1, n_layer: int = 2):
    heads = tp * cp if tp * cp > 2 else 2            # n_head a multiple of tp x cp (Ulysses)
    return model_config_for(_data(cp), n_layer=n_layer, n_head=heads,
                            n_embd=4 * heads if heads > 2 else 16, dropout=0.1)


@functools.lru_cache(maxsize=None)
def _reference(tp: int, batch: int, cp: int = 1, n_layer: int = 2, micro_batches: int = M):
    return train_single_process(_cfg(tp, cp, n_layer), _data(cp), steps=STEPS,
                                global_batch=batch, lr=LR, grad_accum=micro_batches,
                                clip_grad=CLIP, weight_decay=0.01)


def _check(runs, ref, what):
    assert max(ref.grad_norms) > CLIP                         # clipping really happened
    assert_runs_match(runs, ref, what)


def _run(dp, tp, zero, sp, cp=1, algo="ring", layout="zigzag"):
    batch = dp * M * 2
    plan = Plan(dp=dp, tp=tp, cp=cp, zero=zero, micro_batches=M, sequence_parallel=sp,
                cp_algo=algo, cp_layout=layout)
    runs = spawn(dp * cp * tp, train_on_rank, _cfg(tp, cp), _data(cp), plan,
                 RunConfig(steps=STEPS, global_batch=batch),
                 OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=CLIP))
    _check(runs, _reference(tp, batch, cp), f"dp={dp} cp={cp} ({algo}, {layout}) tp={tp} "
                                            f"zero={zero} sp={sp}")


FACTORISATIONS = [(dp, cp, tp) for W in range(1, 9) for dp in range(1, W + 1)
                  for cp in range(1, W + 1) for tp in range(1, W + 1) if dp * cp * tp == W]


def _sp_splits(cp, tp):
    return tp > 1 and (_data(cp).block_size // cp) % tp == 0


def _default_case(i, dp, cp, tp):
    """One ZeRO stage per factorisation, cycling; SP wherever it splits, every other time;
    Ulysses every third cp case, the contiguous layout every fifth."""
    algo = "ulysses" if i % 3 == 0 else "ring"
    layout = "contiguous" if i % 5 == 0 else "zigzag"
    return dp, cp, tp, i % 4, _sp_splits(cp, tp) and i % 2 == 0, algo, layout


DEFAULT = [_default_case(i, *f) for i, f in enumerate(FACTORISATIONS)]

# run by default: one cheap case per axis: dp (DDP), ZeRO 1-3 (over dp or over dp x cp),
# cp ring (zig-zag and contiguous) and Ulysses, tp + SP in a dp x tp composition (tp alone:
# test_vocabulary_not_divisible_by_tp_is_exact[False-2]); the rest of DEFAULT is slow
DEFAULT_KEPT = [
    (4, 1, 1, 0, False, "ulysses", "zigzag"),        # dp=4, plain DDP
    (2, 1, 1, 3, False, "ulysses", "zigzag"),        # dp=2, ZeRO-3
    (1, 2, 1, 2, False, "ring", "zigzag"),           # cp=2 ring, ZeRO-2 over cp
    (1, 4, 1, 1, False, "ulysses", "zigzag"),        # cp=4 Ulysses, ZeRO-1 over cp
    (1, 3, 1, 1, False, "ring", "contiguous"),       # cp=3 ring, contiguous layout
    (2, 1, 2, 2, True, "ring", "contiguous"),        # dp=2 x tp=2 SP, ZeRO-2
]
assert all(c in DEFAULT for c in DEFAULT_KEPT)


@pytest.mark.multiproc
@pytest.mark.parametrize("dp, cp, tp, zero, sp, algo, layout",
                         slow_unless_kept(DEFAULT, DEFAULT_KEPT))
def test_every_factorisation_of_up_to_8_ranks_matches_single_process(dp, cp, tp, zero, sp,
                                                                      algo, layout):
    _run(dp, tp, zero, sp, cp, algo, layout)


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [2, pytest.param(3, marks=pytest.mark.slow),
                                pytest.param(4, marks=pytest.mark.slow)])   # default: tp=2
@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_vocabulary_not_divisible_by_tp_is_exact(tp, sp):
    # Megatron-LM #1754: V = 11 padded to a multiple of tp; the padding is masked.
    assert DATA.vocab_size % tp
    _run(1, tp, 0, sp)


SWEEP = [(dp, cp, tp, zero, sp, algo, "zigzag") for dp, cp, tp in FACTORISATIONS
         for zero in range(4) for sp in ([False, True] if _sp_splits(cp, tp) else [False])
         for algo in (["ring", "ulysses"] if cp > 1 else ["ring"])]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("dp, cp, tp, zero, sp, algo, layout",
                         [c for c in SWEEP if c not in DEFAULT])
def test_full_sweep_of_layouts(dp, cp, tp, zero, sp, algo, layout):
    _run(dp, tp, zero, sp, cp, algo, layout)


# --- with pipeline stages: pp x dp x cp x tp -------------------------------------------

PIPELINED = [(pp, dp, cp, tp) for W in range(2, 9) for pp in range(2, W + 1)
             for dp, cp, tp in FACTORISATIONS if pp * dp * cp * tp == W]


def _pipeline_case(i, pp, dp, cp, tp):
    """Schedules and ZeRO stages 0-2 cycling; interleaved only where 2 pp layers are few
    enough; SP every other time where it splits."""
    name = family.SCHEDULES[i % 4]
    if name == "interleaved" and pp > 4:
        name = "zb-h1"
    return pp, dp, cp, tp, i % 3, _sp_splits(cp, tp) and i % 2 == 1, name


PIPELINE_DEFAULT = [_pipeline_case(i, *f) for i, f in enumerate(PIPELINED)]
# run by default: the cheap pp=2 x dp=2 composition with ZeRO-1 (every schedule meets every
# pp size in tests/parallel/pipeline/test_stage.py); the rest of PIPELINE_DEFAULT is slow
PIPELINE_DEFAULT_KEPT = [(2, 2, 1, 1, 1, False, "gpipe")]
assert all(c in PIPELINE_DEFAULT for c in PIPELINE_DEFAULT_KEPT)


@pytest.mark.multiproc
@pytest.mark.parametrize("pp, dp, cp, tp, zero, sp, schedule",
                         slow_unless_kept(PIPELINE_DEFAULT, PIPELINE_DEFAULT_KEPT))
def test_every_factorisation_with_pipeline_stages_matches_single_process(pp, dp, cp, tp, zero,
                                                                         sp, schedule):
    micro = pp + 1                                   # never a multiple of pp
    n_layer = 2 * pp if schedule == "interleaved" else pp + 1
    plan = Plan(pp=pp, dp=dp, tp=tp, cp=cp, zero=zero, micro_batches=micro,
                sequence_parallel=sp, schedule=schedule)
    batch = dp * micro * 2
    runs = spawn(plan.world_size, train_on_rank, _cfg(tp, cp, n_layer), _data(cp), plan,
                 RunConfig(steps=STEPS, global_batch=batch),
                 OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=CLIP))
    _check(runs, _reference(tp, batch, cp, n_layer, micro), f"{plan.describe()} zero={zero}")


def _sweep_case(i, zero, pp, dp, cp, tp):
    """Every supported ZeRO stage of every pipelined factorisation, the schedule turning
    with the stage (every schedule meets every pp size in tests/parallel/pipeline/test_stage.py)."""
    _, _, _, _, _, _, name = _pipeline_case(i + zero, pp, dp, cp, tp)
    return pp, dp, cp, tp, zero, _sp_splits(cp, tp) and zero == 2, name


PIPELINE_SWEEP = [_sweep_case(i, zero, *f) for i, f in enumerate(PIPELINED) for zero in range(3)]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("pp, dp, cp, tp, zero, sp, schedule",
                         [c for c in PIPELINE_SWEEP if c not in PIPELINE_DEFAULT])
def test_full_sweep_of_pipelined_layouts(pp, dp, cp, tp, zero, sp, schedule):
    test_every_factorisation_with_pipeline_stages_matches_single_process(
        pp, dp, cp, tp, zero, sp, schedule)


@pytest.mark.parametrize("plan, match", [
    (Plan(tp=3), "n_head=2 is not a multiple of 3"),
    (Plan(tp=4, sequence_parallel=True), "n_head=2 is not a multiple of 4"),
    (Plan(dp=3), "global_batch=8 does not split over dp=3"),
])
def test_plans_that_cannot_split_fail_before_any_process_starts(plan, match):
    with pytest.raises(ValueError, match=match):
        plan.validate(_cfg(2), 8, DATA.block_size)


def test_sequence_length_must_split_over_tp_under_sp():
    cfg = _cfg(5)
    with pytest.raises(ValueError, match="T=12 positions over tp=5"):
        Plan(tp=5, sequence_parallel=True).validate(cfg, 8, DATA.block_size)
    Plan(tp=5).validate(cfg, 8, DATA.block_size)                # without SP: fine


@pytest.mark.parametrize("field, bad", [("tp", 0), ("pp", 0), ("cp", 0), ("ep", 2),
                                        ("sequence_parallel", 1), ("check_placements", 1),
                                        ("cp_algo", "star"), ("cp_layout", "random"),
                                        ("schedule", "star"), ("virtual_stages", 2)])
def test_plan_refuses_bad_or_unbuilt_axes(field, bad):
    with pytest.raises(ValueError, match=field):
        Plan(**{field: bad})
    with pytest.raises(ValueError, match="needs tp > 1"):
        Plan(sequence_parallel=True)


@pytest.mark.multiproc
def test_a_plan_for_another_world_size_is_refused_on_the_rank():
    with pytest.raises(RankFailure, match=r"dp=1 x tp=2 = 2 ranks, but the job has 3"):
        spawn(3, train_on_rank, _cfg(2), DATA, Plan(tp=2), RunConfig(steps=1, global_batch=4),
              OptimizerConfig(lr=LR))


def _groups(ctx):
    from minidist.parallel.compose import build
    lay = build(ctx, Plan(dp=2, tp=3), _cfg(3), 0, optimizer="adamw", lr=LR,
                weight_decay=0.0, betas=(0.9, 0.999), momentum=0.0)
    return lay.dp_group.ranks, lay.tp_group.ranks


@pytest.mark.multiproc
def test_tp_is_the_fastest_mesh_axis():
    got = spawn(6, _groups)
    assert got[4] == ((1, 4), (3, 4, 5))                    # rank 4 = (dp 1, tp 1)
    assert [tp for _, tp in got] == [(0, 1, 2)] * 3 + [(3, 4, 5)] * 3
    assert all(np.array_equal(got[r][0], (r % 3, r % 3 + 3)) for r in range(6))


def _local_numels(cfg, tp):
    """Elements per ZeRO unit (root, then each block) of one tp rank's shard of the GPT."""
    from minidist.nn import GPT
    from minidist.parallel import placement as pl
    from minidist.parallel.tensor.tensor_parallel import expected_placement
    numels: dict[str, int] = {"root": 0}
    for name, p in GPT(cfg, seed=None).named_parameters():
        placement = expected_placement(name) if tp > 1 else pl.Replicate()
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        numels[unit] = numels.get(unit, 0) + pl.shard(np.zeros(p.shape), placement, tp, 0).size
    return list(numels.values())


@pytest.mark.multiproc
@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow),    # default: 3
                                  pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_memory_over_dp_of_tp_shards_equals_the_formula(zero):
    from minidist.parallel.zero.memory import exact_bytes
    dp, tp, cfg = 2, 2, _cfg(2)
    plan = Plan(dp=dp, tp=tp, zero=zero, micro_batches=M)
    runs = spawn(dp * tp, train_on_rank, cfg, DATA, plan,
                 RunConfig(steps=1, global_batch=dp * M * 2), OptimizerConfig(lr=LR))
    expected = exact_bytes(zero, _local_numels(cfg, tp), dp, itemsize=8, micro_batches=M)
    for rank, run in enumerate(runs):                 # every rank holds the same bytes
        assert run.memory == expected, f"rank {rank}: {run.memory} != {expected}"


def _groups_made(ctx, plan, cfg):
    from minidist.parallel.compose import build
    build(ctx, plan, cfg, 0, **OptimizerConfig(lr=1e-3).engine_arguments())
    return len(ctx.job.groups)


@pytest.mark.multiproc
@pytest.mark.parametrize("plan", [Plan(dp=2, cp=2, tp=2), Plan(pp=2, dp=2, tp=2,
                                                                 micro_batches=2),
                                  Plan(dp=4, ep=2), Plan(dp=8)], ids=Plan.describe)
def test_group_count_is_the_number_of_groups_build_makes(plan):
    """The launcher sizes the job's group table with group_count: it must be exact."""
    from minidist.parallel.compose import group_count
    cfg = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16,
                           moe_every=1 if plan.ep > 1 else 0)
    assert spawn(plan.world_size, _groups_made, plan, cfg) == \
        [group_count(plan, cfg)] * plan.world_size


def test_one_rank_axes_make_no_groups_so_64_data_parallel_ranks_need_three():
    from minidist.parallel.compose import group_count
    cfg = model_config_for(DATA, n_layer=2, n_head=2, n_embd=16)
    assert group_count(Plan(dp=64), cfg) == 3                  # world, alone, dp
    assert group_count(Plan(dp=32, tp=2), cfg) == 2 + 2 + 32     # world, alone; dp; tp


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--dp", "64", "--batch", "64"],
                                  ["--pp", "8", "--dp", "2", "--cp", "2", "--tp", "2",
                                   "--batch", "16"]], ids=" ".join)
def test_64_ranks_run_with_the_default_settings(argv, tmp_path):
    """dp = 64, and the layout of 64 ranks that makes the most groups (246)."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "minidist", "train", *argv, "--steps", "1",
                          "--run-dir", "none"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in __import__("os").environ.items()
                                           if not k.startswith("MINIDIST_GROUP")})
    assert run.returncode == 0, run.stderr[-3000:]


def _built_groups(ctx, plan):
    """The ranks of every group `build`'s mesh gives this rank, beside Plan.group_ranks."""
    from minidist.parallel.compose import _groups
    from minidist.nn import GPTConfig
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16,
                    moe_every=1 if plan.ep * plan.expert_tp > 1 else 0)
    groups = _groups(ctx, plan, cfg)
    # edp is left out: under cp the experts' replicas are edp x cp (one group)
    built = {k: tuple(groups[k].ranks) for k in ("tp", "cp", "dp", "grad", "ep", "etp", "pp")
             if k in groups and hasattr(groups[k], "ranks")}
    return built, plan.group_ranks(ctx.rank)


@pytest.mark.multiproc
@pytest.mark.parametrize("plan", [Plan(dp=2, cp=2, tp=2), Plan(pp=2, dp=2, tp=2),
                                  Plan(dp=4, ep=2, expert_tp=2, tp=2)],
                         ids=lambda p: p.describe())
def test_group_ranks_are_the_groups_build_makes(plan):
    for built, claimed in spawn(plan.world_size, _built_groups, plan):
        for axis, ranks in built.items():
            assert claimed[axis] == ranks, (axis, claimed[axis], ranks)
