"""The nodes demo runs as a user runs it: flat against two-level all-reduce on 2 emulated
nodes of 4 (the busiest rank's bytes across nodes equal the formula), then DDP, ZeRO-3,
HSDP and ZeRO++ with their bytes inside and across nodes, and an OK line. Slow: 8 ranks."""

import pytest

from tests.helpers import run_demo

DEMO = "32_nodes.py"


@pytest.mark.slow
def test_nodes_demo_shows_the_tiers_bytes():
    rc, out = run_demo(DEMO)
    text = "\n".join(out)
    assert rc == 0 and out[0].startswith("demo 32 · nodes: 8 ranks as 2 nodes of 4"), text
    rows = {line.split()[0]: line.split() for line in out if line.startswith(("  ring",
                                                                               "  hierarchical"))}
    assert rows["hierarchical"][-1] == "4,194,304" and rows["ring"][-1] == "29,360,128", text
    assert "HSDP: ZeRO-3 x 4, replicas x 2" in text and "ZeRO-3 over all 8" in text
    assert "ZeRO++ (qwZ, hpZ, qgZ)" in text and "ZeRO++ 11% of ZeRO-3's bytes" in text
    ok = [line for line in out if line.startswith("OK: the two-level all-reduce's busiest")]
    assert ok, text
