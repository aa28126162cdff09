"""The observability demo runs as a user runs it: a dp=2 x tp=2 run with its run directory in
a temporary folder, the trace per rank, the report; it ends with its OK line (every call of
the traced step is in the trace, by each rank's flight recorder) and leaves nothing behind."""

import os
import re
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
PREFIX = "minidist-demo25-"


def _temp_folders() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(PREFIX)}


# slow (~0.9 s): the default run keeps only the cheapest demos, and the tp axis and a
# composition of axes are covered there by demo 09 and tests/reliability/test_straggler.py
@pytest.mark.slow
def test_observability_demo_shows_the_run_directory_trace_and_report_and_ends_ok():
    before = _temp_folders()
    rc, out = run_demo("25_observability.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 25 · observability · dp=2 x tp=2 = 4 ranks"), out[0]
    for line in ("== the run directory run/ ==", "  config.json  (", "  metrics/",
                 "    rank3.jsonl  (3 lines)", "  summary.json  (", "  trace.json  (",
                 "== python -m minidist report RUN_DIR --no-plots =="):
        assert any(x.startswith(line) for x in out), f"missing {line!r}\n{text}"
    for r in range(4):
        at = next(i for i, x in enumerate(out) if x.startswith(f"rank {r}: "))
        assert "all_reduce on tp" in out[at + 1], out[at:at + 2]
    assert re.fullmatch(r"calls in the trace (\d+), \1, \1, \1 = the flight recorder's "
                        r"counts; sequence numbers", out[-3]), out[-3]
    assert out[-2] == "  contiguous and equal on every group (4)", out[-2]
    assert out[-1] == "OK: the trace has every collective of the traced steps (4 ranks)"
    assert _temp_folders() <= before, f"left {_temp_folders() - before}"


@pytest.mark.slow
def test_observability_demo_keeps_the_trace_it_tells_you_to_open(tmp_path):
    """Without --keep it says the folder is gone; with --keep DIR the trace it names is there."""
    rc, out = run_demo("25_observability.py", "--steps", "2", "--keep", str(tmp_path))
    assert rc == 0, "\n".join(out)
    trace = tmp_path / "run" / "trace.json"
    at = out.index("open in https://ui.perfetto.dev:")
    assert out[at + 1] == f"  {trace}" and trace.is_file()
