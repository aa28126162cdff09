"""The pipeline demo runs as a user runs it: the schedule family drawn with their bubbles and
peaks equal to the closed forms and claims, real pp=2 runs (DualPipe's two directions among
them) whose losses equal the 1-process run, an OK line.
Its measured timelines draw every action the stage ran, whatever the machine's load made of
their durations (nothing here depends on time)."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
DEMO = "12_pipeline.py"


def _ok(*args: str, drawn: int = 12) -> list[str]:
    rc, out = run_demo(DEMO, *args)
    assert rc == 0 and out[-1].startswith(f"OK: {drawn} schedules valid, bubbles and peaks as "
                                          "stated; pp=2 losses = 1 process"), "\n".join(out)
    assert out[0].startswith("demo 12 · pipeline parallel · "), out[0]
    return out


def _rows(out: list[str], header: str | int) -> list[str]:
    """The stage rows drawn under the line that starts with `header` (or under out[header]),
    each joined again from the blocks of at most 30 cells it is drawn in ("  ... from cell
    30:" between them; a row that goes on lost its trailing blanks)."""
    i = header if isinstance(header, int) else next(
        i for i, line in enumerate(out) if line.startswith(header))
    rows: list[str] = []
    part, stage = 0, 0
    for line in out[i + 1:]:
        if line.startswith("  ... from cell "):
            part, stage = part + 1, 0
        elif not line.startswith("stage "):
            return rows
        elif part == 0:
            rows.append(line)
        else:
            head = line[:line.index("|") + 1]
            rows[stage] = rows[stage].ljust(len(head) + 3 * 30 * part) + line[len(head):]
            stage += 1
    return rows


def _actions(row: str) -> list[str]:
    """The actions a drawn row shows, in order: each cell's label, repeats merged."""
    cells = [row[i:i + 3].strip() for i in range(row.index("|") + 1, len(row) - 1, 3)]
    return [c for k, c in enumerate(cells) if c != "." and (k == 0 or c != cells[k - 1])]


# both slow (~1-2 s each): the default run keeps only the cheapest demos
@pytest.mark.slow
def test_pipeline_demo_default_draws_the_family_and_matches_one_process():
    out = _ok()
    text = "\n".join(out)
    gpipe = _rows(out, "gpipe: P=4, M=8, bubble 27.3% (1 cell = 1 time unit)")
    assert len(gpipe) == 4, gpipe
    assert gpipe[0] == "stage 0 |F0 F1 F2 F3 F4 F5 F6 F7 " + ".  " * 9 + "".join(
        f"B{m} B{m} " for m in range(8)).rstrip() + " |"
    assert "  ... from cell 30:" in out                      # 33 cells: a second block
    assert len(_rows(out, "zb-h1: P=4, M=8, bubble 11.1%")) == 4
    for line in ("  bubble 3/11 = 27.3% | closed form (P-1)/(M+P-1) = 27.3%, equal: True",
                 "  bubble 3/19 = 15.8% | closed form (P-1)/(V M+P-1) = 15.8%, equal: True",
                 "  bubble 1/9 = 11.1% | closed form (P-1)/(3 M+P-1) = 11.1%, equal: True",
                 "  peak activations held per stage: 8 8 8 8   (M on every stage)",
                 "  peak activations held per stage: 4 3 2 1   (min(P-s, M) on stage s)",
                 "peak activations held per stage: measured [2, 1], peak_activations [2, 1]",
                 "peak activations held per stage: measured [2, 2], peak_activations [2, 2]"):
        assert line in out, f"missing {line!r}\n{text}"
    for title in ("== simulated with these costs ==", "== measured =="):
        drawn = [i for i, line in enumerate(out) if line == title]
        assert len(drawn) == 3, text                       # one per real schedule
        for i, kinds in zip(drawn, ("FB", "FBW")):        # every action of the step, in
            rows = _rows(out, i + 1)                       # order, whatever the load made
            assert len(rows) == 2, out[i:i + 4]            # of their durations
            for s, row in enumerate(rows):
                want = sorted(f"{k}{m}" for k in kinds for m in range(4))
                assert sorted(_actions(row)) == want, f"stage {s}: {row}"
        rows = _rows(out, drawn[2] + 1)                    # DualPipe: both directions, and
        assert len(rows) == 2 and all("&" in row for row in rows), rows   # overlapped pairs
        assert any(c in rows[0] for c in ("X", "x")) and "f2" in rows[0] and "F0" in rows[1]
    assert "peak activations held per stage: measured [3, 3], peak_activations [3, 3]" in out
    trade = next(i for i, line in enumerate(out) if line.startswith("== the trade-off"))
    table = {line.split()[0]: line.split() for line in out[trade + 2:trade + 14]}
    assert sorted(table) == sorted(("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-1p",
                                    "zb-2p", "zbv", "v-half", "v-min", "dualpipe",
                                    "dualpipev")), table
    assert table["zb-1p"][3] == "0.33" and table["zb-2p"][3] == "0.00"    # x 1F1B's bubble
    assert table["v-half"][4:6] == ["3", "0.75"] and table["v-min"][4:6] == ["2", "0.50"]
    assert table["dualpipe"][4:6] == ["5", "1.25"]         # P+1 pieces held
    for name in ("1f1b", "zb-h1", "dualpipe"):
        assert sum(line.startswith("step ") and f"| loss pp=2 {name} " in line
                   for line in out) == 3


@pytest.mark.slow
def test_pipeline_demo_with_fewer_micro_batches_than_stages_and_a_real_interleaved_run():
    out = _ok("--M", "2", "--run", "interleaved", "--run-m", "2", "--steps", "2", drawn=10)
    text = "\n".join(out)
    assert "  M=2 < P=4, the pipeline never fills" in out
    assert "(M not a multiple of P: not checked)" in text
    assert "peak activations held per stage: measured [4, 3], peak_activations [4, 3]" in out
    assert sum("| loss pp=2 interleaved " in line for line in out) == 2
