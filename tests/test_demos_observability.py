"""The observability demo runs as a user runs it: a dp=2 x tp=2 run whose run directory is
written where `python -m minidist train` writes its own (runs/<UTC time>-dp2-tp2 in the
current folder) and kept, so that the trace the demo tells the user to open is there; the
trace per rank, the report (its per-rank table folded to 100 characters); it ends with its
OK line (every call of the traced step is in the trace, by each rank's flight recorder).
The demo runs in a temporary folder, so the run directory goes with it."""

import json
import re
from pathlib import Path

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


def _kept(out: list[str]) -> Path:
    """The run directory the demo says it kept."""
    return Path(out[out.index("the run directory is kept:") + 1].strip())


# slow (~0.9 s): the default run keeps only the cheapest demos, and the tp axis and a
# composition of axes are covered there by demo 09 and tests/reliability/test_straggler.py
@pytest.mark.slow
def test_observability_demo_keeps_the_run_directory_it_shows_and_ends_ok(tmp_path, monkeypatch):
    monkeypatch.delenv("MINIDIST_RUN_DIR", raising=False)
    rc, out = run_demo("25_observability.py", cwd=tmp_path)
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 25 · observability · dp=2 x tp=2 = 4 ranks"), out[0]
    path = _kept(out)
    assert re.fullmatch(r"runs/\d{8}-\d{6}-dp2-tp2", str(path)), path
    trace = tmp_path / path / "trace.json"                  # what the user is told to open
    assert out[out.index("the run directory is kept:") + 2].startswith(
        "open its trace.json in https://ui.perfetto.dev"), text
    assert {e["pid"] for e in json.loads(trace.read_text())["traceEvents"]} == set(range(4))
    for line in (f"== the run directory {path.name}/ ==", "  config.json  (", "  metrics/",
                 "    rank3.jsonl  (3 lines)", "  summary.json  (", "  trace.json  (",
                 "== python -m minidist report RUN_DIR --no-plots ==",
                 "  rank   step ms       compute ms", "  rank     sent dp    sent tp  model state"):
        assert any(x.startswith(line) for x in out), f"missing {line!r}\n{text}"
    for r in range(4):                  # (a line wrapped at 100 characters goes on below)
        assert re.search(rf"(?m)^rank {r}: [^\n]*all_reduce on\s+tp\d", text), r
    calls = re.fullmatch(r"calls per rank of the traced step, in the trace: (\d+), \1, \1, \1; "
                         r"by the flight recorder:", out[-3])
    assert calls and out[-2].startswith(f"  {', '.join([calls[1]] * 4)}; sequence numbers "
                                        "contiguous and equal on every group (4)"), out[-3:]
    assert out[-1] == "OK: the trace has every collective call of the traced step, on all 4 ranks"


@pytest.mark.slow
def test_observability_demo_writes_where_run_dir_says_and_refuses_a_used_one(tmp_path):
    rc, out = run_demo("25_observability.py", "--run-dir", str(tmp_path / "mine"),
                       "--steps", "2", cwd=tmp_path)
    assert rc == 0 and _kept(out) == tmp_path / "mine", "\n".join(out)
    assert (tmp_path / "mine" / "trace.json").is_file() and not (tmp_path / "runs").exists()
    rc, out = run_demo("25_observability.py", "--run-dir", str(tmp_path / "mine"))
    assert rc == 2 and len(out) == 1 and out[0].startswith(
        f"error: --run-dir {tmp_path / 'mine'} is not empty; give a new directory"), out
