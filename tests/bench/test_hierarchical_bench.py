"""bench/hierarchical.py: the table's rows, the bytes across nodes each algorithm sends (the
formulas: a flat ring's edge ranks send all of theirs across, the two-level form 1/L of it)
and the intra-node tier fitted from one ring all-reduce. No time is asserted."""

import re

import pytest

from minidist.__main__ import main as cli
from minidist.bench import hierarchical as bench


def test_the_table_and_the_bytes_across_nodes(capsys):
    assert cli(["bench", "hierarchical", "--world", "4", "--per-node", "2", "--sizes", "64K",
                "--repeats", "1", "--iters", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {}
    for line in out:
        m = re.match(r"  (\w+) +64K (ring|hierarchical|auto: \w+) +[\d.]+ +[\d.]+ +[\d.]+ +"
                     r"([\d,]+)$", line)
        if m:
            rows[m[1], m[2]] = int(m[3].replace(",", ""))
    n, W, L = 64 << 10, 4, 2
    assert rows["all_reduce", "ring"] == 2 * (W - 1) * n // W        # an edge rank: all
    assert rows["all_reduce", "hierarchical"] == 2 * (1 / 2) * n // L
    assert rows["reduce_scatter", "hierarchical"] == n // L // 2
    assert rows["all_gather", "hierarchical"] == n                     # my piece, once
    assert len(rows) == 9 and all(len(line) <= 100 for line in out)


def test_the_intra_link_follows_from_one_ring_all_reduce():
    link = bench.intra_link(4, 2 * 3 * 1e-5 + 1.5 * bench.FIT * 1e-9, 1e-5)
    assert link.alpha == 1e-5 and link.beta == pytest.approx(1e-9)


@pytest.mark.parametrize("argv, words", [(["--world", "4", "--per-node", "4"], "2 or more nodes"),
                                         (["--sizes", "12Q"], "is not a size")])
def test_bad_options_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert words in capsys.readouterr().err
