"""bench/sync.py: one row per method with its loss and its sync bytes against DDP's: DiLoCo
sends DDP's bytes once per H steps (1/H over a multiple of H steps), 1-bit Adam the warm-up's
full bytes and then about 1/32 of them. No time is asserted."""

import re

import pytest

from minidist.__main__ import main as cli


def test_each_method_s_row_and_its_share_of_ddp_s_bytes(capsys):
    assert cli(["bench", "sync", "--steps", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {m[1]: (float(m[2]), float(m[3])) for m in (
        re.match(r"  (.+?) +([\d.]+) +[\d,]+ +([\d.]+) +[\d.]+$", line) for line in out) if m}
    assert list(rows) == ["DDP", "local SGD, H = 4", "DiLoCo, H = 4", "DiLoCo, H = 16",
                          "1-bit Adam, warm-up 4", "PowerSGD, rank 1", "PowerSGD, rank 4"], out
    assert rows["PowerSGD, rank 1"][1] < rows["PowerSGD, rank 4"][1] < 1
    assert [ratio for _, ratio in rows.values()][:4] == [1.0, 0.25, 0.25, 0.05]
    # 4 of 20 steps at DDP's bytes, 16 at one bit per float32 element and a few scales
    assert rows["1-bit Adam, warm-up 4"][1] == pytest.approx(4 / 20 + 16 / 20 / 32, abs=2e-3)
    assert all(len(line) <= 100 for line in out)
