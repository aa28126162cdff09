"""The straggler demo runs as a user runs it: dp=2 with a persistently slow rank 1, once with
--straggler detect and once with --straggler rebalance; rank 1 is named in both, rebalance
moves rows away from it, --check says both match the single-process run; it ends with its
OK line and leaves no temporary folder behind. No wall time is asserted, but naming rank 1
and moving its rows follow measured compute times (rank 1 sleeps 4 ms a row against a few ms
of compute), so a heavily loaded machine can change what is printed: with its ~8 s, it is in
the slow set."""

import os
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


def _temp_folders() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("minidist-demo18-")}


# slow: ~8 s, and timing-dependent (see the module docstring)
@pytest.mark.slow
def test_straggler_demo_names_rank_1_moves_its_rows_and_matches_the_single_process_run():
    before = _temp_folders()
    rc, out = run_demo("18_straggler.py")
    text = "\n".join(out)
    assert rc == 0 and out[-1].startswith("OK: "), text
    assert out[0].startswith("demo 18 · straggler · "), out[0]
    assert text.count("  | straggler: rank 1 computes ") >= 2, text
    assert "  | straggler: rows per dp rank (32, 32) -> " in text, text
    assert text.count("  | OK: dp=2 x tp=1, ZeRO-0 training matches the single-process run") == 2
    assert out[-1].startswith("OK: rank 1 named in both runs; rebalance moved rows (32, 32) -> ")
    assert _temp_folders() <= before, f"left {_temp_folders() - before}"
    wall = next(line for line in out if "wall time of the run" in line)
    assert "nan" not in wall, wall            # it read an old form of the step line
