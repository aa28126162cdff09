"""train.py: a Plan is validated before anything runs, and train_on_rank hands the model to
the engine the Plan names (DataParallel for zero=0, parallel/zero/engine.py's ZeroEngine else)."""

import sys

import numpy as np
import pytest

from minidist.baseline import train_single_process
from minidist.data import DataConfig, model_config_for
from minidist.parallel import compose
from minidist.parallel.data.ddp import DataParallel
from minidist.runtime.errors import RankFailure
from minidist.runtime.launch import spawn
from minidist.train import OnStep, OptimizerConfig, Plan, RunConfig, train_on_rank
from tests.helpers import assert_close, configs

DATA = DataConfig(task="reverse", length=3)
TINY = model_config_for(DATA, n_layer=1, n_embd=8, n_head=2, dtype="float64")


@pytest.mark.parametrize("field, bad", [
    ("dp", 0), ("dp", 2.0), ("zero", 4), ("zero", -1), ("zero", True), ("micro_batches", 0),
    ("bucket_bytes", 0), ("bucket_bytes", -1), ("algo", "fastest"), ("overlap", 1),
    ("replica_check_every", -1)])
def test_plan_rejects_bad_fields(field, bad):
    with pytest.raises(ValueError, match=field):
        Plan(**{field: bad})


def test_plan_defaults_follow_the_contract():
    p = Plan()
    assert (p.dp, p.zero, p.micro_batches, p.bucket_bytes, p.algo, p.overlap,
            p.replica_check_every) == (1, 0, 1, 1 << 20, "auto", True, 0)
    with pytest.raises(AttributeError):
        p.dp = 2                                                    # frozen


def test_global_batch_must_split_over_dp_times_micro_batches():
    assert Plan(dp=3, micro_batches=2).rows_per_micro_batch(24) == 4
    with pytest.raises(ValueError, match=r"global_batch=20 does not split over dp=3 ranks x "
                                         r"micro_batches=2 \(= 6 equal parts\).*18 or 24"):
        Plan(dp=3, micro_batches=2).rows_per_micro_batch(20)
    with pytest.raises(ValueError, match="multiple of 4"):
        Plan(dp=4).rows_per_micro_batch(2)


@pytest.mark.multiproc
def test_dp_must_match_the_world_and_the_batch_is_checked_on_the_rank():
    with pytest.raises(RankFailure, match="dp=2 x tp=1 = 2 ranks, but the job has 1"):
        spawn(1, train_on_rank, TINY, DATA, Plan(dp=2), RunConfig(steps=1, global_batch=4),
              OptimizerConfig(lr=1e-3))
    with pytest.raises(RankFailure, match="global_batch=5 does not split"):
        spawn(2, train_on_rank, TINY, DATA, Plan(dp=2), RunConfig(steps=1, global_batch=5),
              OptimizerConfig(lr=1e-3))


class _RecordingZero(DataParallel):
    """Stands in for parallel/zero/engine.py's ZeroEngine: DDP numerics, records how it was made."""

    def __init__(self, model, group, stage, *, optimizer, lr, weight_decay, betas, momentum,
                 algo, sharding):
        super().__init__(model, group, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                         betas=betas, momentum=momentum, algo=algo, sharding=sharding)
        self.made = {"stage": stage, "algo": algo, "optimizer": optimizer}

    def memory(self):
        return {**super().memory(), "made_as": self.made}


@pytest.mark.multiproc
def test_zero_stages_are_dispatched_to_the_zero_engine(monkeypatch):
    # The forked ranks inherit the patched module, so compose.build makes the stand-in.
    monkeypatch.setattr(compose, "ZeroEngine", _RecordingZero)
    kw = dict(steps=2, global_batch=4, lr=1e-2, optimizer="sgd", momentum=0.9)
    ref = train_single_process(TINY, DATA, **kw)
    runs = spawn(2, train_on_rank, TINY, DATA, Plan(dp=2, zero=2, algo="ring"),
                 *configs(**kw))
    for run in runs:
        assert run.memory["made_as"] == {"stage": 2, "algo": "ring", "optimizer": "sgd"}
        assert_close(run.losses, ref.losses, atol=1e-12, what="loss")
        for key, s in ref.optimizer_state.items():
            assert_close(run.optimizer_state[key], s, atol=1e-12, what=key)
    plain = spawn(1, train_on_rank, TINY, DATA, Plan(), *configs(**kw))[0]
    assert "made_as" not in plain.memory                     # zero=0: DataParallel itself


@pytest.mark.multiproc
def test_rank_result_reports_memory_bytes_and_timing():
    run = spawn(2, train_on_rank, TINY, DATA, Plan(dp=2), RunConfig(steps=2, global_batch=4),
                OptimizerConfig(lr=1e-3))[0]
    n = sum(p.size for p in run.params.values())
    assert run.memory == {"params": 8 * n, "grads": 8 * n, "optimizer": 2 * 8 * n}
    assert [b["sent"] for b in run.bytes_per_step] == [8 * n] * 2          # 2(W-1)/W Ψ, W=2
    assert set(run.timing) == {"compute", "comm_wait", "step", "cpu"}
    for key, values in run.timing.items():
        assert len(values) == 2 and all(np.isfinite(v) and v >= 0 for v in values), key
    assert all(w <= s for w, s in zip(run.timing["comm_wait"], run.timing["step"]))


@pytest.mark.multiproc
def test_comm_wait_counts_the_tp_calls_and_nothing_on_a_group_of_one():
    """Under tp=2 (dp=1) the comm column's seconds are the tp group's calls (the layers'
    all-reduces, the norm's sum): nonzero; the dp group has one rank, so no call and 0 s.
    comm_wait is the sum over the axes, and compute does not contain it."""
    for run in spawn(2, train_on_rank, TINY, DATA, Plan(tp=2),
                     RunConfig(steps=2, global_batch=4), OptimizerConfig(lr=1e-3)):
        assert [set(c) for c in run.comm_by_axis] == [{"dp", "tp"}] * 2
        assert all(c["tp"] > 0 and c["dp"] == 0 for c in run.comm_by_axis), run.comm_by_axis
        assert list(run.timing["comm_wait"]) == [sum(c.values()) for c in run.comm_by_axis]
        for comm, compute, step in zip(run.timing["comm_wait"], run.timing["compute"],
                                       run.timing["step"]):
            assert compute >= 0 and comm + compute <= step


@pytest.mark.slow      # a subprocess, ~1.2 s; the default run has test_cli.py's in-process
@pytest.mark.multiproc # `train --dp 2 --check` runs (one with ZeRO-2)
def test_train_cli_runs_dp_with_zero_and_checks_against_the_baseline():
    import subprocess
    res = subprocess.run([sys.executable, "-m", "minidist", "train", "--dp", "2", "--zero", "1",
                          "--steps", "4", "--every", "1", "--batch", "8", "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout.splitlines()
    assert [line.split("|")[0].strip() for line in out if line.startswith("step")] == \
        [f"step    {s}" for s in range(4)]
    assert out[-1].startswith("OK: dp=2 x tp=1, ZeRO-1 training matches the single-process run")


def _progress_on_rank(ctx, model_cfg, data_cfg):
    seen = []
    run = train_on_rank(ctx, model_cfg, data_cfg, Plan(dp=ctx.world_size),
                        RunConfig(steps=3, global_batch=4), OptimizerConfig(lr=1e-2),
                        hooks=[OnStep(lambda s, loss: seen.append((s, loss)))])
    return seen, run.losses


@pytest.mark.multiproc
def test_on_step_sees_the_global_loss_of_each_step():
    for seen, losses in spawn(2, _progress_on_rank, TINY, DATA):
        assert [s for s, _ in seen] == [0, 1, 2]
        assert [loss for _, loss in seen] == list(losses)


def test_plan_refuses_zero_with_the_tree_algorithm():
    with pytest.raises(ValueError, match="reduce-scatter"):
        Plan(dp=2, zero=2, algo="tree")


def test_run_and_optimizer_configs_refuse_what_makes_no_run():
    for bad in (dict(steps=-1), dict(steps=True), dict(start_step=-2),
                dict(total_steps=3, start_step=2), dict(data_offset=1.5)):
        with pytest.raises(ValueError, match=r"RunConfig: \w+=.* must be an int >= "):
            RunConfig(**{"steps": 2, "global_batch": 4, **bad})
    assert RunConfig(steps=2, global_batch=4, start_step=3).length == 5
    assert list(RunConfig(steps=2, global_batch=4, start_step=3).step_range) == [3, 4]
    with pytest.raises(ValueError, match="optimizer='lion' is unknown; choose 'adamw' or 'sgd'"):
        OptimizerConfig(lr=1e-3, name="lion")
    with pytest.raises(ValueError, match="lr_schedule='linear' is unknown"):
        OptimizerConfig(lr=1e-3, lr_schedule="linear")
    cosine = OptimizerConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, min_lr=0.1)
    assert [cosine.lr_at(s, 4) for s in (0, 1, 2, 4)] == [0.0, 0.5, 1.0, 0.1]
    assert OptimizerConfig(lr=0.5).lr_at(7, 4) == 0.5
