"""The training benchmark: a tiny run prints the command, the dp=1 reference, both overlap
modes and the ZeRO rows; bytes match the DP formula. With --tp: the same global batch on
every row, and bytes per axis and activations per layer equal to parallel/tensor/memory.py's
formulas; with --cp: bytes over cp and activations equal to parallel/context/memory.py's,
attention work per layout, the ring's hidden send time.

The default run keeps one --tp run, dp x tp (a composition; its dp column is the DP bytes
formula), and one --cp run (the ring); the dp-only table with both overlap modes, the ZeRO
rows, tp with sp and dp x cp (Ulysses) are in the slow set."""

import pytest

from minidist.bench import train as bench

TINY_ARGS = ["--dp", "2", "--steps", "2", "--warmup", "1", "--repeats", "2",
             "--batch-per-rank", "4", "--n-embd", "16", "--n-head", "2", "--length", "3",
             "--dtype", "float64"]


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    return {line[:20].strip(): line[20:].split() for line in lines[start + 1:]}


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero_rows_use_plan_zero(capsys):
    args = TINY_ARGS + ["--zero", "1,3", "--no-overlap"]
    bench.main(args)
    assert list(_rows(capsys.readouterr().out)) == ["dp=1", "2 x dp=1", "dp=2 no overlap",
                                                    "dp=2 zero-1", "dp=2 zero-3"]


def test_bad_arguments_are_refused():
    for args in (["--zero", "4"], ["--steps", "0"], ["--sp"], ["--tp", "2", "--zero", "1"],
                 ["--tp", "2", "--dp", "2", "--batch", "3"], ["--tp", "3"],   # 4 heads
                 ["--cp", "2", "--tp", "2"], ["--cp", "2", "--zero", "1"],
                 ["--cp", "3"], ["--cp", "0"]):                    # T = 512 is not 6 chunks
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
    pytest.param(["--tp", "2", "--sp"], ["dp=1", "tp=2", "tp=2 sp"], marks=pytest.mark.slow),
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


CP_HEADER = ["run", "ranks", "tokens/s", "ratio", "step", "ms", "cpu", "ms", "cp", "sent",
             "formula", "hidden", "GF", "zz", "max/mean", "GF", "ct", "max/mean", "act/layer",
             "formula", "1", "process"]


@pytest.mark.multiproc
@pytest.mark.parametrize("extra, names", [
    (["--cp", "2"], ["dp=1", "cp=2 ring"]),
    pytest.param(["--cp", "2", "--dp", "2", "--cp-algo", "ulysses"],
                 ["dp=1", "dp=2", "dp=2 cp=2 ulysses"], marks=pytest.mark.slow)])
def test_tiny_cp_run_prints_bytes_work_and_memory_next_to_the_formulas(capsys, extra, names):
    args = extra + TP_ARGS[:-3] + ["4", "--dtype", "float64"]              # T = 8: 4 chunks
    assert bench.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "$ python -m minidist bench train " + " ".join(args)
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[start].split() == CP_HEADER
    end = start + 1 + len(names)
    rows = {line[:20].strip(): line[20:].split() for line in lines[start + 1:end]}
    assert list(rows) == names and rows["dp=1"][2] == "1.00"
    num = lambda c: int(c.replace(",", ""))                                 # noqa: E731
    for name, cells in rows.items():
        tokens, ratio, step, cpu = map(float, cells[1:5])
        assert tokens > 0 and step > 0 and cpu > 0, name
        sent, formula, act, act_formula = num(cells[5]), num(cells[6]), num(cells[12]), \
            num(cells[13])
        assert (sent, act) == (formula, act_formula), f"{name}: measured != formula"
        assert (sent > 0) == ("cp=2" in name), name
        zz, ct = float(cells[9]), float(cells[11])                         # max/mean
        if "ring" in name:
            assert cells[7].endswith("%") and zz == 1.0 and ct == pytest.approx(4 / 3, abs=1e-3)
        else:
            assert cells[7] == "-" and zz == ct == 1.0, name
        if "cp=2" in name:
            assert act < num(cells[14]), f"{name}: a cp rank keeps less than one process"
    notes = "\n".join(lines[end:])
    assert "targets (issue 8" in notes
