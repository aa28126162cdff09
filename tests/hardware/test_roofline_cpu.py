"""hardware/roofline_cli.py: nothing beats the roof on this CPU, and `python -m minidist
roofline` prints its tables and writes its PNG.

The roof check is a physical lower bound, not a performance target: each NumPy twin, at
sizes far beyond the last-level cache, must take at least max(FLOPs / peak, bytes /
bandwidth) with the bytes of its unfused passes, the roofs being the best rates measured
in the same run (times SLACK for timing noise). A pass count that is too high fails it.

Slow: the two tests that assert on wall-clock measurements (real NumPy times against the
roofs; a measured bandwidth above 100 MB/s), which a loaded machine can fail, and the two
CLI runs (the CPU peak measurement, ~1 s; the PNG preset, ~2 s). The default set keeps the
roof check's logic on made-up timings."""

import pytest

from minidist.hardware import roofline_cli as cli
from minidist.hardware.op_costs import Kernel
from minidist.hardware.roofline import Op, Roof

ELEMENTS = 1 << 24            # 64 MB per float32 array: twice the 32 MB last-level cache


@pytest.mark.slow        # timing: wall-clock times against roofs measured in the same run
def test_no_numpy_op_beats_the_roof():
    timed, roof = cli.time_numpy_ops("float32", ELEMENTS, repeats=1)   # after a warm-up
    names = [t.name for t in timed]
    assert names == ["matmul", "layernorm", "layernorm bwd", "softmax", "softmax bwd", "gelu",
                     "gelu bwd", "cross-entropy", "adamw", "attention"]
    report = "\n".join(f"{t.name}: {t.seconds * 1e3:.2f} ms, bound "
                       f"{roof.seconds(t.op, 'unfused') * 1e3:.2f} ms" for t in timed)
    assert cli.beats_roof(timed, roof) == [], f"faster than the roof on {roof.name}:\n{report}"


def test_beats_roof_flags_an_op_whose_count_is_too_high():
    roof = Roof("cpu", 1e10, 1e10, 1e10, overlap=False)
    honest = Op("x", "forward", 1, (), (Kernel("k", other=0, read=10 ** 10),))    # 1 s bound
    inflated = Op("x", "forward", 1, (), (Kernel("k", other=0, read=3 * 10 ** 10),))
    ran = [cli.Timed("honest", honest, 1.2), cli.Timed("inflated", inflated, 1.2)]
    assert [t.name for t in cli.beats_roof(ran, roof)] == ["inflated"]           # 1.2 < 3/1.5
    assert cli.beats_roof([cli.Timed("slow", honest, 0.7)], roof) == []        # 0.7 >= 1/1.5


@pytest.mark.slow        # timing: asserts a measured bandwidth above 100 MB/s
def test_measure_bandwidth_counts_a_copy_twice():
    bw = cli.measure_bandwidth(nbytes=1 << 20, repeats=2)
    assert set(bw) == {"copy", "read", "write"} and min(bw.values()) > 1e8


def test_si_prefixes():
    assert [cli.si(x) for x in (0, 1234, 4.56e-6, 2.5e12, 999)] == ["0", "1.23k", "4.56u",
                                                                      "2.5T", "999"]
    assert cli.si(3e-9, "s") == "3ns"


@pytest.mark.slow        # measures this CPU's peak first (~1 s)
def test_cli_prints_both_tables_and_names_the_bound(capsys, tmp_path):
    assert cli.main(["--no-png", "--peak-cache", str(tmp_path / "peak.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("roofline · tiny GPT (2 layers, C=32, H=4, V=11, task sort) · batch 32 x "
                      "T=12 · float32 · AdamW")
    adamw = next(line for line in out if line.startswith("adamw") and "1/392" in line)
    assert "4.6x" in adamw                              # 32 / 7 elements per parameter
    assert "[1] H200 float32: 66.9TFLOP/s matmul, 66.9TFLOP/s other, 4.8TB/s; ridge 13.9 " \
        "FLOP/B" in out
    assert any(line.startswith("[2] this CPU float32 (1 thread): ") for line in out)
    assert "[1] memory-bound: 23 of 23 ops;" in "\n".join(out)


@pytest.mark.slow
def test_cli_preset_png_and_errors(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    assert cli.main(["--model", "gpt3-125m", "--precision", "bf16", "--no-cpu",
                     "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "roofline · gpt3-125m · batch 8 x T=2048 · bf16" in out and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["--seq", "99", "--no-cpu", "--no-png"]) == 2
    assert "error: gpt_ops: batch=32 must be >= 1 and T=99" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--precision", "fp8"])
    assert e.value.code == 2
