"""The context-parallel demos (ring attention, Ulysses) run as a user runs them: they end with
their OK line, print the same text twice, and the ring demo writes a Chrome trace in which
every rank has the compute of each ring step and every send.

The default run keeps one ring-attention run (the cheapest: 3 ranks, contiguous, with its
trace checked); the default-layout runs, the determinism checks and Ulysses are in the slow
set."""

import json

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
RING, ULYSSES = "10_ring_attention.py", "11_ulysses.py"


def _ok(name: str, cp: int, *args: str) -> list[str]:
    rc, out = run_demo(name, *args)
    assert rc == 0 and out[-1].startswith(f"OK: cp={cp} "), "\n".join(out)
    assert out[0].startswith(f"demo {name[:2]} · ") and f"cp={cp} " in out[0], out[0]
    return out


def _check_trace(path, W: int) -> None:
    """Valid Trace Event Format JSON; per rank: W forward and W backward ring steps of
    compute, and 3W-2 sends (W-1 K/V forward; W-1 K/V and W dK/dV backward)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(W)), "every rank has events"
    for r in range(W):
        mine = [e for e in events if e["pid"] == r]
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
        for phase in ("forward", "backward"):
            steps = sorted(e["args"]["step"] for e in mine
                           if e["cat"] == "compute" and e["name"].startswith(phase))
            assert steps == list(range(W)), f"rank {r}: {phase} compute steps {steps}"
        sends = [e for e in mine if e["cat"] == "send"]
        assert len(sends) == 3 * W - 2 and all(e["tid"] == 1 for e in sends), f"rank {r}"


@pytest.mark.slow
def test_ring_attention_demo_default_is_deterministic_and_writes_a_trace(tmp_path):
    path = tmp_path / "ring.json"
    out = _ok(RING, 4, "--trace", str(path))
    _check_trace(path, 4)
    assert run_demo(RING, "--trace", str(path)) == (0, out)
    text = "\n".join(out)
    assert "rank 0: 0 1 14 15 | rank 1: 2 3 12 13 | rank 2: 4 5 10 11 | rank 3: 6 7 8 9" in text
    assert "   0 | K/V 0 partial 4x4  | K/V 1 partial 4x4" in text        # the diagonal blocks
    assert "   1 | K/V 3 full    2x4  | K/V 0 full    4x2" in text        # half of each other one
    assert "query at position 15 (rank 0)" in text
    assert "  zigzag       40   40   40   40   max/mean = 1.00   <- this run" in text
    assert "  contiguous   16   32   48   64   max/mean = 1.60" in text
    assert sum(line.startswith("step ") and "| loss cp=4 ring " in line for line in out) == 3


def test_ring_attention_demo_contiguous_on_3_ranks_skips_the_future(tmp_path):
    path = tmp_path / "ring3.json"
    text = "\n".join(_ok(RING, 3, "--cp", "3", "--layout", "contiguous", "--trace", str(path)))
    _check_trace(path, 3)
    assert "   2 | K/V 1 skip         | K/V 2 skip         | K/V 0 full    4x4" in text
    assert "  contiguous   16   32   48   max/mean = 1.50   <- this run" in text


@pytest.mark.slow
def test_ulysses_demo_default_is_deterministic_and_shows_both_all_to_alls():
    out = _ok(ULYSSES, 2)
    assert run_demo(ULYSSES) == (0, out)
    text = "\n".join(out)
    assert "after it            q, k, v (3, 1, 2, 8, 4)   heads 2-3" in text
    assert "pos 0 1 6 7 | 2 3 4 5" in text                  # source-rank order, zig-zag
    assert "measured, the same on every rank: True" in text


@pytest.mark.slow
def test_ulysses_demo_on_3_ranks():
    text = "\n".join(_ok(ULYSSES, 3, "--cp", "3"))
    assert "heads 0-1 | 2-3 | 4-5" in text and "pos 0 1 10 11 | 2 3 8 9 | 4 5 6 7" in text
