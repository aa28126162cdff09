"""The CPU-cache sweep: sysfs cache sizes parsed as the kernel writes them, working sets and
cache levels assigned by closed forms, plateaus as per-level medians, and a real (tiny) sweep
that returns finite positive numbers. Timings are printed, never compared with a bound."""

import math

import pytest

from minidist.hardware import cpu_caches as cc
from minidist.hardware.cpu_caches import KB, MB, Point


def _sysfs(root, entries):
    for i, (level, kind, size) in enumerate(entries):
        d = root / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_cache_sizes_reads_data_and_unified_caches_from_sysfs(tmp_path):
    root = _sysfs(tmp_path, [(1, "Data", "48K"), (1, "Instruction", "32K"),
                             (2, "Unified", "2048K"), (3, "Unified", "96M")])
    assert cc.cache_sizes(root) == {"L1d": 48 * KB, "L2": 2 * MB, "L3": 96 * MB}
    assert cc.cache_sizes(tmp_path / "absent") == {}


def test_working_sets_double_from_16_kb_up_to_the_limit():
    assert cc.working_sets(128 * KB) == [16 * KB, 32 * KB, 64 * KB, 128 * KB]
    assert cc.working_sets(100 * KB) == [16 * KB, 32 * KB, 64 * KB]
    assert len(cc.working_sets(1 << 30)) == 17                       # 16 KB .. 1 GB
    with pytest.raises(ValueError, match="working sets from 16384 to 1000 bytes"):
        cc.working_sets(1000)


def test_level_of_is_the_first_level_the_set_fits_in():
    sizes = {"L1d": 32 * KB, "L2": 1 * MB, "L3": 32 * MB}
    got = [cc.level_of(sizes, s) for s in (16 * KB, 32 * KB, 33 * KB, MB, 2 * MB, 64 * MB)]
    assert got == ["L1d", "L1d", "L2", "L2", "L3", "DRAM"]
    assert cc.level_of({}, 16 * KB) == "DRAM"


def test_plateaus_are_the_medians_per_level_in_hierarchy_order():
    sizes = {"L1d": 32 * KB, "L2": 1 * MB}
    points = [Point(16 * KB, 100.0, 1.0), Point(32 * KB, 90.0, 1.2),
              Point(64 * KB, 80.0, 2.0), Point(128 * KB, 60.0, 3.0), Point(512 * KB, 70.0, 4.0),
              Point(4 * MB, 20.0, 9.0)]
    assert cc.plateaus(points, sizes) == [("L1d", 2, 95.0, 1.1), ("L2", 3, 70.0, 3.0),
                                          ("DRAM", 1, 20.0, 9.0)]
    lines = cc.report(points, sizes)
    assert lines[0] == "caches (sysfs, cpu0): L1d 32 KB, L2 1 MB"
    assert lines[2].split() == ["16", "KB", "L1d", "100.0", "1.00"]
    assert lines[-1].split() == ["DRAM", "1", "sets", "20.0", "GB/s", "read", "9.00", "ns",
                                 "per", "random", "access"]


def test_a_real_tiny_sweep_returns_finite_positive_numbers():
    points = cc.sweep(64 * KB, traffic=256 * KB, accesses=4096, repeats=1)
    assert [p.size for p in points] == [16 * KB, 32 * KB, 64 * KB]
    for p in points:
        assert math.isfinite(p.read_gbs) and p.read_gbs > 0, p
        assert math.isfinite(p.gather_ns) and p.gather_ns > 0, p


def test_main_prints_the_table_and_the_plateaus(capsys):
    assert cc.main(["--max-mb", "1", "--repeats", "1", "--traffic-mb", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cpu caches · one NumPy thread (OMP_NUM_THREADS=1) · best of 1"
    assert out[1].startswith("caches (sysfs, cpu0): ")
    assert [line.split()[0] for line in out[3:10]] == ["16", "32", "64", "128", "256", "512",
                                                        "1"]
    assert "plateaus (median per level):" in out
