"""Every `python -m minidist` command README.md shows works as README says: the main job's
commands are accepted (or refused with the very line README prints) before any rank starts
(default set), and every command but the benchmarks runs to the exit code README implies
(`slow`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minidist import train_cli, train_options

README = Path(__file__).resolve().parents[1] / "README.md"
# Templates a reader fills in (a demo's name, a run directory, their own script).
TEMPLATES = ("NAME", "RUN_DIR", "script.py", "train.py")


def readme_commands() -> list[str]:
    """Every `python -m minidist ...` command in README: lines of code blocks (a `$ `
    prompt and `# comments` dropped, continuation lines joined) and inline code."""
    text = README.read_text()
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ").split("  #")[0]
            if line.startswith("python -m minidist"):
                found.append(" ".join(line.split()))
    for span in re.findall(r"`([^`]*)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        span = " ".join(span.split())
        if span.startswith("python -m minidist"):
            found.append(span)
    return sorted(set(found))


def shown_outputs() -> dict[str, list[str]]:
    """{command: the `error:` and `note:` lines README shows right after it}."""
    shown: dict[str, list[str]] = {}
    for block in re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), re.S):
        command = None
        for line in block.splitlines():
            if line.startswith("$ python -m minidist"):
                command = line.removeprefix("$ ")
            elif command and line.startswith(("error: ", "note: ")):
                shown.setdefault(command, []).append(line)
    return shown


def runnable(command: str) -> list[str]:
    """The argv of a README command: optional [parts] dropped, the first of a|b|c."""
    command = re.sub(r"\s*\[[^\]]*\]", "", command)
    return [word.split("|")[0] for word in command.split()[3:]]


TRAIN = [c for c in readme_commands() if c.startswith("python -m minidist train")
         and c != "python -m minidist train --help"]


def test_readme_shows_the_main_commands():
    commands = readme_commands()
    assert len(commands) >= 30 and len(TRAIN) >= 12, commands
    assert "python -m minidist demo" in commands


@pytest.mark.parametrize("command", TRAIN)
def test_every_train_command_in_readme_is_accepted_or_refused_as_shown(command, capsys,
                                                                      monkeypatch, tmp_path):
    """resolve accepts it, or (README shows an `error:` line) main prints that very line
    before any rank starts; the `note:` lines README shows are the first notes printed."""
    monkeypatch.chdir(tmp_path)                      # a --checkpoint-dir is made here
    shown, argv = shown_outputs().get(command, []), runnable(command)[1:]
    a = train_cli._arguments().parse_args(argv)
    errors = [line for line in shown if line.startswith("error: ")]
    if errors:
        monkeypatch.setattr(train_cli.recovery, "run", None)     # no rank may start
        assert train_cli.main(argv) == 2
        assert capsys.readouterr().err.strip() == errors[0]
        return
    job = train_options.resolve(a)
    notes = [line for line in shown if line.startswith("note: ")]
    assert notes == list(job.notes[:len(notes)]), job.notes


def _exit_code(command: str) -> int:
    """What README implies: 2 for a shown refusal, 1 for the run it makes fail on purpose
    (--inject raise), 3 for `gpu check` without a GPU (exit 3: no GPU), else 0."""
    if any(line.startswith("error: ") for line in shown_outputs().get(command, [])):
        return 2
    if "--inject raise" in command:
        return 1
    return 0


# The benchmarks take minutes each at README's sizes (tests/bench/ runs each one on tiny
# sizes); every other command runs here as written.
SLOW_COMMANDS = [c for c in readme_commands() if not any(t in c for t in TEMPLATES)
                 and not c.startswith("python -m minidist bench")]


@pytest.mark.slow
@pytest.mark.timeout(1500)          # a --check run trains twice: ~100 s here, more on CI
@pytest.mark.parametrize("command", SLOW_COMMANDS)
def test_every_readme_command_runs(command, tmp_path):
    """Run as README writes it (in a fresh directory, the caches there too)."""
    env = {**os.environ, "MINIDIST_COST_FILE": str(tmp_path / "cost.json"),
           "MINIDIST_PEAK_CACHE": str(tmp_path / "peak.json")}
    if "--checkpoint-dir ck2" in command:            # README's two-command scenario
        ck = tmp_path / "ck2"
        ck.mkdir()
    run = subprocess.run([sys.executable, "-m", "minidist", *runnable(command)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    expected = _exit_code(command)
    if command == "python -m minidist gpu check":
        expected = run.returncode if run.returncode in (0, 3) else 0
    assert run.returncode == expected, (command, run.stdout[-3000:], run.stderr[-3000:])
