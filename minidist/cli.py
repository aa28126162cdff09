"""What every command of `python -m minidist` shares: its parser and its errors.

A user error is one line on stderr, `error: ...`, with exit code 2 (usage) and the fix
in the message; a number option is refused at parsing unless it is in range. The train
command, the benchmarks, the cluster simulator, the memory estimator, the roofline and
the report all parse their options this way.
Read next: __main__.py (the commands).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
from typing import Callable, Sequence


class CliParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, `error: ...`, with exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")

    def add_numbers(self, defaults: dict[str, float], limits: dict[str, tuple]) -> None:
        """One option per default, `--name-with-dashes`, of the default's type, refused at
        parsing outside limits[name] = (low, high) (the demos keep their sizes small)."""
        for name, value in defaults.items():
            low, high = limits[name]
            self.add_argument("--" + name.replace("_", "-"), default=value,
                              type=between(low, high, type(value)),
                              help=f"{low}..{high} (default {value})")


def cli_error(message: object) -> int:
    """Print a user error as one line on stderr, `error: ...`; return exit code 2."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


def between(low: float, high: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused unless it is finite and low <= it <= high
    (the demos keep their sizes small this way: `--steps 10..10000`)."""
    what = "an int" if kind is int else "a finite number"
    rule = f">= {low}" if high == math.inf else f"in {low}..{high}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (low <= value <= high and value < math.inf):
            raise argparse.ArgumentTypeError(f"must be {what} {rule}, got {text!r}")
        return value
    return parse


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused unless it is finite and >= low."""
    return between(low, math.inf, kind)


def directory(text: str) -> str:
    """An argparse type: a directory the command writes into (made later if missing);
    refused if it names a file."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory; give a "
                                         "directory (it is made if missing)")
    return text


def file_path(text: str) -> str:
    """An argparse type: a file the command reads or writes; refused if it names a
    directory, or if the directory it would be in does not exist."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name in it, "
                                         f"e.g. {os.path.join(text, 'out')}")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: its directory {folder} does not exist")
    return text


def shell_command(argv: Sequence[str], width: int = 100) -> str:
    """`$ python -m minidist ARGV` as a user types it, in lines of at most `width`
    characters ending in a backslash, as a shell continues them; an option stays on the line
    of its value (a pair longer than a line stays whole). The demos print the commands
    they run this way."""
    units: list[str] = []
    for word in ["$", "python", "-m", "minidist", *argv]:
        if units and units[-1].startswith("--") and " " not in units[-1] \
                and not word.startswith("--"):
            units[-1] += " " + word
        else:
            units.append(word)
    lines = [units[0]]
    for unit in units[1:]:
        if len(lines[-1] + " " + unit) <= width - 2:
            lines[-1] += " " + unit
        else:
            lines.append("    " + unit)
    return " \\\n".join(lines)


def echo(line: str, width: int = 100) -> str:
    """A line of a command's output as a demo quotes it, after "  | ": a progress line cut
    to its first fields, `step N | loss X | T s` (the rest is the live display), any other
    line wrapped at `width`."""
    if line.startswith("step "):
        line = " | ".join(line.split(" | ")[:3])
    return textwrap.fill(line, width, initial_indent="  | ", subsequent_indent="  |     ")
