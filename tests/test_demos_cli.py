"""Every demo's command line refuses what it cannot run the way the other commands do: one
line on stderr, `error: ...`, exit code 2, no traceback and no two-line argparse usage. A
number option is checked when it is parsed (minidist.cli.between, within the demo's LIMITS),
so `--steps -3` or `--steps 10**9` never reaches the code that would trip over it.

The demos' parsers are read in this process (each demo file imported, its parse_args
called; nothing is trained), so all 31 take about a second; two commands run as a user
types them."""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.cli import CliParser, at_least, between

DEMOS = sorted((Path(__file__).resolve().parent.parent / "demos").glob("[0-9][0-9]_*.py"))


class _Parsed(Exception):
    """Raised by the stand-in CliParser.parse_args: the parser was built, nothing ran."""


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"demo_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser(module, monkeypatch) -> CliParser:
    """The parser the demo's parse_args builds; fails unless it is a CliParser."""
    built = []

    def stand_in(self, *args, **kwargs):
        built.append(self)
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(CliParser, "parse_args", stand_in)
        try:
            module.parse_args([])
        except _Parsed:
            pass
    assert built, f"{module.__name__}.parse_args does not parse with minidist.cli.CliParser"
    return built[0]


def _refused(module, argv: list[str], capsys) -> str:
    """The one stderr line with which parse_args(argv) exits 2."""
    with pytest.raises(SystemExit) as e:
        module.parse_args(argv)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2, f"{argv}: exit code {e.value.code}"
    assert len(err) == 1 and err[0].startswith("error: "), f"{argv}: stderr {err}"
    return err[0]


@pytest.mark.parametrize("path", DEMOS, ids=[p.stem[:2] for p in DEMOS])
def test_demo_refuses_unknown_options_and_bad_numbers_in_one_line(path, monkeypatch, capsys):
    module = _load(path)
    assert module.parse_args([]) is not None                  # the defaults are valid
    assert "--bogus" in _refused(module, ["--bogus"], capsys)
    numbers = [a for a in _parser(module, monkeypatch)._actions if a.option_strings
               and isinstance(a.default, (int, float)) and not isinstance(a.default, bool)]
    assert numbers, f"{path.name}: no number option"
    for action in numbers:
        option = action.option_strings[-1]
        for bad in ("-3", "nan", "x"):
            assert option in _refused(module, [option, bad], capsys), (option, bad)
    for name, (_, high) in getattr(module, "LIMITS", {}).items():    # the demo stays small
        option, bad = "--" + name.replace("_", "-"), str(2 * high + 1)
        assert option in _refused(module, [option, bad], capsys), (option, bad)


def test_between_refuses_outside_its_range_and_non_finite_numbers():
    parse = between(1, 8)
    assert parse("8") == 8 and between(0.5, 2.0, float)("0.5") == 0.5
    for bad in ("0", "9", "2.5", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be an int in 1\.\.8"):
            parse(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"a finite number >= 0"):
        at_least(0.0, float)("inf")


@pytest.mark.parametrize("argv, names", [(["05", "--steps", "-3"], "--steps"),
                                         (["01", "--bogus"], "--bogus")])
def test_demo_command_prints_one_error_line(argv, names):
    done = subprocess.run([sys.executable, "-m", "minidist", "demo", *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: ") and names in done.stderr, done.stderr
