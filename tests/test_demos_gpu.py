"""The hardware and GPU demos run as a user runs them, on the CPU, and end with their OK line.
(Each demo has its own test function; a GPU, when present, only adds timings.)

All slow: the roofline demo's OK line compares wall-clock times with measured roofs, and the
other two build and run kernels on the emulator in a subprocess (~2 s each)."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.slow


def test_roofline_demo_places_the_ops_and_nothing_beats_the_roof():
    rc, out = run_demo("27_roofline.py", "--elements", str(1 << 23), "--repeats", "1",
                       timeout=120)          # 32 MB arrays: still past the cache, and faster
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0] == "demo 27 · roofline · tiny GPT (2 layers, C=32, H=4), T=12, V=11 · batch " \
                     "32 · float32", out[0]
    for line in ("adamw             optimizer   1     367k         734k    3.35M   4.6x      "
                 "1/392       0.50",
                 "step total                         67.5M        11.9M    47.2M   4.0x     "
                 "66/677       5.66",
                 "[1] H200 float32: 66.9TFLOP/s matmul, 66.9TFLOP/s other, 4.8TB/s; ridge 13.9 "
                 "FLOP/B",
                 "[1] compute-bound (the rest memory-bound): nothing"):
        assert line in out, f"missing {line!r}\n{text}"
    timed = out[out.index(f"{'op':<16}{'FLOPs':>9}{'bytes':>9}{'bound':>10}{'measured':>10}"
                          f"{'ratio':>8}") + 1:-2]
    assert [line.split()[0] for line in timed] == [
        "matmul", "layernorm", "layernorm", "softmax", "softmax", "gelu", "gelu",
        "cross-entropy", "adamw", "attention"], text
    assert out[-2] == "(the check's roofs: the best rates measured here, x1.5)", text
    assert out[-1].startswith("OK: no NumPy op beats this CPU's roof (10 ops; measured/bound "), \
        text


def test_memory_hierarchy_demo_checks_every_rung_on_the_emulator():
    from minidist.gpu.emulate.build import compiler_missing
    from minidist.gpu.hierarchy import EMULATED, LADDER
    if compiler_missing():
        import pytest
        pytest.skip(f"the CPU emulator cannot build: {compiler_missing()}")
    rc, out = run_demo("28_memory_hierarchy.py", "--max-mb", "2", timeout=120)
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0] == (f"demo 28 · memory hierarchy · SGEMM ladder of 7 rungs, {len(EMULATED)} "
                      "kernels emulated · float32"), out[0]
    for r in LADDER:                                       # each rung explained, GPU tiles
        assert any(line.startswith(f"  {r.step} {r.name:<11} {r.kernel:<34}") for line in out)
        assert f"      {r.what}" in out, r
    rows = [line.split() for line in out if line.split()[1:2] and line.split()[1] in
            {r.kernel for r in EMULATED} and line.split()[-1] in ("yes", "no")]
    assert len(rows) == len(EMULATED), text                # every instantiation was run
    assert all(float(row[-2]) <= 1e-4 for row in rows), text
    assert "  pointer_chase: 2500 hops over a 1000-slot cycle end at index" in text
    assert ", = the Python walk)" in text and "per-thread sums match NumPy" in text
    assert "  plateaus (median per level):" in out          # the CPU analogue printed
    assert any(line.startswith("  no GPU found: ") for line in out) or \
        any("of cuBLAS" in line for line in out), text
    assert out[-2].startswith("worst SGEMM relative error "), out[-2]
    assert out[-1] == (f"OK: all {len(EMULATED)} SGEMM kernels of the 7 rungs match NumPy "
                       "float64 on the CPU emulator"), out[-1]


def test_kernel_fusion_demo_counts_bytes_and_launches_and_checks_the_emulator():
    from minidist.gpu.emulate.build import compiler_missing
    rc, out = run_demo("29_kernel_fusion.py", timeout=120)
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0] == ("demo 29 · kernel fusion · 8192 tokens, C=768, 12 heads, T=1024, "
                      "V=50257 · float32"), out[0]
    for line in ("  layernorm              50.4MB    302MB    6.0x     1/10         10.5us     "
                 "6.0x",
                 "  adamw (148)            3.48GB   15.9GB    4.6x     1/2072        726us     "
                 "4.6x"):
        assert line in out, f"missing {line!r}\n{text}"
    if compiler_missing() is None:                       # part (2): every op on the emulator
        start = out.index(f"  {'op':<20}{'fused kernel':<30}unfused.cu")
        rows = [line.split() for line in out[start + 1:start + 10]]
        assert [r[0] for r in rows] == ["layernorm", "layernorm", "bias", "bias", "causal",
                                        "causal", "cross-entropy+grad", "adamw", "attention"]
        assert "  layernorm           1 launch, error" in text
        assert "  attention           1 launch, error" in text and "7 launches, error" in text
    assert any(line.startswith("(3) timings: ") for line in out), text
    assert out[-2].startswith("worst error ") and out[-2].endswith(
        " x tolerance; fused launches = the roofline's"), out[-2]
    assert out[-1] == ("OK: fused and unfused kernels match their float64 twins; fusion moves "
                       "5.6x fewer bytes"), out[-1]
