"""The offload demo runs as a user runs it: ZeRO-3 on 2 ranks with --offload none, host and
disk; it shows w, m and v moving off the device, the ledger's peak dropping by exactly their
bytes, and ends with its OK line (bitwise equal, no files left) and no temporary folder."""

import os
import tempfile

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
PREFIX = "minidist-demo21-"


def _temp_folders() -> set[str]:
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(PREFIX)}


# both slow (~1 s each): the default run keeps only the cheapest demos
@pytest.mark.slow
def test_offload_demo_shows_where_arrays_live_and_ends_ok():
    before = _temp_folders()
    rc, out = run_demo("21_offload.py")
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 21 · offload · ZeRO-3, dp=2"), out[0]
    for kind in ("parameters w", "optimizer m", "optimizer v"):
        row = next(line for line in out if line.startswith(kind)).split()
        assert row[-3:] == ["device", "host", "disk"], row
    assert "  m.0.bin m.1.bin m.2.bin v.0.bin v.1.bin v.2.bin w_shard.0.bin w_shard.1.bin " \
           "w_shard.2.bin" in out, text
    assert any(line.startswith("left in ") and line.endswith(": 0 run directories")
               for line in out), text
    assert out[-1].startswith("OK: host and disk runs = the plain run, bitwise; device peak -"), \
        out[-1]
    assert out[-1].endswith(" = the bytes moved; 0 dirs left"), out[-1]
    assert _temp_folders() <= before, f"left {_temp_folders() - before}"


@pytest.mark.slow
def test_offload_demo_under_ddp_keeps_the_parameters_on_the_device():
    rc, out = run_demo("21_offload.py", "--zero", "0", "--steps", "2")
    assert rc == 0, "\n".join(out)
    row = next(line for line in out if line.startswith("parameters w")).split()
    assert row[-3:] == ["device", "device", "device"], row
    assert out[-1].startswith("OK: "), out[-1]
