"""`python -m minidist report` on a run directory that someone else wrote into.

Every case plants one malformed or hostile file in a finished run directory (made by hand,
not by training: the suite takes seconds) and checks that the report ends with exit code 2
and exactly one `error:` line on stderr that names the file (and the line of a metrics
file), with no traceback. Nothing is read through a symbolic link, from a device or FIFO,
or beyond the size limits of observe/run_files.py.

Most cases call report.main in this process. Those that the old reader could not survive
(/dev/zero, a FIFO that blocks the open, a sparse 4 GiB file read whole) run as
`python -m minidist report` under a 2 GiB address-space limit and a 30 s hang guard, so a
regression is a failing test, not a hung or swapped-out test run.

Each isolated case starts a Python (~0.7 s), so the default run keeps one of each kind of
refusal: a FIFO as the metrics file (not a regular file: the open would block forever) and a
sparse 4 GiB metrics file (over its size limit); /dev/zero (a link, refused like the
in-process links), the other FIFO and the other sparse files are in the slow set. The two
plots/ links need matplotlib (~0.7 s to import, ~0.8 s to plot) and are in the slow set
too. Every in-process case is cheap and stays in the default run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.observe import metrics, report
from minidist.observe.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"command": "python -m minidist train --dp 2 --steps 3",
          "model": {"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 6,
                    "dtype": "float32"},
          "data": {"task": "reverse"}, "plan_describe": "dp=2", "world_size": 2,
          "tokens_per_step": 24}
# `report` in a child process that cannot map more than 2 GiB: reading a 4 GiB file, or
# /dev/zero, fails there at once instead of filling the machine's memory.
_LIMITED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, "
            "(2 << 30, 2 << 30)); sys.argv = ['minidist', *sys.argv[1:]]; "
            "runpy.run_module('minidist', run_name='__main__')")


def _values(step: int) -> dict:
    return {"loss": 3.0 - step, "grad_norm": 1.0, "lr": 0.01,
            "time_s": {"step": 0.5, "compute": 0.3, "comm_wait": 0.1, "cpu": 0.2},
            "bytes_sent": {"dp": 100}, "bytes": {"sent": 100, "recv": 100},
            "memory": {"params": 64, "grads": 64, "optimizer": 128}}


@pytest.fixture
def run(tmp_path) -> Path:
    """A finished 2-rank run of 3 steps: config.json, metrics/, summary.json, trace.json."""
    path = tmp_path / "run"
    (path / "metrics").mkdir(parents=True)
    lines = {r: [metrics.line(r, s, _values(s)) for s in range(3)] for r in range(2)}
    for r, recs in lines.items():
        (path / "metrics" / f"rank{r}.jsonl").write_text(
            "".join(json.dumps(rec) + "\n" for rec in recs))
    (path / "config.json").write_text(json.dumps(CONFIG))
    (path / "summary.json").write_text(json.dumps(metrics.summarize(lines, 24)))
    trace = Trace()
    for r in range(2):
        for s in range(2):
            trace.add(f"step {s}", r, 10.0 * s, 10.0 * s + 5, cat="step")
    (path / "trace.json").write_text(json.dumps(trace.to_json()))
    return path


# --- what each case plants -----------------------------------------------------------------

def _unfinished(plant):
    """`plant`, in a run without summary.json: a run that did not finish (or still runs),
    which the report summarises from its metrics lines, so that it reads every one."""
    def planted(path: Path, outside: Path) -> None:
        os.unlink(path / "summary.json")
        plant(path, outside)
    return planted


def _metrics_line(n: int, text: str | bytes):
    """Line n (1-based) of metrics/rank0.jsonl replaced by `text`, in an unfinished run."""
    @_unfinished
    def plant(path: Path, outside: Path) -> None:
        f = path / "metrics" / "rank0.jsonl"
        rows = f.read_bytes().split(b"\n")
        rows[n - 1] = text.encode() if isinstance(text, str) else text
        f.write_bytes(b"\n".join(rows))
    return plant


def _metrics_field(**change):
    """Line 2 of metrics/rank0.jsonl with fields changed (a value None: the field removed)."""
    rec = metrics.line(0, 1, _values(1))
    rec.update(change)
    return _metrics_line(2, json.dumps({k: v for k, v in rec.items() if v is not None}))


def _replace(name: str, text: str | bytes):
    def plant(path: Path, outside: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (path / name).write_bytes(data)
    return plant


def _summary(**change):
    """summary.json with top-level fields changed (callables get the old value)."""
    def plant(path: Path, outside: Path) -> None:
        s = json.loads((path / "summary.json").read_text())
        s.update({k: v(s[k]) if callable(v) else v for k, v in change.items()})
        (path / "summary.json").write_text(json.dumps(s))
    return plant


def _trace(events: list):
    return _replace("trace.json", json.dumps({"traceEvents": events}))


def _linked_out(name: str):
    """`name` moved outside the run directory and a symbolic link to it left in its place:
    what it points at is a perfectly good file, but it is not this run's."""
    def plant(path: Path, outside: Path) -> None:
        target = outside / Path(name).name
        os.rename(path / name, target)
        os.symlink(target, path / name)
    return plant


def _directory(name: str):
    def plant(path: Path, outside: Path) -> None:
        os.unlink(path / name)
        os.mkdir(path / name)
    return plant


def _fifo(name: str):
    def plant(path: Path, outside: Path) -> None:
        os.unlink(path / name)
        os.mkfifo(path / name)
    return plant


def _dev_zero(name: str):
    def plant(path: Path, outside: Path) -> None:
        os.unlink(path / name)
        os.symlink("/dev/zero", path / name)
    return plant


def _sparse(name: str, size: int = 4 << 30):
    """`name` grown to 4 GiB without writing a byte (a hole): refused by its size alone."""
    def plant(path: Path, outside: Path) -> None:
        os.truncate(path / name, size)
    return plant


DEEP = "[" * 100_000 + "]" * 100_000
STEP_EVENT = {"ph": "X", "cat": "step", "name": "step 0", "pid": 0, "tid": 0, "ts": 0.0,
              "dur": 1.0}

# (case id, what to plant, words the one error line must hold)
IN_PROCESS = [
    ("metrics-invalid-utf8", _metrics_line(2, b'{"step": 1, "loss": "\xff\xfe"}'),
     ["rank0.jsonl line 2", "UTF-8"]),
    ("metrics-line-is-a-list", _metrics_line(2, "[1, 2]"), ["rank0.jsonl line 2", "list"]),
    ("metrics-line-is-a-number", _metrics_line(3, "7"), ["rank0.jsonl line 3", "number"]),
    ("metrics-line-without-step", _metrics_field(step=None), ["rank0.jsonl line 2", "step"]),
    ("metrics-step-is-a-string", _metrics_field(step="1"), ["rank0.jsonl line 2", "step"]),
    ("metrics-step-is-true", _metrics_field(step=True), ["rank0.jsonl line 2", "step"]),
    ("metrics-moe-is-a-list", _metrics_field(moe=[1]), ["rank0.jsonl line 2", "moe"]),
    ("metrics-moe-violation-is-a-string",
     _metrics_field(moe={"blocks.0.moe": {"max_violation": "0.3", "drop_rate": 0.0}}),
     ["rank0.jsonl line 2", "moe.blocks.0.moe.max_violation"]),
    ("metrics-moe-bias-holds-a-string",
     _metrics_field(moe={"b": {"max_violation": 0.3, "drop_rate": 0.0, "bias": [0.1, "x"]}}),
     ["rank0.jsonl line 2", "moe.b.bias.1"]),
    ("metrics-time-is-a-list", _metrics_field(time_s=[1, 2]), ["line 2", "time_s"]),
    ("metrics-loss-is-a-string", _metrics_field(loss="low"), ["line 2", "loss"]),
    ("metrics-memory-not-numbers", _metrics_field(memory={"params": "x"}),
     ["line 2", "memory"]),
    ("metrics-huge-int", _metrics_field(rss_peak=10 ** 400), ["line 2", "rss_peak"]),
    ("metrics-too-many-digits", _metrics_line(2, '{"step": 1, "loss": ' + "9" * 5000 + "}"),
     ["rank0.jsonl line 2"]),
    ("metrics-nested-100000-deep", _metrics_line(2, '{"step": 1, "x": ' + DEEP + "}"),
     ["rank0.jsonl line 2", "deep"]),
    ("summary-nested-100000-deep", _replace("summary.json", DEEP), ["summary.json", "deep"]),
    ("summary-not-json", _replace("summary.json", "{not json"), ["summary.json", "JSON"]),
    ("summary-invalid-utf8", _replace("summary.json", b'{"steps": "\xc3"}'),
     ["summary.json", "UTF-8"]),
    ("summary-not-an-object", _replace("summary.json", "[3]"), ["summary.json", "list"]),
    ("summary-steps-is-a-string", _summary(steps="3"), ["summary.json", "steps"]),
    ("summary-losses-empty", _summary(losses=[]), ["summary.json", "losses"]),
    ("summary-ranks-is-a-list", _summary(ranks=[]), ["summary.json", "ranks"]),
    ("summary-rank-not-a-number", _summary(ranks=lambda r: {"x": r["0"]}),
     ["summary.json", "ranks"]),
    ("summary-rank-without-times",
     _summary(ranks=lambda r: {**r, "1": {k: v for k, v in r["1"].items() if k != "time_s"}}),
     ["summary.json", "time_s"]),
    ("summary-tokens-per-s-a-string", _summary(tokens_per_s="fast"),
     ["summary.json", "tokens_per_s"]),
    ("trace-not-json", _replace("trace.json", '{"traceEvents": ['), ["trace.json", "JSON"]),
    ("trace-nested-100000-deep", _replace("trace.json", DEEP), ["trace.json", "deep"]),
    ("trace-not-an-object", _replace("trace.json", "7"), ["trace.json"]),
    ("trace-without-events", _replace("trace.json", '{"events": []}'),
     ["trace.json", "traceEvents"]),
    ("trace-event-is-a-string", _trace(["step 0"]), ["trace.json", "traceEvents"]),
    ("trace-step-event-misnamed", _trace([{**STEP_EVENT, "name": "step zero"}]),
     ["trace.json", "step zero"]),
    ("trace-pid-is-a-list", _trace([{**STEP_EVENT, "pid": [0]}]), ["trace.json", "pid"]),
    ("config-not-an-object", _replace("config.json", "[]"), ["config.json"]),
    ("config-invalid-utf8", _replace("config.json", b'{"command": "\xff"}'),
     ["config.json", "UTF-8"]),
    ("config-model-is-a-string", _replace("config.json", json.dumps({**CONFIG, "model": "x"})),
     ["config.json", "model"]),
    ("config-tokens-per-step-a-string",
     _replace("config.json", json.dumps({**CONFIG, "tokens_per_step": "24"})),
     ["config.json", "tokens_per_step"]),
    ("config-model-flops-a-string",
     _replace("config.json", json.dumps({**CONFIG, "model_flops_per_token": "1e6"})),
     ["config.json", "model_flops_per_token"]),
    ("config-peak-flops-negative",
     _replace("config.json", json.dumps({**CONFIG, "peak_flops": -1.0})),
     ["config.json", "peak_flops", "> 0"]),
    ("metrics-file-linked-out", _unfinished(_linked_out("metrics/rank0.jsonl")),
     ["rank0.jsonl", "symbolic link"]),
    ("summary-linked-out", _linked_out("summary.json"), ["summary.json", "symbolic link"]),
    ("trace-linked-out", _linked_out("trace.json"), ["trace.json", "symbolic link"]),
    ("config-linked-out", _linked_out("config.json"), ["config.json", "symbolic link"]),
    ("metrics-folder-linked-out", _unfinished(_linked_out("metrics")),
     ["metrics", "symbolic link"]),
    ("metrics-file-is-a-directory", _unfinished(_directory("metrics/rank1.jsonl")),
     ["rank1.jsonl", "directory"]),
    ("summary-is-a-directory", _directory("summary.json"), ["summary.json", "directory"]),
    ("trace-is-a-directory", _directory("trace.json"), ["trace.json", "directory"]),
]

ISOLATED_DEFAULT = ("metrics-file-is-a-fifo", "metrics-sparse-4-gib")
ISOLATED = [
    ("metrics-linked-to-dev-zero", _unfinished(_dev_zero("metrics/rank0.jsonl")),
     ["rank0.jsonl", "symbolic link"]),
    ("metrics-file-is-a-fifo", _unfinished(_fifo("metrics/rank0.jsonl")),
     ["rank0.jsonl", "FIFO"]),
    ("summary-is-a-fifo", _fifo("summary.json"), ["summary.json", "FIFO"]),
    ("metrics-sparse-4-gib", _unfinished(_sparse("metrics/rank0.jsonl")),
     ["rank0.jsonl", "4.0 GiB"]),
    ("summary-sparse-4-gib", _sparse("summary.json"), ["summary.json", "4.0 GiB"]),
    ("trace-sparse-4-gib", _sparse("trace.json"), ["trace.json", "4.0 GiB"]),
]


def _one_error_line(code: int, out: str, err: str, words: list[str]) -> None:
    assert code == 2, f"exit code {code}\nstdout: {out}\nstderr: {err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    assert all(w in lines[0] for w in words), f"{lines[0]!r} lacks one of {words}"


def test_the_hand_made_run_directory_reports_cleanly(run, capsys):
    """The baseline every case spoils: exit 0, the run's numbers and its trace line."""
    assert report.main([str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3].startswith("steps 0-2 (3) · loss 3.0000 -> 1.0000 · 48 tokens/s"), out[3]
    assert out[4].startswith("per rank"), out[4]      # no MFU: config.json has no FLOPs
    assert out[-1].endswith("4 events on 2 ranks, steps 0, 1 (open it in "
                            "https://ui.perfetto.dev)"), out[-1]


def test_the_report_gives_mfu_from_the_flops_and_peak_in_config(run, capsys):
    """48 tokens/s x 1000 FLOPs/token / (1 MFLOP/s x 2 ranks) = 2.40 %."""
    (run / "config.json").write_text(json.dumps({**CONFIG, "model_flops_per_token": 1000,
                                                 "peak_flops": 1e6}))
    assert report.main([str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4] == ("MFU 2.40% = 48 tokens/s x 1k FLOPs/token (6N + 12LHQT) / "
                      "(1MFLOP/s x 2 ranks)"), out[4]


@pytest.mark.parametrize("plant, words", [c[1:] for c in IN_PROCESS],
                         ids=[c[0] for c in IN_PROCESS])
def test_a_hostile_file_is_one_error_line(run, tmp_path, capsys, plant, words):
    outside = tmp_path / "outside"
    outside.mkdir()
    plant(run, outside)
    code = report.main([str(run), "--no-plots"])
    out, err = capsys.readouterr()
    _one_error_line(code, out, err, words)


@pytest.mark.parametrize("plant, words", [
    pytest.param(*c[1:], id=c[0],
                 marks=() if c[0] in ISOLATED_DEFAULT else pytest.mark.slow)
    for c in ISOLATED])
def test_a_device_fifo_or_huge_file_is_refused_unread(run, tmp_path, plant, words):
    """Refused by what it is (fstat), before a byte is read: the child could not even hold
    the 4 GiB, and a FIFO without a writer would block an ordinary open forever."""
    outside = tmp_path / "outside"
    outside.mkdir()
    plant(run, outside)
    res = subprocess.run([sys.executable, "-c", _LIMITED, "report", str(run), "--no-plots"],
                         capture_output=True, text=True, timeout=30, cwd=ROOT)
    _one_error_line(res.returncode, res.stdout, res.stderr, words)


def test_a_file_in_metrics_that_is_not_a_ranks_is_left_alone(run, capsys):
    """rank0.old.jsonl (a user's copy) matches rank*.jsonl but names no rank: not read."""
    (run / "summary.json").unlink()                       # so that the metrics are read
    (run / "metrics" / "rank0.old.jsonl").write_text("not a metrics line\n")
    assert report.main([str(run), "--no-plots"]) == 0
    assert capsys.readouterr().out.splitlines()[4].startswith("steps 0-2 (3)")


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["plots", "plots/loss.png"])
def test_plots_are_never_written_through_a_link(run, tmp_path, capsys, planted):
    """plots/ linked to a folder outside is refused by name; a link at plots/loss.png is
    replaced by the new PNG, and the file it pointed at stays as it was."""
    pytest.importorskip("matplotlib")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "loss.png").write_text("keep me\n")
    if planted == "plots":
        os.symlink(outside, run / "plots")
    else:
        (run / "plots").mkdir()
        os.symlink(outside / "loss.png", run / "plots" / "loss.png")
    code = report.main([str(run)])
    out, err = capsys.readouterr()
    assert sorted(os.listdir(outside)) == ["loss.png"]
    assert (outside / "loss.png").read_text() == "keep me\n"
    if planted == "plots":
        _one_error_line(code, "", err, ["plots", "symbolic link"])
    else:
        loss = run / "plots" / "loss.png"
        assert code == 0 and not loss.is_symlink() and loss.read_bytes()[:4] == b"\x89PNG"
        assert sorted(os.listdir(run / "plots")) == ["loss.png", "memory.png", "step_time.png"]
