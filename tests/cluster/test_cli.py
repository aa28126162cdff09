"""`python -m minidist cluster simulate` (cluster/cli.py), called as main(argv): the
comparison table, a trace file in and out, plots, and one-line usage errors (exit 2).

The plots (~2 s, most of it matplotlib's import and drawing) are in the slow set, like
every other test that needs matplotlib."""

import importlib.util

import pytest

from minidist.cluster import traces
from minidist.cluster.cli import main


def rows(text: str) -> dict[str, list[str]]:
    """policy -> the cells of its table row."""
    return {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.split() and line.split()[0] in ("fifo", "easy", "sjf", "fair", "las")}


def test_all_policies_side_by_side_and_the_audit_passes(capsys):
    assert main(["simulate", "--policy", "all", "--trace", "synthetic:60", "--nodes", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace synthetic:60 (Philly-like, seed 0, load 0.9): 60 jobs")
    assert "cluster 4 nodes x 8 GPUs = 32" in out
    assert list(rows(out)) == ["fifo", "easy", "sjf", "fair", "las"]
    assert all(r[-1] == "0" for p, r in rows(out).items() if p != "las")   # no preemptions
    assert "audit: every job ran exactly its work" in out


def test_one_policy_with_events_and_the_same_trace_through_a_file(tmp_path, capsys):
    path = str(tmp_path / "t.csv")
    args = ["simulate", "--policy", "las", "--nodes", "2", "--gpus-per-node", "4"]
    assert main(args + ["--trace", "synthetic:30", "--seed", "5", "--save-trace", path,
                        "--events", "3"]) == 0
    first = capsys.readouterr().out
    assert len(traces.load_trace(path)) == 30
    assert "first 3 events of las: 0 submit j00; 0 start j00;" in first
    assert main(args + ["--trace", path]) == 0
    again = capsys.readouterr().out
    assert "(from file)" in again and rows(again) == rows(first)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plots_are_written(tmp_path, capsys):
    assert main(["simulate", "--trace", "synthetic:20", "--plot", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpus_in_use.png", "jct_cdf.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--policy", "srtf"], "argument --policy: invalid choice: 'srtf'"),
    (["simulate", "--nodes", "0"], "argument --nodes: must be an int >= 1, got '0'"),
    (["simulate", "--trace", "synthetic:many"], "write synthetic:N with N >= 1 jobs"),
    (["simulate", "--las-thresholds", "1h"], "--las-thresholds '1h': write numbers"),
    (["simulate", "--las-thresholds", "50,5"], "must be > 0 and increasing"),
    (["simulate", "--real", "--trace", "synthetic:5"], "--real: synthetic traces last days"),
    (["simulate", "--real", "--nodes", "2"], "--real runs on this machine's --slots"),
    (["simulate", "--real", "--slots", "1"], "job b needs 2 slots, but --slots is 1"),
    (["simulate", "--plot", "/no/such/dir"], "--plot /no/such/dir: no such folder"),
    (["simulate", "--trace", "synthetic:5", "--save-trace", "/no/such/dir/t.csv"],
     "--save-trace /no/such/dir/t.csv: cannot write it (No such file or directory)"),
    ([], "the following arguments are required: simulate"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:                      # argparse's own errors exit from inside
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_real_refuses_jobs_that_are_not_tiny_and_an_old_workdir(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("id,submit,gpus,duration\nx,0,1,3600\n")
    assert main(["simulate", "--real", "--trace", str(trace)]) == 2
    assert "job x would train 360000 steps" in capsys.readouterr().err
    (tmp_path / "las").mkdir()
    assert main(["simulate", "--real", "--policy", "las", "--workdir", str(tmp_path)]) == 2
    assert "already holds las/ from an earlier run" in capsys.readouterr().err
