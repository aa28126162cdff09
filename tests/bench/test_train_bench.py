"""The training benchmark: a tiny run prints the command, the dp=1 reference, both overlap
modes and (when an engine is importable) the ZeRO rows; bytes match the DP formula."""

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
    with pytest.raises(SystemExit):
        bench.main(["--zero", "4"])
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0"])
