"""The loss-spike demo runs as a user runs it: a NaN injected at step 15 of a dp=2 run under
--spike detect, skip, rerun and rollback; it ends with its OK line (detect ruined, the others
finite, rerun bitwise the clean run) and leaves no temporary folder behind."""

import os
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
PREFIX = "minidist-demo17-"


def _temp_folders() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(PREFIX)}


# slow (~6 s): the default run covers the policies with tests/reliability/test_spike.py
@pytest.mark.slow
def test_loss_spike_demo_shows_each_policy_and_ends_ok():
    before = _temp_folders()
    rc, out = run_demo("17_loss_spike.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 17 · loss spike · "), out[0]
    for line in ("  | spike at step 15: loss is nan; policy skip",
                 "  | spike at step 15: the rerun is normal (a transient fault); its update is "
                 "applied",
                 "  | spike: rolled back to step 12; skipping 5 batches: step s now trains on "
                 "batch s + 5"):
        assert line in text, f"missing {line!r}\n{text}"
    assert out[-1] == ("OK: detect ends in nan; skip, rerun and rollback end finite; rerun's "
                       "params sha256 = the clean run's"), text
    assert _temp_folders() <= before, f"left {_temp_folders() - before}"
