"""The determinism demo runs as a user runs it: as usual the layouts' parameter hashes
differ (the same numbers summed in other orders: within 1e-10, as it measures); with
--deterministic every layout of the dense GPT (dp, ZeRO, pp schedules, tp, SP, cp) and of
the MoE GPT (ep, pp) equals its deterministic single process, and it ends with its OK line.
Slow (19 layouts and 2 single processes, ~30 s): the layouts themselves run by default in
tests/deterministic/."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


@pytest.mark.slow
def test_determinism_demo_prints_one_hash_for_every_layout():
    rc, out = run_demo("23_determinism.py")
    text = "\n".join(out)
    assert rc == 0 and out[-1].startswith("OK: 19 layouts' parameters match"), text
    usual = text.split("== GPT, --deterministic ==")[0]
    assert usual.count(" ≠ ") >= 6, usual                  # rounding shows in the bits
    gaps = [float(line.split("within ")[1]) for line in out if line.startswith("  as usual: ")]
    assert len(gaps) == 2 and all(0 < g < 1e-10 for g in gaps), gaps    # ... and only there
    assert "deterministic: 1 hash over 14 runs" in text
    assert "deterministic: 1 hash over 7 runs" in text
