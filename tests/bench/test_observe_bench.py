"""The observability benchmark, tiny: it prints the command, a row per mode (off, metrics,
trace) with trace events only where the trace is on, and both overhead lines; no timing is
asserted, only the arithmetic that the lines state. The tiny run (~0.8 s, three modes) is
in the slow set; the features it measures are tested in tests/observe/."""

import re

import pytest

from minidist.bench import observe as bench

TINY = ["--dp", "2", "--steps", "2", "--warmup", "1", "--repeats", "1", "--n-layer", "1",
        "--n-embd", "16", "--n-head", "2", "--length", "3", "--batch-per-rank", "2",
        "--dtype", "float64"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_tiny_run_prints_one_row_per_mode_and_the_overheads(capsys):
    assert bench.main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "$ python -m minidist bench observe " + " ".join(TINY)
    start = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 4]}
    assert list(rows) == ["off", "metrics", "trace"]
    wall = {m: float(r[2]) for m, r in rows.items()}
    for mode, (step, cpu, w, over, events) in rows.items():
        assert float(step) > 0 and float(cpu) > 0 and float(w) > 0
        off, rounding = wall["off"], 0.005                  # the walls are printed to 0.01 ms
        bound = 100 * rounding * (1 / off + wall[mode] / off**2) + 0.05
        assert float(over.rstrip("%")) == pytest.approx((wall[mode] / off - 1) * 100,
                                                        abs=bound)
        assert (int(events) > 0) == (mode == "trace"), (mode, events)
    assert lines[start + 4].startswith("measured: trace ")
    m = re.fullmatch(r"hooks alone: ([\d.]+) us per op \(2 events\) x (\d+) events / 2 per "
                     r"step = ([\d.]+) % of the step time of 'off'", lines[start + 5])
    assert m, lines[start + 5]
    assert int(m[2]) == int(rows["trace"][4])


def test_warmup_below_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--warmup", "0"])
    assert e.value.code == 2 and "--warmup" in capsys.readouterr().err
