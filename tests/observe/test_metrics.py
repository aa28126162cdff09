"""observe/metrics.py: one JSON line per step and rank, flushed as it is written, equal to
what train_on_rank returns; read back with the last line of a step winning; summarised
by hand-checkable formulas."""

import json
import math

import pytest

from minidist.data import DataConfig, model_config_for
from minidist.observe import metrics, run_dir
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank

DATA = DataConfig(task="reverse", length=3)
TINY = model_config_for(DATA, n_layer=2, n_embd=16, n_head=2, dtype="float64")
STEPS, BATCH = 3, 8


def _values(loss: float, step_s: float = 0.5, compute: float = 0.3, comm: float = 0.1) -> dict:
    return {"loss": loss, "grad_norm": 2.0, "lr": 1e-3,
            "time_s": {"step": step_s, "compute": compute, "comm_wait": comm, "cpu": 0.4},
            "bytes_sent": {"dp": 100, "tp": 40}, "bytes": {"sent": 140, "recv": 140},
            "memory": {"params": 8, "grads": 8, "optimizer": 16}}


def test_each_line_is_on_disk_before_the_writer_closes(tmp_path):
    w = metrics.MetricsWriter(tmp_path, rank=3)
    w.write(0, _values(2.5))
    w.write(1, _values(2.25))
    lines = (tmp_path / "rank3.jsonl").read_text().splitlines()     # not closed yet
    assert [json.loads(t)["step"] for t in lines] == [0, 1]
    rec = json.loads(lines[1])
    assert (rec["rank"], rec["loss"], rec["bytes_sent"]) == (3, 2.25, {"dp": 100, "tp": 40})
    assert rec["time_s"]["other"] == pytest.approx(0.5 - 0.3 - 0.1)   # step - compute - wait
    assert rec["rss_peak"] > 1 << 20                               # this process: MiBs
    w.close()


def test_read_keeps_the_last_line_of_a_step_and_skips_a_torn_one(tmp_path):
    w = metrics.MetricsWriter(tmp_path, rank=0)
    for step, loss in ((0, 3.0), (1, 2.0), (1, 1.5), (2, 1.0)):   # step 1 redone (a resume)
        w.write(step, _values(loss))
    w.close()
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write('{"step": 3, "rank": 0, "lo')                     # killed while writing
    got = metrics.read(tmp_path)
    assert list(got) == [0]
    assert [(r["step"], r["loss"]) for r in got[0]] == [(0, 3.0), (1, 1.5), (2, 1.0)]


def test_summary_follows_its_formulas():
    # Two ranks, two steps; the slowest rank's step time counts per step.
    line = lambda r, s, step_s, loss: {**metrics.line(r, s, _values(loss, step_s)),  # noqa
                                       "rss_peak": 1000 + r}
    lines = {0: [line(0, 0, 0.5, 3.0), line(0, 1, 0.2, 2.0)],
             1: [line(1, 0, 0.4, 3.0), line(1, 1, 0.6, 2.0)]}
    s = metrics.summarize(lines, tokens_per_step=96)
    assert (s["steps"], s["first_step"], s["last_step"], s["final_loss"]) == (2, 0, 1, 2.0)
    assert s["wall_s"] == pytest.approx(0.5 + 0.6)
    assert s["tokens_per_s"] == pytest.approx(96 * 2 / 1.1)
    r1 = s["ranks"]["1"]
    assert r1["time_s"]["step"] == pytest.approx(0.5) and r1["rss_peak"] == 1001
    assert r1["time_s"]["other"] == pytest.approx(0.5 - 0.3 - 0.1)
    assert r1["bytes_sent"] == {"dp": 100, "tp": 40} and r1["memory"]["optimizer"] == 16
    assert metrics.summarize({}) == {"steps": 0, "ranks": {}}


def _observed(ctx, path, plan):
    obs = run_dir.RankObserver(path, ctx.rank, (), ctx.world.group_names)
    result = train_on_rank(ctx, TINY, DATA, plan, RunConfig(steps=STEPS, global_batch=BATCH),
                           OptimizerConfig(lr=1e-2), hooks=[obs])
    obs.close()
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize("plan", [Plan(dp=2), Plan(dp=2, tp=2)], ids=["dp2", "dp2xtp2"])
def test_lines_equal_what_train_on_rank_returns(tmp_path, plan):
    results = spawn(plan.world_size, _observed, tmp_path, plan)
    got = metrics.read(tmp_path / "metrics")
    assert sorted(got) == list(range(plan.world_size))
    for rank, res in enumerate(results):
        lines = got[rank]
        assert [r["step"] for r in lines] == list(range(STEPS)), f"rank {rank}"
        for s, rec in enumerate(lines):
            where = f"rank {rank} step {s}"
            assert rec["loss"] == res.losses[s], where              # bitwise: one algorithm
            assert rec["grad_norm"] == res.grad_norms[s] and rec["lr"] == res.lrs[s], where
            for k in metrics.TIME_KEYS:
                assert rec["time_s"][k] == res.timing[k][s], f"{where}: {k}"
            assert rec["bytes_sent"] == res.bytes_by_axis[s], where
            assert rec["bytes"] == res.bytes_per_step[s], where
        assert lines[-1]["memory"] == res.memory, f"rank {rank}"
        assert all(math.isfinite(r["loss"]) for r in lines)
