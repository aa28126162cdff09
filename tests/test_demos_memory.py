"""The memory demos run as a reader runs them and end with their OK line."""

import pytest

from tests.helpers import run_demo


# slow: the default run keeps only the cheapest demos (~0.4-0.9 s each); this one is ~1 s
@pytest.mark.slow
def test_recompute_demo_shows_the_timeline_and_ends_ok():
    rc, out = run_demo("19_recompute.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 19 · activation recomputation · GPT 4 layers"), out[0]
    header = next(line for line in out if line.split()[:3] == ["none", "selective", "full"])
    rows = out[out.index(header) + 1:out.index(header) + 11]
    assert [r.split()[0] for r in rows[:1] + rows[6:7]] == ["forward", "backward"], text
    kb = {m: [float(r.split()[-3 + i]) for r in rows] for i, m in enumerate(header.split())}
    assert kb["full"][-5] < kb["selective"][-5] < kb["none"][-5]   # kept after the forward
    assert [line.split("|")[0].strip() for line in out if line.startswith("peak ")] == \
        ["peak none", "peak selective", "peak full"]
    assert out[-2].startswith("selective and full vs the plain backward: max |Δ| = 0.0e+00 "
                              "over "), text
    assert out[-1] == ("OK: recomputed gradients = the plain backward's, bitwise; MoE routed "
                       "once; kept bytes = formula"), text
