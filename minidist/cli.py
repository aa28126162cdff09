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
import sys
from typing import Callable


class CliParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, `error: ...`, with exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def cli_error(message: object) -> int:
    """Print a user error as one line on stderr, `error: ...`; return exit code 2."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, refused unless it is finite and >= low."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be {'an int' if kind is int else 'a finite number'}"
                                             f" >= {low}, got {text!r}")
        return value
    return parse


def like(default) -> Callable[[str], object]:
    """The argparse type of an option that defaults to `default` (the demos' options): an
    int >= 1 (>= 0 if the default is 0), a finite number >= 0, or the text as given."""
    if isinstance(default, bool) or not isinstance(default, (int, float)):
        return str
    if isinstance(default, int):
        return at_least(0 if default == 0 else 1)
    return at_least(0.0, float)

