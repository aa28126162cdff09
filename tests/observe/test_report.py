"""`python -m minidist report RUN_DIR` (observe/report.py) on a real run directory: the summary
it prints is the run's own numbers, it writes three PNGs with matplotlib and says in one line
that it cannot without it, and a folder that is not a run directory is a usage error.

Writing the PNGs (~1.5 s with matplotlib's import) is in the slow set; the default run keeps
the summary, the no-matplotlib line, an unfinished run and the usage error."""

import json
import shutil
import sys

import pytest

from minidist.nn import GPTConfig
from minidist.observe import report
from minidist.observe.throughput import mfu, model_flops_per_token
from minidist.train_cli import main as train_main

CLI = ["--dp", "2", "--tp", "2", "--task", "reverse", "--length", "3", "--n-layer", "2",
       "--n-embd", "16", "--n-head", "2", "--batch", "4", "--steps", "3", "--every", "1",
       "--trace-steps", "1,2"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "run"
    assert train_main(CLI + ["--run-dir", str(path)]) == 0
    return path


def _report(capsys, *argv: str) -> tuple[int, list[str]]:
    code = report.main(list(argv))
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.multiproc
def test_the_report_prints_the_runs_own_numbers(run, capsys):
    code, out = _report(capsys, str(run), "--no-plots")
    summary = json.loads((run / "summary.json").read_text())
    assert code == 0 and out[0] == f"run directory {run}"
    assert out[1] == "  python -m minidist train " + " ".join(CLI + ["--run-dir", str(run)])
    assert out[2].startswith("  GPT 2 layers, C=16, H=2, T=6, float32 · task reverse · "
                             "dp=2 x tp=2 = 4 ranks · 24 tokens/step"), out[2]
    assert out[3].startswith(f"steps 0-2 (3) · loss {summary['losses'][0]:.4f} -> "
                             f"{summary['final_loss']:.4f} · "
                             f"{summary['tokens_per_s']:,.0f} tokens/s · median step"), out[3]
    cfg = json.loads((run / "config.json").read_text())            # what `train` recorded
    assert cfg["model_flops_per_token"] == model_flops_per_token(GPTConfig(**cfg["model"]))
    u = mfu(summary["tokens_per_s"] * cfg["model_flops_per_token"], 1.0, cfg["peak_flops"], 4)
    assert out[4].startswith(f"MFU {100 * u:.2f}% = "), out[4]      # the one convention
    heads = [i for i, line in enumerate(out) if line.strip().startswith("rank")]
    times = {line.split()[0]: line.split() for line in out[heads[0] + 1:heads[0] + 5]}
    assert sorted(times) == ["0", "1", "2", "3"]
    for r, cells in times.items():
        t = summary["ranks"][r]["time_s"]
        assert float(cells[1]) == pytest.approx(t["step"] * 1e3, abs=0.006)
        assert float(cells[2]) == pytest.approx(t["compute"] * 1e3, abs=0.006)
        assert float(cells[4]) == pytest.approx(t["comm_wait"] * 1e3, abs=0.006)
        assert float(cells[7][:-1]) == pytest.approx(t["other"] / t["step"] * 100, abs=0.6)
    head = out[heads[1]]                    # the second table: bytes and memory per rank
    assert "sent dp" in head and "sent tp" in head and "model state" in head
    assert [line.split()[0] for line in out[heads[1] + 1:heads[1] + 5]] == ["0", "1", "2", "3"]
    assert all(len(line) <= 100 for line in out if not line.startswith(("  python", "trace")))
    assert out[-2] == f"trace: {run / 'trace.json'}" and out[-1].endswith(
        " events on 4 ranks, steps 1, 2 (open it in https://ui.perfetto.dev)"), out[-2:]


@pytest.mark.slow
@pytest.mark.multiproc
def test_plots_are_written_with_matplotlib(run, capsys):
    pytest.importorskip("matplotlib")
    code, out = _report(capsys, str(run))
    names = ("loss.png", "step_time.png", "memory.png")
    assert code == 0 and out[-1] == "plots: " + ", ".join(str(run / "plots" / n) for n in names)
    for n in names:
        assert (run / "plots" / n).read_bytes()[:8] == PNG, n


@pytest.mark.multiproc
def test_without_matplotlib_one_line_says_so(run, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import raises ImportError
    code, out = _report(capsys, str(run))
    assert code == 0 and out[-1] == ("plots: matplotlib is not installed (pip install "
                                     "'minidist[plot]'), so no PNGs were written")
    assert sum("matplotlib" in line for line in out) == 1


@pytest.mark.multiproc
def test_an_unfinished_run_is_summarised_from_its_metrics(run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (copy / "summary.json").unlink()                         # as if still running, or killed
    code, out = _report(capsys, str(copy), "--no-plots")
    assert code == 0 and "(no summary.json: the run did not finish" in out[3]
    assert out[4].startswith("steps 0-2 (3) · loss ")


def test_a_folder_that_is_not_a_run_directory_is_a_usage_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path} is not a run directory")
    with pytest.raises(SystemExit) as e:
        report.main([])
    assert e.value.code == 2


MOE = ["--ep", "2", "--moe-every", "1", "--router", "sigmoid", "--balance", "bias",
       "--bias-rate", "0.01", "--task", "reverse", "--length", "3", "--n-layer", "2",
       "--n-embd", "16", "--n-head", "2", "--batch", "4", "--steps", "12", "--every", "100",
       "--trace-steps", "none"]


@pytest.mark.multiproc
def test_a_moe_run_reports_each_layers_balance_from_its_metrics(tmp_path, capsys):
    """The metrics lines carry each MoE layer's routing of the step (load with and without
    the bias, their max violation, drops, the bias); the report prints its balance."""
    path = tmp_path / "moe"
    assert train_main(MOE + ["--run-dir", str(path)]) == 0
    capsys.readouterr()
    lines = [json.loads(x) for x in (path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    st = lines[-1]["moe"]["blocks.1.moe"]
    assert sum(st["load"]) == sum(st["unbiased_load"]) == 4 * 6    # batch 4 x T 6, top-1
    mean = sum(st["load"]) / len(st["load"])
    assert st["max_violation"] == pytest.approx(max(st["load"]) / mean - 1)
    assert len(st["bias"]) == 4 and any(b != 0 for b in st["bias"])
    code, out = _report(capsys, str(path), "--no-plots")
    i = out.index("MoE routing per layer, the global batch's (max violation = max / mean "
                  "load - 1,")
    vio = [x["moe"]["blocks.0.moe"]["max_violation"] for x in lines]
    first, last = sum(vio[:10]) / 10, sum(vio[-10:]) / 10
    assert out[i + 2].startswith(f"  blocks.0.moe     max violation {first:.3f} -> "
                                 f"{last:.3f} · dropped "), out[i + 2]
    assert " · bias " in out[i + 3] and all(len(line) <= 100 for line in out[i:i + 4])
