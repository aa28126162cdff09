"""The command line follows the conventions: a user error is one `error:` line on stderr
with exit code 2; --help and --version print on stdout with exit code 0; a closed stdout
(`| head`) and Ctrl-C end quietly (141, 130) with no rank left; a failing rank's
RankFailure comes first on stderr with exit code 1."""

import configparser
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import minidist
from minidist.cli import shell_command
from tests.helpers import child_pids

ROOT = Path(__file__).resolve().parent.parent
TINY = ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--length", "3", "--batch", "8")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def minidist_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minidist", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=ENV)


# A shell starts a job with SIGINT and SIGQUIT at their defaults. The test process may not
# have them so when it forks: C's system(), run by any thread of it, ignores both in the
# whole process until it returns, and a child forked meanwhile inherits SIG_IGN (seen in
# full runs: jobs that Ctrl-C could not stop). So the job is started through a one-line
# exec that sets them back to default first, as the shell would.
_AS_A_SHELL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               "signal.signal(signal.SIGQUIT, signal.SIG_DFL); "
               "os.execv(sys.executable, [sys.executable, '-m', 'minidist', *sys.argv[1:]])")


def start(*args: str) -> subprocess.Popen:
    """`python -m minidist ARGS` in its own process group (as a shell job), stdout piped."""
    return subprocess.Popen([sys.executable, "-c", _AS_A_SHELL, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV,
                            start_new_session=True)


def assert_user_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert "Traceback" not in res.stdout + res.stderr


USER_ERRORS = [
    (["train", "--dp", "0"], ["--dp", ">= 1"]),
    (["train", "--dp", "3"], ["--batch 32", "--dp 3"]),          # 32 rows over 3 ranks
    (["train", "--every", "0"], ["--every", ">= 1"]),
    (["train", "--dp", "2", "--every", "0"], ["--every"]),
    (["train", "--tp", "3"], ["--tp 3", "use --tp 2"]),
    (["train", "--steps", "-1"], ["--steps"]),
    (["train", "--grad-accum", "3"], ["--batch 32", "--grad-accum 3", "30 or --batch 33"]),
    (["train", "--lr", "-1"], ["--lr"]),
    (["train", "--n-embd", "30"], ["--n-embd 30", "use --n-head 3", "--n-embd 32"]),
    (["train", "--no-such-option"], ["--no-such-option"]),
    (["train", "--pp", "2", "--schedule", "missing.csv"], ["--schedule", "missing.csv"]),
    (["train", "--pp", "2", "--schedule", "/dev/zero"], ["--schedule", "not a regular file"]),
    (["train", "--pp", "2", "--layers-per-stage", "x"], ["--layers-per-stage", "'x'"]),
    (["run", "-n", "2", "missing.py"], ["no such script", "missing.py"]),
    (["run", "-n", "0", "missing.py"], ["-n", ">= 1"]),
    (["run"], ["required"]),
    (["frobnicate"], ["unknown command 'frobnicate'", "run, train, demo, bench"]),
    (["--frobnicate"], ["unknown option"]),
    (["demo", "no_such_demo"], ["no_such_demo"]),
    (["bench", "no_such_bench"], ["collectives", "no_such_bench"]),
    (["bench", "collectives", "--world-sizes", "99"], ["world sizes must be 1..8"]),
    (["bench", "pipeline", "--pp", "0"], ["--pp", ">= 2"]),
    (["bench", "train", "--bogus"], ["--bogus"]),
    (["bench", "autograd", "--bogus"], ["--bogus"]),
    (["bench", "checkpoint", "--bogus"], ["--bogus"]),
    (["train", "--dp", "2", "--inject", "boom:rank=0:step=1"], ["unknown kind 'boom'"]),
    (["train", "--dp", "2", "--elastic"], ["--elastic", "--checkpoint-dir"]),
]
# Each case starts a Python (~0.5 s), so the default run keeps a handful of distinct kinds,
# by index: a `run` option (missing script), an unknown command, an unknown top-level option
# (the last two cost ~0.1 s). `train`'s one-line errors are also checked in-process by
# test_backend.py; every case runs under -m slow.
DEFAULT_USER_ERRORS = {13, 16, 17}


@pytest.mark.parametrize("args, words", [
    case if i in DEFAULT_USER_ERRORS else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(USER_ERRORS)])
def test_a_user_error_is_one_line_with_exit_code_2(args, words):
    assert_user_error(minidist_cli(*args, "--steps", "1") if args[0] == "train"
                      and "--steps" not in args else minidist_cli(*args), *words)


@pytest.mark.parametrize("args", [[], ["-h"], ["--help"]])
def test_help_goes_to_stdout_with_exit_code_0(args):
    res = minidist_cli(*args)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.startswith("Command line: `python -m minidist run|train|demo|bench")
    assert "--version" in res.stdout


@pytest.mark.slow                  # ~0.4 s each; the default run keeps the top-level --help above
@pytest.mark.parametrize("command", ["train", "run", "demo", "bench"])
def test_each_command_has_help_on_stdout(command):
    res = minidist_cli(command, "--help")
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith("usage: ")


def test_version_matches_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert minidist.__version__ == cfg["metadata"]["version"]
    res = minidist_cli("--version")
    assert (res.returncode, res.stdout, res.stderr) == (0, f"minidist {minidist.__version__}\n",
                                                        "")


@pytest.mark.slow                  # an edge case of `train`, ~0.8 s a layout
@pytest.mark.parametrize("layout", [[], ["--dp", "2"]])
def test_zero_steps_trains_nothing_and_shows_no_samples(layout):
    res = minidist_cli("train", *layout, *TINY, "--steps", "0")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    out = res.stdout.splitlines()
    header = 2 if layout else 1                   # ranks: the algorithms' line too
    assert out[0].startswith("task sort · GPT 1 layers") and len(out) == header + 1
    assert out[-1] == "--steps 0: nothing to train, so no held-out samples to show."


# `train`'s closed stdout and Ctrl-C are slow (~0.8 s each); the default run keeps Ctrl-C on
# `run` below and a closed stdout on `run` (runtime/test_torchrun.py).
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [[], ["--dp", "2"]])
def test_a_closed_stdout_ends_train_quietly(layout):
    proc = start("train", *layout, *TINY, "--steps", "500", "--every", "1")
    n = 4 if layout else 3                          # ranks: the algorithms' line too
    lines = [proc.stdout.readline() for _ in range(n)]        # `| head -n`
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert lines[0].startswith("task sort") and lines[-1].startswith("step    1 |"), lines
    assert proc.returncode == 128 + signal.SIGPIPE and err == "", err


def _interrupt_after_first_step(proc: subprocess.Popen) -> tuple[list[int], str]:
    """Wait for the first step line, SIGINT the whole process group as Ctrl-C does;
    return the launcher's children seen before, and stderr."""
    while not (line := proc.stdout.readline()).startswith(("step", "[rank0]:ready")):
        assert line, proc.communicate(timeout=30)[1]
    kids = child_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:         # say what every process of the job is doing
        states = {pid: _status(pid) for pid in [proc.pid, *child_pids(proc.pid)]}
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise AssertionError(f"SIGINT did not end the job within 30 s: {states}") from None
    return kids, err


def _status(pid: int) -> str:
    """A process's state, signal masks and wait channel, from /proc (for a failure message)."""
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
        keep = [x for x in lines if x.split(":")[0] in ("State", "SigBlk", "SigIgn", "SigCgt")]
        return "; ".join(keep) + "; wchan " + open(f"/proc/{pid}/wchan").read()
    except OSError as e:
        return f"gone ({e.strerror})"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [[], ["--dp", "2"]])
def test_ctrl_c_ends_train_quietly_with_130_and_no_rank_left(layout):
    proc = start("train", *layout, *TINY, "--steps", "100000", "--every", "1")
    kids, err = _interrupt_after_first_step(proc)
    assert proc.returncode == 128 + signal.SIGINT and err == "", err
    assert len(kids) == (2 if layout else 0)
    deadline = time.monotonic() + 5
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(k) for k in kids), kids


@pytest.mark.multiproc
def test_ctrl_c_ends_run_quietly_with_130_and_no_rank_left(tmp_path):
    script = tmp_path / "forever.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import minidist
        ctx = minidist.init()
        ctx.world.barrier()
        if ctx.rank == 0:
            print("ready", flush=True)
        while True:
            time.sleep(0.01)
    """))
    proc = start("run", "-n", "2", str(script))
    kids, err = _interrupt_after_first_step(proc)
    assert proc.returncode == 128 + signal.SIGINT and err == "", err
    assert len(kids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(k) for k in kids), kids


FAILING_RANK = textwrap.dedent("""
    import runpy, sys
    import minidist.train

    def fails_on_rank_1(ctx, *args, **kwargs):
        if ctx.rank == 1:
            raise RuntimeError("boom on rank 1")
        ctx.world.barrier()

    minidist.train.train_on_rank = fails_on_rank_1     # the forked ranks inherit it
    sys.argv = ["minidist", "train", "--dp", "2", "--steps", "1"]
    runpy.run_module("minidist", run_name="__main__")
""")


@pytest.mark.slow      # the default run has `run`'s (runtime/test_torchrun.py, a killed rank)
@pytest.mark.multiproc
def test_a_failing_rank_prints_the_rank_failure_first_with_exit_code_1():
    res = subprocess.run([sys.executable, "-c", FAILING_RANK], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, env=ENV)
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("minidist train: rank 1 of 2 failed"), res.stderr
    assert res.stderr.count("Traceback") == 1                 # rank 1's, inside the text
    assert res.stderr.count("RuntimeError: boom on rank 1") == 1, res.stderr  # said once,
    assert res.stderr.rstrip().endswith("in fails_on_rank_1"), res.stderr     # then where


def test_the_verdict_says_matches_or_differs_from(capsys):
    from argparse import Namespace
    from types import SimpleNamespace

    from minidist.baseline import train_single_process
    from minidist.data import DataConfig, model_config_for
    from minidist.train_check import check as _check
    data = DataConfig(task="reverse", length=3)
    cfg = model_config_for(data, n_layer=1, n_embd=8, n_head=2, dtype="float64")
    a = Namespace(steps=2, batch=4, lr=1e-2, seed=0, grad_accum=1, optimizer="sgd")
    ref = train_single_process(cfg, data, steps=2, global_batch=4, lr=1e-2, optimizer="sgd")
    same = SimpleNamespace(losses=ref.losses, params=ref.params, routing_biases=())
    off = SimpleNamespace(losses=ref.losses, params={k: v + 1e-3 for k, v in ref.params.items()},
                          routing_biases=())
    assert _check(a, cfg, data, same, "dp=2") == 0
    assert _check(a, cfg, data, off, "dp=2") == 1
    ok, bad = capsys.readouterr().out.splitlines()
    assert ok.startswith("OK: dp=2 training matches the single-process run (float64; ")
    assert bad.startswith("MISMATCH: dp=2 training differs from the single-process run ")
    assert "final params max |Δ| = 1.0e-03" in bad
    # a MoE with aux-loss-free balancing: a routing bias one step apart is a mismatch
    moe = model_config_for(data, n_layer=1, n_embd=8, n_head=2, dtype="float64", moe_every=1,
                           router="sigmoid", bias_rate=0.01)
    ref = train_single_process(moe, data, steps=2, global_batch=4, lr=1e-2, optimizer="sgd")
    biased = [dict(b) for b in ref.routing_biases]
    biased[1] = {k: v + 0.02 for k, v in biased[1].items()}
    same = SimpleNamespace(losses=ref.losses, params=ref.params,
                           routing_biases=ref.routing_biases)
    off = SimpleNamespace(losses=ref.losses, params=ref.params, routing_biases=tuple(biased))
    assert _check(a, moe, data, same, "dp=2") == 0
    assert _check(a, moe, data, off, "dp=2") == 1
    ok, bad = capsys.readouterr().out.splitlines()
    assert ok.endswith("routing biases max |Δ| over the steps = 0.0e+00)")
    assert bad.startswith("MISMATCH") and bad.endswith("max |Δ| over the steps = 2.0e-02)")


def test_each_demo_header_carries_its_file_number():
    for path in sorted((ROOT / "demos").glob("[0-9][0-9]_*.py")):
        numbers = re.findall(r'print\(f?"demo (\d\d) ', path.read_text())
        assert numbers == [path.name[:2]], (path.name, numbers)


@pytest.mark.multiproc
@pytest.mark.parametrize("extra, sync, reductions", [
    ([], "DDP with shared-memory buckets (parallel/data/buckets.py)",
     "direct reductions in rank order (collectives/direct.py)"),
    pytest.param(["--plain"], "DDP, one all-reduce per parameter (parallel/data/ddp.py)",
                 "ring reductions (collectives/ring.py)", marks=pytest.mark.slow),
    (["--plain", "--zero", "2"], "ZeRO-2 (parallel/zero/engine.py)",
     "ring reductions (collectives/ring.py)")])
def test_the_header_names_the_algorithms_and_plain_runs_the_textbook_ones(extra, sync,
                                                                           reductions, capsys):
    """The fast paths are the default; the header says which run, and --plain runs the
    plain ones to the same verdict against the single process. (The default test run keeps
    the default algorithms and --plain --zero 2: the train job end to end, with --check.)"""
    from minidist.train_cli import main
    args = ["--dp", "2", "--task", "copy", "--length", "3", "--steps", "2", "--n-layer", "1",
            "--n-embd", "16", "--batch", "8", "--check", "--run-dir", "none"]
    assert main(args + extra) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("algorithms: "))
    assert line.startswith(f"algorithms: {sync} · {reductions}")
    assert ("--plain: the textbook ones" in line) is not bool(extra)
    assert "OK: dp=2 x tp=1" in out


def test_shell_command_wraps_with_backslashes_and_keeps_an_option_with_its_value():
    argv = ["train", "--dp", "2", "--checkpoint-dir", "/tmp/" + "d" * 20, "--inject",
            "raise:rank=0:step=6", "--check"]
    text = shell_command(argv, width=60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines), lines
    assert all(line.endswith(" \\") for line in lines[:-1]) and len(lines) > 1, lines
    assert " ".join(line.removesuffix(" \\").strip() for line in lines) == \
        "$ python -m minidist " + " ".join(argv)
    assert any(line.strip().startswith("--inject raise:rank=0:step=6") for line in lines)
    assert shell_command(["demo"]) == "$ python -m minidist demo"
