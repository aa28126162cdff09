"""observe/run_dir.py: a run directory with its config, metrics, summary and ONE Chrome trace
that is valid JSON, has a track group per rank whose bars nest or follow, and holds every op,
every collective and send/recv and every pipeline action of the traced steps: checked against
each rank's flight recorder, the sequence numbers of every group, and closed forms."""

import collections
import json
import os

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.autograd import tensor as _tensor
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.observe import metrics, run_dir
from minidist.runtime import RankFailure, call
from minidist.runtime import flight as _flight
from minidist.runtime.launch import spawn
from minidist.train import OnStepEnd, OptimizerConfig, Plan, RunConfig, train_on_rank
from minidist.train_cli import main as train_main

DATA = DataConfig(task="reverse", length=3)
TINY = model_config_for(DATA, n_layer=2, n_embd=16, n_head=2, dtype="float64")
STEPS, BATCH, TRACED = 3, 8, (1, 2)


def _rank(ctx, path, plan, traced=TRACED, fail_at=None):
    """train_on_rank observed; each step's end also copies this rank's flight ring (the
    calls it remembers: (group name, seq, op)), the record the trace must agree with."""
    ring = {}

    def snap(end):
        rec = ctx.world.records.recorder
        names = ctx.world.group_names
        ring[end.step] = {(names[int(r[call.GID])], int(r[call.SEQ]), call.decode(int(r[call.OP])))
                          for r in rec.last(ctx.rank, _flight.DEPTH)}
        if end.step == fail_at and ctx.rank == 1:
            raise RuntimeError(f"rank 1 fails after step {end.step}")

    obs = run_dir.RankObserver(path, ctx.rank, traced, ctx.world.group_names)
    res = train_on_rank(ctx, TINY, DATA, plan, RunConfig(steps=STEPS, global_batch=BATCH),
                        OptimizerConfig(lr=1e-2), hooks=[obs, OnStepEnd(snap)])
    obs.close()
    return res, ring


def _run(path, plan, **kw):
    run_dir.create(path, run_dir.config(TINY, DATA, plan, global_batch=BATCH))
    out = spawn(plan.world_size, _rank, path, plan, **kw)
    return out, run_dir.finish(path)


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp2xtp2")
    out, summary = _run(path, Plan(dp=2, tp=2))
    return path, out, summary, json.loads((path / "trace.json").read_text())


def _bars(trace) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _calls(trace, rank: int | None = None) -> list[dict]:
    return [e for e in _bars(trace) if e["cat"] in ("collective", "p2p")
            and (rank is None or e["pid"] == rank)]


def assert_valid_chrome_trace(trace: dict, ranks: int) -> None:
    """Trace Event Format: the fields every viewer needs; a named track group per rank;
    on each track (pid, tid) bars nest or follow each other."""
    assert isinstance(trace["traceEvents"], list)
    for e in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(e) and e["ph"] in ("X", "M"), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["args"], dict), e
    groups = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
              if e["ph"] == "M" and e["name"] == "process_name"}
    assert groups == {r: f"rank {r}" for r in range(ranks)}
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name"}
    by_track = collections.defaultdict(list)
    for e in _bars(trace):
        by_track[e["pid"], e["tid"]].append(e)
    assert set(by_track) <= tracks, "a track without a name"
    for track, bars in by_track.items():
        open_ = []
        for e in sorted(bars, key=lambda e: (e["ts"], -e["dur"])):
            while open_ and e["ts"] >= open_[-1]["ts"] + open_[-1]["dur"]:
                open_.pop()
            if open_:
                outer = open_[-1]
                assert e["ts"] + e["dur"] <= outer["ts"] + outer["dur"], \
                    f"track {track}: {e['name']} overlaps {outer['name']} without nesting"
            open_.append(e)


@pytest.mark.multiproc
def test_the_trace_is_valid_with_one_track_group_per_rank(dp_tp):
    path, _, _, trace = dp_tp
    assert_valid_chrome_trace(trace, 4)
    assert sorted(os.listdir(path)) == ["config.json", "metrics", "summary.json", "trace.json"]


@pytest.mark.multiproc
def test_only_the_traced_steps_with_every_op_inside_them(dp_tp):
    _, _, _, trace = dp_tp
    ops = {}
    for r in range(4):
        steps = {e["name"]: e for e in _bars(trace) if e["pid"] == r and e["cat"] == "step"}
        assert sorted(steps) == [f"step {s}" for s in TRACED]
        mine = [e for e in _bars(trace) if e["pid"] == r and e["cat"] in ("forward", "backward")]
        per_step = collections.Counter()
        for e in mine:                        # each op lies in one traced step's bar
            inside = [s for s, b in steps.items()
                      if b["ts"] <= e["ts"] and e["ts"] + e["dur"] <= b["ts"] + b["dur"]]
            assert len(inside) == 1, f"rank {r}: {e['name']} outside the steps"
            per_step[inside[0], e["name"]] += 1
        count = collections.Counter(e["name"] for e in mine)
        assert count["MatMul"] > 0 and count["MatMul"] == count["MatMul backward"], count
        assert {k[1]: n for k, n in per_step.items() if k[0] == "step 1"} == \
            {k[1]: n for k, n in per_step.items() if k[0] == "step 2"}, f"rank {r}"
        ops[r] = count
    assert all(ops[r] == ops[0] for r in range(4)), "the ranks ran different ops"


@pytest.mark.multiproc
def test_every_call_of_the_traced_steps_is_in_the_trace(dp_tp):
    _, out, _, trace = dp_tp
    seqs = collections.defaultdict(dict)             # group -> rank -> {seq: op}
    for e in _calls(trace):
        a = e["args"]
        seqs[a["group"]].setdefault(e["pid"], {})[a["seq"]] = e["name"].split(" #")[0]
    assert {g[:2] for g in seqs} == {"dp", "tp"}
    for group, ranks in seqs.items():
        first = next(iter(ranks.values()))
        assert sorted(first) == list(range(min(first), max(first) + 1)), f"{group}: a gap"
        assert len(ranks) == 2 and all(v == first for v in ranks.values()), group
    for r, (_, ring) in enumerate(out):
        # the calls this rank's flight ring holds at the end of step 2 and did not hold at
        # the end of step 0: calls of the traced steps 1 and 2, every one in the trace
        recent = ring[2] - ring[0]
        traced = {(e["args"]["group"], e["args"]["seq"], e["name"].split(" #")[0])
                  for e in _calls(trace, r)}
        assert len(recent) == _flight.DEPTH and recent <= traced, f"rank {r}"


@pytest.mark.multiproc
def test_dp2_traces_one_bucket_and_one_loss_all_reduce_per_step(tmp_path):
    """Closed form: the whole gradient (Ψ float64 numbers) fits DDP's one bucket, reduced on
    the group's async worker; the step's loss is one 8-byte all-reduce on the main thread.
    Step s holds calls 2s+1 and 2s+2 of the group."""
    (out, summary) = _run(tmp_path, Plan(dp=2, check_placements=False))
    trace = json.loads((tmp_path / "trace.json").read_text())
    psi = GPT(TINY).num_parameters()
    for r in range(2):
        got = sorted((e["args"]["seq"], e["args"]["bytes"], e["tid"] >= 3)
                     for e in _calls(trace, r))
        assert got == [(2 * s + k, b, worker) for s in TRACED
                       for k, b, worker in ((1, 8 * psi, True), (2, 8, False))], got
    assert summary["final_loss"] == out[0][0].losses[-1]


@pytest.mark.multiproc
def test_pipeline_actions_and_their_sends_and_receives(tmp_path):
    M = 2
    _run(tmp_path, Plan(pp=2, micro_batches=M))
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert_valid_chrome_trace(trace, 2)
    for r in range(2):
        step = {e["name"]: e for e in _bars(trace) if e["pid"] == r and e["cat"] == "step"}
        acts = [e for e in _bars(trace) if e["pid"] == r and e["cat"] == "pipeline"]
        names = collections.Counter(e["name"] for e in acts)
        assert names == {f"{k}{m}": len(TRACED) for k in "FB" for m in range(M)}, names
        for e in acts:                                 # on the step's track, inside its bar
            assert e["tid"] == 0 and any(b["ts"] <= e["ts"] and e["ts"] + e["dur"] <=
                                         b["ts"] + b["dur"] for b in step.values()), e
        p2p = collections.Counter((e["name"].split(" #")[0], e["args"]["group"].split(".")[-1])
                                  for e in _calls(trace, r) if e["cat"] == "p2p")
        sends, recvs = (("act0>1", "grad1>0") if r == 0 else ("grad1>0", "act0>1"))
        assert p2p == {("send", sends): M * len(TRACED), ("recv", recvs): M * len(TRACED)}, p2p
        assert len(step) == len(TRACED)


@pytest.mark.multiproc
def test_config_and_summary(dp_tp):
    path, out, summary, _ = dp_tp
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model"]["n_layer"] == 2 and cfg["data"]["task"] == "reverse"
    assert (cfg["plan"]["dp"], cfg["plan"]["tp"], cfg["world_size"]) == (2, 2, 4)
    assert cfg["tokens_per_step"] == BATCH * DATA.block_size
    assert {"minidist", "python", "numpy"} <= set(cfg["versions"])
    assert summary == json.loads((path / "summary.json").read_text())
    res = out[0][0]
    assert (summary["steps"], summary["final_loss"], summary["losses"]) == \
        (STEPS, res.losses[-1], list(res.losses))
    slowest = [max(o[0].timing["step"][s] for o in out) for s in range(STEPS)]
    assert summary["tokens_per_s"] == pytest.approx(BATCH * DATA.block_size * STEPS
                                                    / sum(slowest))


@pytest.mark.multiproc
def test_a_crashed_run_keeps_the_steps_it_finished(tmp_path):
    with pytest.raises(RankFailure, match="rank 1 fails after step 1"):
        _run(tmp_path, Plan(dp=2), traced=(0, 1, 2), fail_at=1)
    summary = run_dir.finish(tmp_path)                     # what the CLI does after a failure
    lines = metrics.read(tmp_path / "metrics")
    assert [r["step"] for r in lines[1]] == [0, 1] and summary["steps"] >= 2
    steps = {e["name"] for e in _bars(json.loads((tmp_path / "trace.json").read_text()))
             if e["cat"] == "step" and e["pid"] == 1}
    assert steps == {"step 0", "step 1"}


def _values() -> dict:
    return {"loss": 1.0, "grad_norm": 1.0, "lr": 0.1, "bytes_sent": {},
            "time_s": {"step": 1e-3, "compute": 1e-3, "comm_wait": 0.0, "cpu": 1e-3}}


def test_hooks_are_set_only_inside_a_traced_step_and_time_the_backward(tmp_path):
    obs = run_dir.RankObserver(tmp_path, 0, trace_steps=(1,))
    before = _tensor.observers                    # the placement check's, in check mode
    try:
        obs.begin(0)
        assert _tensor.observers == before and _flight.observer is None   # untraced: no cost
        obs.end(0, _values())
        obs.begin(1)
        assert len(_tensor.observers) == len(before) + 1 and _flight.observer is not None
        with pytest.raises(RuntimeError, match="another trace"):
            run_dir.RankObserver(tmp_path / "other", 1, (1,)).begin(1)
        x = Tensor(np.ones(3), requires_grad=True)
        (x * 2.0).sum().backward()
        obs.end(1, _values(), span=(0.0, 1.0))
        assert _tensor.observers == before and _flight.observer is None
    finally:
        obs.close()                                  # the hooks are this process's: unset
    assert _tensor.observers == before and _flight.observer is None
    trace = run_dir.merge(list((tmp_path / "trace").glob("*.jsonl")))
    names = [(e["name"], e["cat"], e["tid"]) for e in _bars(trace)]
    assert ("Mul", "forward", 1) in names and ("Mul backward", "backward", 1) in names
    assert ("Sum backward", "backward", 1) in names and ("step 1", "step", 0) in names
    np.testing.assert_array_equal(x.grad, [2.0, 2.0, 2.0])             # the same gradient


def test_a_trace_keeps_at_most_max_events_per_rank_and_counts_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir, "MAX_EVENTS", 3)
    obs = run_dir.RankObserver(tmp_path, 0, trace_steps=(0,))
    try:
        obs.begin(0)
        (Tensor(np.ones(3), requires_grad=True) * 2.0).sum().backward()   # 4 op events
        obs.end(0, _values(), span=(0.0, 1.0))                          # + the step's bar
    finally:
        obs.close()
    (part,) = (tmp_path / "trace").glob("*.jsonl")
    assert json.loads(part.read_text())["dropped"] == 2
    assert len(_bars(run_dir.merge([part]))) == 3


def test_trace_steps_argument():
    assert run_dir.steps_argument("0,1") == (0, 1)
    assert run_dir.steps_argument("2-4,7") == (2, 3, 4, 7)
    assert run_dir.steps_argument("none") == ()
    for bad in ("x", "-1", "3-a", ""):
        with pytest.raises(Exception, match="not a list of steps"):
            run_dir.steps_argument(bad)


def test_default_path_lives_in_the_parent_and_never_reuses_a_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_RUN_DIR", str(tmp_path))
    first = run_dir.default_path(Plan(dp=2, tp=2, zero=1))
    assert first.parent == tmp_path and first.name.endswith("-dp2-tp2-zero1")
    first.mkdir()
    second = run_dir.default_path(Plan(dp=2, tp=2, zero=1))
    assert second != first and second.name.startswith(first.name)
    assert run_dir.default_path(Plan()).name.endswith("-single")


CLI = ["--dp", "2", "--task", "reverse", "--length", "3", "--n-layer", "1", "--n-embd", "16",
       "--n-head", "2", "--batch", "4", "--steps", "2", "--every", "1"]


@pytest.mark.multiproc
def test_train_cli_writes_its_run_directory_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIDIST_RUN_DIR", str(tmp_path / "runs"))
    assert train_main(CLI + ["--trace-steps", "1"]) == 0
    out = capsys.readouterr().out
    (made,) = list((tmp_path / "runs").iterdir())
    assert f"run directory: {made} (python -m minidist report {made})" in out
    assert sorted(os.listdir(made)) == ["config.json", "metrics", "summary.json", "trace.json"]
    cfg = json.loads((made / "config.json").read_text())
    assert cfg["command"] == "python -m minidist train " + " ".join(CLI + ["--trace-steps",
                                                                          "1"])
    steps = {e["name"] for e in _bars(json.loads((made / "trace.json").read_text()))
             if e["cat"] == "step"}
    assert steps == {"step 1"} and sorted(metrics.read(made / "metrics")) == [0, 1]
    assert train_main(CLI + ["--run-dir", "none"]) == 0
    assert "run directory" not in capsys.readouterr().out
    assert len(list((tmp_path / "runs").iterdir())) == 1
