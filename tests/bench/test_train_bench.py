"""The training benchmark: a tiny run prints the command, the dp=1 reference, both overlap
modes and (when an engine is importable) the ZeRO rows; bytes match the DP formula. With
--tp: the same global batch on every row, and bytes per axis and activations per layer
equal to parallel/tensor_memory.py's formulas."""

import sys
import types

import pytest

from minidist.bench import train as bench
from minidist.parallel.data import DataParallel

TINY_ARGS = ["--dp", "2", "--steps", "2", "--warmup", "1", "--repeats", "2",
             "--batch-per-rank", "4", "--n-embd", "16", "--n-head", "2", "--length", "3",
             "--dtype", "float64"]


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    return {line[:20].strip(): line[20:].split() for line in lines[start + 1:]}


@pytest.mark.multiproc
def test_tiny_run_prints_the_table(capsys):
    assert bench.main(TINY_ARGS) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "$ python -m minidist bench train " + " ".join(TINY_ARGS)
    rows = _rows(out)
    assert list(rows) == ["dp=1", "2 x dp=1", "dp=2 overlap", "dp=2 no overlap"]
    assert rows["dp=1"][1] == "1.00"                                   # the reference
    for name, cells in rows.items():
        tokens, ratio, step, compute, wait = map(float, cells[:5])
        assert tokens > 0 and step > 0 and 0 <= wait <= step and compute <= step, name
        assert float(cells[5]) > 0, f"{name}: cpu time"
        assert cells[6] == cells[7], f"{name}: bytes sent {cells[6]} != formula {cells[7]}"
    assert rows["dp=2 overlap"][6] != "0" and rows["2 x dp=1"][6] == "0"     # alone: silent


class _Stage(DataParallel):
    def __init__(self, model, group, stage, *, algo, **opt):
        super().__init__(model, group, algo=algo, **opt)


@pytest.mark.multiproc
def test_zero_rows_use_plan_zero(capsys, monkeypatch):
    args = TINY_ARGS + ["--zero", "1,3", "--no-overlap"]
    fake = types.ModuleType("minidist.parallel.zero")
    fake.ZeroEngine = _Stage                         # forked ranks inherit this entry
    monkeypatch.setitem(sys.modules, "minidist.parallel.zero", fake)
    bench.main(args)
    assert list(_rows(capsys.readouterr().out)) == ["dp=1", "2 x dp=1", "dp=2 no overlap",
                                                    "dp=2 zero-1", "dp=2 zero-3"]
    monkeypatch.setitem(sys.modules, "minidist.parallel.zero", None)    # import fails
    bench.main(args)
    assert "zero-1: skipped, the ZeRO engine is not importable" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    for args in (["--zero", "4"], ["--steps", "0"], ["--sp"], ["--tp", "2", "--zero", "1"],
                 ["--tp", "2", "--dp", "2", "--batch", "3"], ["--tp", "3"]):   # 4 heads
        with pytest.raises(SystemExit):
            bench.main(args)


TP_ARGS = ["--steps", "2", "--warmup", "1", "--repeats", "1", "--batch", "4", "--n-layer", "2",
           "--n-embd", "16", "--n-head", "2", "--length", "3", "--dtype", "float64"]
TP_HEADER = ["run", "ranks", "tokens/s", "ratio", "step", "ms", "compute", "ms", "cpu", "ms",
             "dp", "sent", "2(D-1)/D", "Ψ", "tp", "sent", "formula", "act/layer", "formula"]


def _tp_rows(out: str) -> dict[str, list[int]]:
    """{run: [ranks, dp sent, its formula, tp sent, formula, act/layer, formula]}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[start].split() == TP_HEADER
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("Korthikanti"):
            break
        cells = line[20:].split()
        tokens, ratio, step, compute, cpu = map(float, cells[1:6])
        assert tokens > 0 and compute <= step and cpu > 0, line
        rows[line[:20].strip()] = [int(c.replace(",", "")) for c in [cells[0]] + cells[6:]]
    assert rows and lines[start + 1][20:].split()[2] == "1.00"          # dp=1: the reference
    return rows


@pytest.mark.multiproc
@pytest.mark.parametrize("extra, names", [
    (["--tp", "2", "--sp"], ["dp=1", "tp=2", "tp=2 sp"]),
    (["--tp", "2", "--dp", "2"], ["dp=1", "dp=2", "dp=2 tp=2"])])
def test_tiny_tp_run_prints_bytes_and_activations_next_to_the_formulas(capsys, extra, names):
    args = extra + TP_ARGS
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "$ python -m minidist bench train " + " ".join(args)
    assert "Korthikanti et al. 2022, Table 2" in out
    rows = _tp_rows(out)
    assert list(rows) == names
    for name, (ranks, dp, dp_f, tp, tp_f, act, act_f) in rows.items():
        assert (dp, tp, act) == (dp_f, tp_f, act_f), f"{name}: measured != formula"
        assert ranks == (2 if "dp=2" in name else 1) * (2 if "tp=2" in name else 1), name
        assert (tp > 0) == ("tp=2" in name) and (dp > 0) == ("dp=2" in name), name
    acts = [cells[5] for cells in rows.values()]
    assert acts[1] < acts[0] and acts[2] < acts[0]            # splitting keeps less per rank
    if "--sp" in extra:
        assert acts[2] < acts[1]                              # SP: LayerNorms on T / tp
