"""The elastic demo runs as a user runs it: dp=4, a SIGKILLed rank, the job shrinks to dp=3
and grows back to dp=4, --check says it matches the single-process run; it ends with its OK
line and leaves no temporary folder behind."""

import os
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc


def _temp_folders() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("minidist-demo16-")}


# slow (~2 s): the default run covers elastic with tests/reliability/test_recovery.py
@pytest.mark.slow
def test_elastic_demo_shrinks_grows_and_matches_the_single_process_run():
    before = _temp_folders()
    rc, out = run_demo("16_elastic.py")
    text = "\n".join(out).replace("\n  |     ", " ")      # train's lines, wrapped at 100, joined
    assert rc == 0 and out[-1].startswith("OK: "), text
    assert out[0].startswith("demo 16 · elastic · "), out[0]
    assert "  | elastic: a replica is lost: continuing on dp=3 " in text, text
    assert "  | elastic: capacity is back at step 7: growing from dp=3 to dp=4" in text, text
    assert "  | OK: dp=4 x tp=1, ZeRO-0 training matches the single-process run" in text, text
    assert out[-1].startswith("OK: rank 3 lost, dp=4 -> 3 -> 4 with the global batch kept; "
                              "matches 1 process (max |Δ| = "), text
    assert _temp_folders() <= before, f"left {_temp_folders() - before}"
