"""The straggler demo runs as a user runs it: dp=2 with a persistently slow rank 1, once with
--straggler detect and once with --straggler rebalance; --check says both match the
single-process run; it ends with its OK line and leaves no temporary folder behind.

Rank 1 is named in both runs and rebalance moves rows away from it; the demo reports what
it measured, read from the lines train prints now (the step lines' seconds, the straggler
lines' compute), and not "nan". Naming rank 1 and moving its rows follow measured compute
times (rank 1 sleeps 4 ms a row against a few ms of compute), so a heavily loaded machine
can change them: with its ~8 s, this is in the slow set. No time is asserted."""

import math
import os
import re
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


def _temp_folders() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("minidist-demo18-")}


@pytest.mark.slow
def test_straggler_demo_reports_what_it_timed_and_matches_the_single_process_run():
    before = _temp_folders()
    rc, out = run_demo("18_straggler.py")
    text = "\n".join(out)
    assert rc == 0 and out[-1].startswith("OK: rank 1 named in both runs; rebalance moved rows "
                                          "(32, 32) -> "), text
    assert text.count("  | straggler: rank 1 computes ") >= 2, text
    assert out[0].startswith("demo 18 · straggler · "), out[0]
    assert text.count("  | OK: dp=2 x tp=1, ZeRO-0 training matches the single-process run") == 2
    assert "nan" not in text, text
    per_step = next(line for line in out if line.startswith("  per step:  "))
    seconds = re.match(r"  per step:  (\S+) s with detect, (\S+) s with rebalance", per_step)
    assert seconds and all(math.isfinite(float(x)) and float(x) > 0 for x in seconds.groups()), \
        per_step
    for line in out:                  # every rank named comes with the compute it measured
        if line.startswith("  detect:    rank "):
            assert re.search(r"was \d+\.\dx the others' median \(\d+ ms vs \d+ ms\)$", line), line
    assert _temp_folders() <= before, f"left {_temp_folders() - before}"
