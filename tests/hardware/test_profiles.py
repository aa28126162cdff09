"""hardware/profiles.py: every shipped profile loads, its numbers are the data sheets', each
group of numbers names its source, and the topology it gives prices collectives."""

import json

import pytest

from minidist.collectives.tiers import choose
from minidist.hardware import profiles

DATASHEET = {   # dense TFLOP/s (bf16, fp32), memory GB (decimal), TB/s, NVLink GB/s each way
    "a100-40g": (312, 19.5, 40 * 2 ** 30 / 1e9, 1.555, 300),
    "a100-80g": (312, 19.5, 80 * 2 ** 30 / 1e9, 2.039, 300),
    "h100-sxm": (989.4, 66.9, 80 * 2 ** 30 / 1e9, 3.35, 450),
    "h200": (989.4, 66.9, 141, 4.8, 450),
}


def test_the_shipped_profiles_are_the_datasheets():
    assert profiles.names() == sorted(DATASHEET)
    for name, (bf16, fp32, gb, tbs, nvlink) in DATASHEET.items():
        h = profiles.load(name)
        assert h.peak("bf16") == pytest.approx(bf16 * 1e12, rel=1e-12), name
        assert h.peak("fp32") == pytest.approx(fp32 * 1e12, rel=1e-12), name
        assert h.hbm_bytes / 1e9 == pytest.approx(gb)
        assert h.hbm_bytes_per_s == pytest.approx(tbs * 1e12, rel=1e-12)
        assert h.intra_bytes_per_s == nvlink * 1e9 and h.gpus_per_node == 8
        assert set(h.sources) == {"compute", "memory", "intra", "inter", "latency"}
        assert "assumed" in h.sources["latency"]
    assert profiles.load("h100-sxm").peak("fp8") == 1978.9e12
    with pytest.raises(ValueError, match="no 'fp8' rate"):
        profiles.load("a100-80g").peak("fp8")


def test_the_topology_prices_a_cross_node_all_reduce():
    topo = profiles.load("h100-sxm").topology()
    assert topo.inter.beta == 1 / 50e9 and topo.intra.beta == 1 / 450e9
    algo, t = choose("all_reduce", range(64), 1 << 30, topo)          # 8 nodes, 1 GiB
    # by hand: 2 (7/8) GiB / 450 GB/s inside, 2 (7/8) GiB / 8 / 50 GB/s across, and the
    # messages: 7 + 7 inside at 3 us, 2 (8 - 1) across at 10 us
    bw = 2 * 7 / 8 * 2 ** 30 / 450e9 + 2 * 7 / 8 * 2 ** 30 / 8 / 50e9
    assert algo == "hierarchical" and t == pytest.approx(bw + 14 * 3e-6 + 14 * 1e-5)


def test_unknown_and_malformed_profiles_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="hardware 'b200' is unknown; profiles: a100-40g"):
        profiles.load("b200")
    raw = json.loads((profiles.FOLDER / "h200.json").read_text())
    del raw["inter"]
    (tmp_path / "broken.json").write_text(json.dumps(raw))
    monkeypatch.setattr(profiles, "FOLDER", tmp_path)
    with pytest.raises(ValueError, match="broken.json: field 'inter' is missing"):
        profiles.load("broken")


def test_this_machine_is_one_node_of_its_cores():
    h = profiles.this_machine(measure=False, memory_bytes=1 << 30)
    assert h.name == "cpu" and h.hbm_bytes == 1 << 30 and h.peak("fp64") == 1e9
    assert h.topology().span(range(h.gpus_per_node)) == (1, h.gpus_per_node)


def test_a_layout_s_groups_on_the_nodes_follow_the_mesh_order():
    """Megatron's GPT-3 175B layout on 1,024 A100s: tp=8 fills a node, pp=16 and dp=8
    cross nodes, one rank per node each."""
    from minidist.parallel.compose import Plan
    span = profiles.layout_span(Plan(tp=8, pp=16, dp=8), profiles.load("a100-80g"))
    assert span["tp"] == (1, 8) and span["pp"] == (16, 1) and span["dp"] == (8, 1)
    span = profiles.layout_span(Plan(tp=2, dp=8), profiles.load("h100-sxm"))
    assert span["tp"] == (1, 2) and span["dp"] == (2, 4)          # 4 dp ranks per node
