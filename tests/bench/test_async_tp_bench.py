"""bench/async_tp.py: the table's rows on both links, the bytes per step (counted in both modes,
and the formula: 5 collectives of B T_tp C float64), the two modes' numbers compared, every
line within 100 characters. No time is asserted."""

import re

import pytest

from minidist.bench import async_tp as bench


def test_the_table_the_bytes_and_the_agreement(capsys):
    B, T, C = 2, 8, 8
    assert bench.main(["--batch", str(B), "--seq", str(T), "--width", str(C), "--repeats", "1",
                       "--iters", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    sent = [int(m[1].replace(",", "")) for line in out
            if (m := re.match(r"  .{31}(?:plain SP|async TP) +[-\d.]+ +[-\d.]+ +([\d,]+)", line))]
    assert sent == [5 * B * (T // 2) * C * 8] * 4, out          # 2 links x 2 modes
    assert sum("hidden = 1 - comm_async / comm_plain" in line for line in out) == 1
    verdicts = [line for line in out if "async TP's y, dx, dW equal plain SP's" in line]
    assert [v.split(":")[0] for v in verdicts] == ["shared memory", "emulated"], out
    assert all(len(line) <= 100 for line in out)


@pytest.mark.parametrize("argv, words", [(["--seq", "7"], "must be even"),
                                         (["--link", "fast"], "invalid choice")])
def test_bad_options_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert words in capsys.readouterr().err
