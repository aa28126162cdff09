"""Bad input to any command: one `error:` line on stderr with exit code 2, or exit 1 with
the cause first; never a Python traceback, never argparse's two-line usage.

The listed cases are the refusals found by trying every command as a new user would; the
randomized test draws an option from each command's --help and feeds it a value no option
accepts (a negative, a non-number, a non-finite number, a file where a directory belongs and
the other way round). The default run tries one listed case per command; -m slow all of
them and 120 random draws."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest

SCRIPT = "print('hello')\n"
CASES = {   # command: [argv after `python -m minidist`, ...]
    "run": [["run", "-n", "100000", "{script}"], ["run", "-n", "0", "{script}"],
            ["run", "--log-dir", "/etc/passwd", "{script}"], ["run", "-n", "2", "nope.py"]],
    "train": [["train", "--lr", "inf"], ["train", "--length", "100000000"],
              ["train", "--run-dir", "/etc/passwd", "--dp", "2"], ["train", "--sp"],
              ["train", "--pp", "2", "--schedule", "/tmp"], ["train", "--bogus"],
              ["train", "--checkpoint-every", "0"], ["train", "--offload-dir", "/etc/passwd"]],
    "demo": [["demo", "05", "--steps", "-3"], ["demo", "01", "--bogus"], ["demo", "99"]],
    "bench": [["bench", "autograd", "--repeats", "0"],
              ["bench", "checkpoint", "--dir", "/etc/passwd"],
              ["bench", "offload", "--offload-dir", "/etc/passwd"],
              ["bench", "collectives", "--cost-file", "/tmp"],
              ["bench", "collectives", "--cost-file", "/etc/passwd"],
              ["bench", "pipeline", "--pp", "0"], ["bench", "train", "--dp", "-1"],
              ["bench", "nope"]],
    "memory": [["memory", "--model", "nope"], ["memory", "--plan", "dp=0"]],
    "report": [["report", "/nonexistent"], ["report", "/etc/passwd"]],
    "roofline": [["roofline", "--png", "/nonexistent/d/x.png"], ["roofline", "--png", "/tmp"],
                 ["roofline", "--peak-cache", "/tmp"], ["roofline", "--batch", "-1"]],
    "gpu": [["gpu", "check", "--bogus"], ["gpu", "check", "--parts", "nope"], ["gpu", "nope"]],
    "cluster": [["cluster", "simulate", "--trace", "synthetic:100000000"],
                ["cluster", "simulate", "--trace", "/etc/passwd"],
                ["cluster", "simulate", "--policy", "nope"]],
    "interval": [["interval", "--mtbf", "abc"], ["interval"],
                 ["interval", "--checkpoint-cost", "30s", "--restart", "2m", "--mtbf", "3h",
                  "--plot", "/tmp"]],
}
ENVIRONMENT = [({"MINIDIST_TIMEOUT": "abc"}, ["run", "-n", "2", "{script}"]),
               ({"MINIDIST_GROUPS": "0"}, ["run", "-n", "2", "{script}"]),
               ({"MINIDIST_GROUP_BYTES": "1000"}, ["train", "--dp", "2"])]
BAD_VALUES = ["-1", "-7", "abc", "nan", "inf", "1e999", "/etc/passwd", "/tmp"]


def _minidist(argv: list[str], tmp_path, env: dict | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    argv = [a.replace("{script}", str(script)) for a in argv]
    return subprocess.run([sys.executable, "-m", "minidist", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _assert_refused(run: subprocess.CompletedProcess, what) -> None:
    assert "Traceback" not in run.stderr, (what, run.stderr[-3000:])
    assert run.returncode in (1, 2), (what, run.returncode, run.stdout[-500:], run.stderr)
    if run.returncode == 2:
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, \
            (what, run.stderr)


@pytest.mark.parametrize("argv", [
    argv if i == 0 else pytest.param(argv, marks=pytest.mark.slow)
    for cases in CASES.values() for i, argv in enumerate(cases)], ids=" ".join)
def test_a_bad_input_is_refused_in_one_line(argv, tmp_path):
    _assert_refused(_minidist(argv, tmp_path), argv)


@pytest.mark.slow
@pytest.mark.parametrize("env, argv", ENVIRONMENT, ids=lambda v: " ".join(
    v if isinstance(v, list) else v))
def test_a_bad_environment_variable_is_refused_in_one_line(env, argv, tmp_path):
    _assert_refused(_minidist(argv, tmp_path, env), (env, argv))


def _options(command: list[str], tmp_path) -> list[str]:
    """The --options of a command's --help that take a value (METAVAR or {choices})."""
    text = _minidist([*command, "--help"], tmp_path).stdout
    return sorted(set(re.findall(r"(--[a-z][a-z-]*)[ =](?:[A-Z_]+|\{)", text)))


COMMANDS = [["train"], ["bench", "collectives"], ["bench", "autograd"], ["bench", "train"],
            ["bench", "pipeline"], ["bench", "checkpoint"], ["bench", "throughput"],
            ["bench", "recompute"], ["bench", "observe"], ["bench", "offload"],
            ["bench", "determinism"], ["memory"], ["roofline"], ["cluster", "simulate"],
            ["interval"], ["run"], ["demo", "05"], ["demo", "13"]]


@pytest.mark.slow
@pytest.mark.timeout(6 * 60 + 60)         # 6 draws, each at most 60 s (one that runs)
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_random_bad_values_for_every_option_are_refused(command, tmp_path):
    """Draw an option of the command and a value no option should take; a value some
    option does take (a path) may run: then it must end in time (exit 0) or be refused."""
    options = _options(command, tmp_path)
    assert options, command
    rng = random.Random(" ".join(command))
    for _ in range(6):
        option, value = rng.choice(options), rng.choice(BAD_VALUES)
        argv = [*command, option, value] + (["{script}"] if command == ["run"] else [])
        try:
            run = _minidist(argv, tmp_path, timeout=60)
        except subprocess.TimeoutExpired:         # accepted and running: not a refusal
            continue
        if run.returncode != 0:
            _assert_refused(run, argv)


BENCH_REFUSALS = [
    (["bench", "checkpoint", "--steps", "5"], "--steps 5 must be at least 2 x --every = 20"),
    (["bench", "checkpoint", "--dp", "3"], "--batch 32 must divide by --dp 3"),
    (["bench", "train", "--tp", "2", "--zero", "1"], "--zero is not in the --tp and --cp"),
    (["bench", "train", "--sp"], "--sp needs --tp > 1")]


@pytest.mark.parametrize("argv, says", BENCH_REFUSALS,
                         ids=[" ".join(argv) for argv, _ in BENCH_REFUSALS])
def test_a_bench_refusal_names_the_one_rule_broken(argv, says, tmp_path):
    """Not every rule of the bench at once."""
    run = _minidist(argv, tmp_path)
    assert run.returncode == 2 and run.stderr.startswith(f"error: {says}"), run.stderr
