"""The peak microbenchmark: 2 n^3 FLOPs over the median time, cached per machine key in a
JSON file (atomically written, a damaged file replaced), refreshed on request, located by
MINIDIST_PEAK_CACHE or XDG_CACHE_HOME. Sizes are tiny: no timing is asserted."""

import json

import numpy as np
import pytest

from minidist.observe import peak as peak_mod
from minidist.observe.peak import cache_path, machine_key, measure_matmul, peak_flops


def test_measure_is_two_n_cubed_over_the_median(monkeypatch):
    ticks = iter([0.0, 0.5, 1.0, 1.1, 2.0, 2.3])                   # runs of 0.5, 0.1, 0.3 s
    monkeypatch.setattr(peak_mod.time, "perf_counter", lambda: next(ticks))
    flops, median = measure_matmul("float32", n=4, repeats=3)
    assert median == pytest.approx(0.3)
    assert flops == pytest.approx(2 * 4 ** 3 / 0.3)


def test_cache_round_trip_refresh_and_keys(tmp_path):
    path = tmp_path / "sub" / "peak.json"
    first = peak_flops("float64", n=16, repeats=2, path=path)
    assert not first.cached and first.flops > 0 and first.path == str(path)
    again = peak_flops("float64", n=16, repeats=2, path=path)
    assert again.cached and again.flops == first.flops and again.key == first.key
    table = json.loads(path.read_text())
    assert set(table) == {machine_key("float64", 16)}
    assert table[first.key]["flops"] == first.flops and table[first.key]["n"] == 16
    assert f"numpy {np.__version__}" in first.key and "float64" in first.key
    other = peak_flops("float32", n=16, repeats=2, path=path)     # a second key, kept apart
    assert not other.cached and len(json.loads(path.read_text())) == 2
    fresh = peak_flops("float64", n=16, repeats=2, path=path, refresh=True)
    assert not fresh.cached
    assert json.loads(path.read_text())[first.key]["flops"] == fresh.flops
    assert [p.name for p in path.parent.iterdir()] == ["peak.json"]   # no temporary left


def test_a_damaged_cache_is_measured_again_and_replaced(tmp_path):
    path = tmp_path / "peak.json"
    path.write_text("{not json")
    p = peak_flops("float32", n=8, repeats=1, path=path)
    assert not p.cached and json.loads(path.read_text())[p.key]["flops"] == p.flops


def test_cache_path_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIDIST_PEAK_CACHE", str(tmp_path / "x.json"))
    assert cache_path() == tmp_path / "x.json"
    monkeypatch.delenv("MINIDIST_PEAK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "minidist" / "peak.json"
    monkeypatch.setenv("MINIDIST_PEAK_CACHE", str(tmp_path / "y.json"))
    assert peak_flops("float32", n=8, repeats=1).path == str(tmp_path / "y.json")


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="float32"):
        peak_flops("float16")
    with pytest.raises(ValueError, match="repeats=0"):
        measure_matmul("float64", n=8, repeats=0)
