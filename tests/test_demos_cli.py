"""Every demo's options: a bad one is one `error:` line with exit code 2 (minidist/cli.py's
CliParser and `like`), never a traceback or argparse's two-line usage. One demo in the
default run, every demo under -m slow."""

import glob
import os
import subprocess
import sys

import pytest

DEMOS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "demos", "[0-9]*.py")))
KEPT = {"05_train_gpt.py"}


@pytest.mark.parametrize("demo", [
    d if os.path.basename(d) in KEPT else pytest.param(d, marks=pytest.mark.slow)
    for d in DEMOS], ids=os.path.basename)
def test_a_demo_refuses_a_bad_option_in_one_line(demo):
    for bad in (["--bogus"], ["--steps", "-3"] if "--steps" in _help(demo) else ["--x", "1"]):
        run = subprocess.run([sys.executable, demo, *bad], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and run.stdout == "", (bad, run.stdout, run.stderr)
        assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr


def _help(demo: str) -> str:
    return subprocess.run([sys.executable, demo, "--help"], capture_output=True, text=True,
                          timeout=60).stdout


def test_every_demo_is_covered():
    assert len(DEMOS) == 29
