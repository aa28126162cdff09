"""The determinism benchmark: a tiny run prints the command, a normal row and one row per
grain for each layout, equal digests for the same grain across layouts, an OK line per
grain against the single process, and exit code 0; a layout the deterministic mode refuses
(cp) prints `refused: <the ValueError>` rows and its normal row, without crashing."""

import pytest

from minidist.bench import determinism as bench
from minidist.train import Plan

pytestmark = pytest.mark.multiproc

TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--length", "4", "--batch", "4",
        "--steps", "1", "--warmup", "0", "--repeats", "1", "--grains", "1,2",
        "--dtype", "float64"]


def _table(out: str) -> dict[tuple[str, str], str]:
    """{(layout, mode): the rest of the row} of the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("target:"):
            break
        words = line.split()
        cut = 2 if words[1] == "normal" else 3              # "normal" | "det grain=G"
        rows[words[0], " ".join(words[1:cut])] = " ".join(words[cut:])
    return rows


def test_tiny_run_prints_costs_and_equal_digests(capsys):
    args = TINY + ["--layouts", "dp=2,pp=2,cp=2"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "$ python -m minidist bench determinism " + " ".join(args)
    rows = _table(out)
    assert list(rows) == [(lay, mode) for lay in ("dp=2", "pp=2", "cp=2")
                          for mode in ("normal", "det grain=1", "det grain=2")]
    for lay in ("dp=2", "pp=2"):
        for mode in ("normal", "det grain=1", "det grain=2"):
            step, ratio, digest = rows[lay, mode].split()
            assert float(step) > 0 and ratio.endswith("x"), (lay, mode)
            assert len(digest) == bench.DIGITS and int(digest, 16) >= 0, (lay, mode)
        assert rows[lay, "normal"].split()[1] == "1.00x"
    for g in (1, 2):                      # the promise: same grain, same bits, any layout
        digests = {rows[lay, f"det grain={g}"].split()[2] for lay in ("dp=2", "pp=2")}
        assert len(digests) == 1, f"grain {g}: {digests}"
        assert f"OK: grain {g}: dp=2, pp=2 end bitwise equal to the single process " \
               f"(sha256 {digests.pop()})" in out
    assert rows["dp=2", "det grain=1"].split()[2] != rows["dp=2", "det grain=2"].split()[2]
    # cp: the normal row runs, the deterministic rows carry deterministic.check's message
    assert float(rows["cp=2", "normal"].split()[0]) > 0
    for g in (1, 2):
        assert rows["cp=2", f"det grain={g}"].startswith(
            "refused: --deterministic with cp=2 needs --token-tiles N")
    assert "target: deterministic step time <= 1.5x the normal mode's" in out
    assert "MISMATCH" not in out


def test_layouts_and_grains_parse():
    assert bench.parse_layout("dp=2:zero=1") == Plan(dp=2, zero=1, check_placements=False)
    assert bench.parse_layout("pp=2:schedule=gpipe") == Plan(pp=2, schedule="gpipe",
                                                             check_placements=False)
    assert bench.parse_grains("1, 4,max") == [1, 4, "max"]
    for bad in ("dp", "dq=2", "dp=two"):
        with pytest.raises(ValueError, match="--layouts"):
            bench.parse_layout(bad)


def test_usage_errors_exit_2(capsys):
    for args in (["--layouts", "dp=3"], ["--grains", "0"], ["--layouts", "dp=2;tp=2"]):
        with pytest.raises(SystemExit) as e:
            bench.main(TINY + args)
        assert e.value.code == 2, args
        assert capsys.readouterr().err.startswith("error: "), args
