"""The pipeline benchmark: on a tiny model, every schedule sends exactly the bytes of the
formula, holds as many activations as peak_activations says, and (GPipe, 1F1B,
interleaved) exactly the bytes of that many micro-batches alone; the command prints the
table and writes the trace. Timings are printed, never asserted.

The command in a process of its own (~1 s) is in the slow set; the default run keeps
run_bench with every schedule, the table and the usage errors."""

import functools
import subprocess
import sys

import pytest

from minidist.bench import pipeline as bench
from minidist.data import DataConfig, model_config_for
from minidist.observe.trace import Trace
from minidist.parallel.pipeline import family, schedules
from minidist.parallel.pipeline.schedule_sim import peak_activations

DATA = DataConfig(task="sort", length=4)                    # T = 8
TINY = ["--n-embd", "16", "--n-head", "2", "--length", "4", "--rows", "2",
        "--micro-batches", "4", "--dtype", "float64"]


@functools.lru_cache(maxsize=None)
def _results() -> dict:
    cfg = model_config_for(DATA, n_layer=4, n_embd=16, n_head=2, dtype="float64")
    return bench.run_bench(cfg, DATA, P=2, M=4, V=2, steps=1, repeats=1, rows=2)


def test_formulas_by_hand():
    one = schedules.one_f_one_b(2, 4)
    assert bench.p2p_formula(one, 10) == [40, 40]            # 4 F out of stage 0, 4 B of 1
    inter = schedules.interleaved_1f1b(2, 4, 2)              # virtual stages 0 1 | 2 3
    assert bench.p2p_formula(inter, 10) == [120, 120]        # 8 F + 4 B; 4 F + 8 B
    for name in family.SCHEDULES:
        P, M = (3, 5) if family.runs_on(name, 3, 5) else (2, 4)
        s = family.make_schedule(name, P, M, 2)
        ones = [[1] * s.chunks for _ in range(s.stages)]
        assert bench.held_bytes_formula(s, ones) == peak_activations(s), name
    # stage 0 peaks at F2 (3 of chunk 0, 2 of chunk 1 held), stage 1 at F2 (3 of chunk 0)
    assert bench.held_bytes_formula(inter, [[3, 5], [7, 2]]) == [3 * 3 + 5 * 2, 3 * 7]


@pytest.mark.multiproc
def test_bytes_and_held_activations_match_the_formulas():
    res = _results()
    assert list(res) == list(family.SCHEDULES)
    for name, r in res.items():
        sched = bench.make_plan(name, 2, 4, 2).pipeline_schedule()
        assert r["act_bytes"] == 2 * DATA.block_size * 16 * 8, name    # rows T C itemsize
        for s in range(2):
            assert r["sent"][s] == [r["sent_formula"][s]] * 3, (name, s)  # warm-up, 1, memory
        assert r["sent_formula"] == bench.p2p_formula(sched, r["act_bytes"])
        assert r["held"] == r["held_sched"] == peak_activations(sched), name
        assert 0 <= r["measured"] <= 1 and 0 <= r["simulated"] <= 1, name


@pytest.mark.multiproc
def test_held_bytes_are_count_times_one_micro_batch_alone():
    res = _results()
    for name in ("gpipe", "1f1b"):
        r = res[name]
        assert r["held_bytes"] == [n * b for n, (b,) in zip(r["held_sched"], r["unit_bytes"])]
    inter = res["interleaved"]                 # chunks differ: the order-based weighted scan
    assert inter["held_bytes"] == inter["held_bytes_formula"]
    zb = res["zb-h1"]                          # after B, W keeps only part of the graph
    assert all(0 < g <= f for g, f in zip(zb["held_bytes"], zb["held_bytes_formula"]))
    assert zb["held_bytes"] != zb["held_bytes_formula"]
    assert "MISMATCH" not in bench.render_table(res)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_command_prints_the_table_and_writes_the_trace(tmp_path):
    path = tmp_path / "pipe.json"
    args = ["--pp", "2", "--schedule", "1f1b", "--steps", "2", "--repeats", "1", *TINY,
            "--trace", str(path)]
    res = subprocess.run([sys.executable, "-m", "minidist", "bench", "pipeline", *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "$ python -m minidist bench pipeline " + " ".join(args)
    head = next(i for i, line in enumerate(lines) if line.startswith("schedule "))
    assert lines[head].split()[:6] == ["schedule", "M", "closed", "simulated", "measured",
                                      "|Δ|"]
    row = lines[head + 1].split()
    assert row[:3] == ["1f1b", "4", "20.0%"] and row[-1] == "OK" and row[-3] == "OK"
    assert "== measured (median step) ==" in res.stdout and "MISMATCH" not in res.stdout
    events = Trace.read(path).events()
    assert len(events) == 2 * 2 * 4                    # 2 stages x (F, B) x 4 micro-batches


def test_bad_arguments_are_refused(capsys):
    for args in (["--pp", "1"], ["--steps", "0"], ["--schedule", "nope"],
                 ["--schedule", "interleaved", "--n-layer", "3"]):       # 4 pieces
        with pytest.raises(SystemExit):
            bench.main(args)
    assert "need at least 4 layers" in capsys.readouterr().err
