"""The recomputation benchmark: a tiny run prints the command, one row per policy with the
kept bytes per layer equal to recompute.kept_bytes, says the gradients are bitwise equal and
exits 0; the caching-allocator table runs in a process of its own (mallopt lasts). That
process (~0.5 s) is in the slow set."""

import os
import subprocess
import sys

import pytest

from minidist.bench import recompute as bench
from minidist.memory import recompute as rc

TINY = ["--repeats", "2", "--warmup", "0", "--n-layer", "2", "--n-embd", "16", "--n-head", "2",
        "--length", "4", "--batch", "2", "--dropout", "0.1", "--dtype", "float64"]


def _table(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("recompute "))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 4]}


def test_tiny_run_prints_one_row_per_policy(capsys):
    assert bench.main(TINY + ["--allocator", "system"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "$ python -m minidist bench recompute " + " ".join(
        TINY + ["--allocator", "system"])
    rows = _table(out)
    assert list(rows) == list(rc.MODES)
    for mode, cells in rows.items():
        fwd, bwd, step = map(float, cells[:3])
        assert fwd > 0 and bwd > 0 and abs(fwd + bwd - step) < 0.2, mode
        assert float(cells[4]) > 0, f"{mode}: cpu time"
        kept, formula = (int(c.replace(",", "")) for c in cells[6:8])
        assert kept == formula == rc.kept_bytes(mode, 2, 8, 16, 2, 64, dropout=True), mode
    assert rows["none"][3] == rows["none"][5] == "+0.0%"
    assert "gradients bitwise equal across the three policies: yes" in out
    assert "kept/layer = formula for every policy: yes" in out


@pytest.mark.slow
def test_caching_allocator_table_in_its_own_process():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "minidist.bench.recompute", *TINY,
                           "--repeats", "1"], capture_output=True, text=True, timeout=60,
                          cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== system allocator" in done.stdout
    assert ("== caching allocator (mallopt" in done.stdout
            or "== caching allocator: skipped" in done.stdout)
