"""The throughput benchmark, tiny: it prints the command, both peaks (cached in tmp_path),
the ledger by phase, the closed form term by term ending `equal`, and a row per run whose
MFU and HFU are the stated quotients of the printed numbers."""

import pytest

from minidist.bench import throughput as bench

TINY = ["--dp", "2", "--steps", "1", "--warmup", "1", "--batch-per-rank", "2",
        "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--length", "3",
        "--dtype", "float64", "--peak-size", "32"]


@pytest.mark.multiproc
def test_tiny_run_prints_ledger_formula_peak_and_mfu(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_PEAK_CACHE", str(tmp_path / "peak.json"))
    assert bench.main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "$ python -m minidist bench throughput " + " ".join(TINY)
    peaks = [line for line in lines if line.startswith("peak ")]
    assert [p.split(":")[0] for p in peaks] == ["peak float32", "peak float64"]
    assert all(str(tmp_path / "peak.json") in p for p in peaks)
    ledger = next(line for line in lines if line.strip().startswith("ledger: matmul"))
    assert ledger.endswith("equal")
    phase = {line.split()[0]: line.split()[1:] for line in lines if line.startswith("  ")}
    assert phase["recompute"] == ["0", "0"] and phase["optimizer"][0] == "0"
    start = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = {line.split()[0]: [float(c.rstrip("%")) for c in line.split()[1:]]
            for line in lines[start + 1:]}
    assert list(rows) == ["dp=1", "dp=2"]
    for name, (tok_s, step_ms, model, hw, pk, mfu, hfu) in rows.items():
        ranks = int(name[3:])
        assert 0 < model <= hw and tok_s > 0 and step_ms > 0
        assert mfu == pytest.approx(100 * model / (step_ms / 1e3 * pk * ranks), rel=0.02,
                                    abs=0.06)
        assert hfu >= mfu
    assert rows["dp=2"][2] == pytest.approx(2 * rows["dp=1"][2], rel=1e-3)  # weak scaling (4 digits)


def test_warmup_must_leave_the_counted_step_untimed(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--warmup", "0"])
    assert e.value.code == 2 and "--warmup" in capsys.readouterr().err
