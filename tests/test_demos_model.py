"""Demos 04 (autograd) and 05 (train GPT) run as a reader would run them and end with OK.
Demo 05 (~4 s of training) is in the slow set; demo 04 and its failing verdict stay."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import assert_lines_fit

DEMOS = Path(__file__).resolve().parent.parent / "demos"


@pytest.mark.parametrize("demo", ["04_autograd.py",
                                  pytest.param("05_train_gpt.py", marks=pytest.mark.slow)])
def test_demo_ends_with_ok(demo):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(DEMOS / demo)], capture_output=True, text=True,
                         timeout=60, env=env)
    lines = run.stdout.strip().splitlines()
    assert_lines_fit(lines + run.stderr.splitlines(), f"demos/{demo}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert lines and lines[-1].startswith("OK: "), run.stdout + run.stderr
    assert "(max |Δ| = " in lines[-1] if demo.startswith("04") else "held-out" in lines[-1]


def test_demo_04_reports_mismatch_when_eps_is_absurd():
    """The verdict can fail: eps = 1 makes finite differences wrong by far more than 1e-8."""
    run = subprocess.run([sys.executable, str(DEMOS / "04_autograd.py"), "--eps", "1.0"],
                         capture_output=True, text=True, timeout=60)
    assert_lines_fit(run.stdout.splitlines() + run.stderr.splitlines(), "demos/04 --eps 1.0")
    assert run.returncode == 1 and run.stdout.strip().splitlines()[-1].startswith("MISMATCH:")
