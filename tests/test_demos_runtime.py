"""Demos 01-03 (ranks, collectives, ring trace) run as a user runs them and end with OK.
The default run keeps one run of each demo (01 on 4 ranks, 02 on 4 ranks, 03); the other
sizes and the determinism check are in the slow set."""

import json

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("args", [[], pytest.param(["--world-size", "6", "--dp", "3"],
                                                  marks=pytest.mark.slow)])
def test_hello_ranks(args):
    rc, out = run_demo("01_hello_ranks.py", *args)
    assert rc == 0 and out[-1].startswith("OK: "), "\n".join(out)
    W = int(args[1]) if args else 4
    assert sum(line.startswith("rank ") and " pid " in line for line in out) == W


@pytest.mark.parametrize("W, n", [(4, 4), pytest.param(3, 5, marks=pytest.mark.slow)])
def test_collectives_demo_matches_the_oracle(W, n):
    rc, out = run_demo("02_collectives.py", "--world-size", str(W), "--n", str(n))
    assert rc == 0, "\n".join(out)
    assert out[-1].startswith(f"OK: every collective matches the oracle on {W} ranks")
    blocks = [line for line in out if line.startswith("== ")]
    assert [b.split()[1] for b in blocks] == ["broadcast", "reduce", "all_reduce",
                                              "reduce_scatter", "all_gather", "gather",
                                              "scatter", "all_to_all"]


@pytest.mark.slow
def test_collectives_demo_output_is_deterministic():
    assert run_demo("02_collectives.py", "--world-size", "3") == \
        run_demo("02_collectives.py", "--world-size", "3")


def test_ring_trace_demo_writes_a_perfetto_trace(tmp_path):
    path = tmp_path / "ring.json"
    rc, out = run_demo("03_ring_trace.py", "--world-size", "3", "--n", "5", "--trace", str(path))
    assert rc == 0 and out[-1].startswith("OK: ring all_reduce on 3 ranks"), "\n".join(out)
    steps = [line for line in out if line.startswith("[rank ")]
    assert len(steps) == 3 * 2 * (3 - 1)                           # W lines per step
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert sorted({e["pid"] for e in complete}) == [0, 1, 2]
    assert len(complete) == 3 * (1 + 2 * (3 - 1))                  # one call + 2(W-1) steps
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
