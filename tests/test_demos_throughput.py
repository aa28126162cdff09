"""The throughput demo runs as a user runs it: the ledger table by op and phase, the
closed form term by term equal to the ledger's matmul FLOPs, the peak (cached in
tmp_path), one MFU line per timed step, and the OK line."""

import json

from tests.helpers import run_demo


def test_throughput_demo_prints_ledger_formula_peak_and_ends_ok(tmp_path):
    cache = tmp_path / "peak.json"
    rc, out = run_demo("24_throughput.py", "--steps", "3", "--peak-size", "64",
                       "--peak-cache", str(cache))
    text = "\n".join(out)
    assert rc == 0, text
    assert out[0].startswith("demo 24 · throughput · GPT 2 layers, C=64, H=4, T=32"), out[0]
    for line in ("op              phase          matmul FLOPs   other FLOPs  calls",
                 "  = the matmul FLOPs this GPT executes                 329,318,400",
                 "  ledger: MatMul FLOPs, forward + backward             329,318,400   equal"):
        assert line in out, f"missing {line!r}\n{text}"
    assert any(line.startswith("AdamW           optimizer") for line in out), text
    start = out.index(f"{'step':>4}{'ms':>9}{'tokens/s':>10}{'MFU':>8}{'HFU':>8}")
    assert [line.split()[0] for line in out[start + 1:start + 4]] == ["1", "2", "3"]
    assert out[-2].startswith("median of the 3 timed steps: MFU "), text
    assert out[-1] == ("OK: FLOP ledger = 6N' + 12LHQT - 6 x 1,792 vectors + 6 x 704 head = "
                       "643,200 FLOPs/token, exactly"), text
    assert len(json.loads(cache.read_text())) == 1             # the peak, cached here only
