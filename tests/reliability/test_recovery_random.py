"""Recovery is exact with every layout and every option: random trials, and kills from outside.

Each trial draws a layout (dp and ZeRO 0-3, tp with and without sp, pp under every
schedule, cp ring and Ulysses, ep, a 4-rank product), a set of stateful options (spike
handling, straggler detection, asynchronous checkpoints, retention) and a fault (raise,
exit, SIGKILL, a hang found by a 5 s collective timeout, a harmless sleep) at a random step
and point (start, end, or a random phase inside a save), then checks that the recovered
run ends with the uninterrupted run's `params sha256`. Two more tests kill from outside
the run: a rank SIGKILLed by another process, and the launcher itself SIGKILLed and the
same command run again.

Every test here trains several runs (2.5-4.5 s each): all are in the slow set; the default
run's kill-and-recover is in test_recovery.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minidist import train_cli
from minidist.reliability.checkpoint import PHASES

pytestmark = pytest.mark.multiproc

TINY = ["--steps", "9", "--every", "100", "--n-layer", "2", "--n-embd", "16", "--n-head", "2",
        "--batch", "8", "--dtype", "float64", "--seed", "5"]
LAYOUTS = {
    "one": [], "dp2": ["--dp", "2"], "dp2-zero1": ["--dp", "2", "--zero", "1"],
    "dp2-zero2": ["--dp", "2", "--zero", "2"], "dp2-zero3": ["--dp", "2", "--zero", "3"],
    "tp2": ["--tp", "2"], "tp2-sp": ["--tp", "2", "--sp"],
    "pp2-1f1b": ["--pp", "2"], "pp2-gpipe": ["--pp", "2", "--schedule", "gpipe"],
    "pp2-interleaved": ["--pp", "2", "--schedule", "interleaved", "--n-layer", "4"],
    "pp2-zb-h1": ["--pp", "2", "--schedule", "zb-h1"],
    "cp2": ["--cp", "2"], "cp2-ulysses": ["--cp", "2", "--cp-algo", "ulysses"],
    "ep2": ["--moe-every", "1", "--ep", "2"], "dp2-tp2": ["--dp", "2", "--tp", "2"],
}
OPTIONS = [["--spike", "skip"], ["--spike", "detect"], ["--straggler", "detect"],
           ["--async-checkpoint"], ["--keep", "1"]]
_REFERENCE: dict[tuple, str] = {}


def _digest(out: str) -> str:
    found = re.findall(r"^params sha256: ([0-9a-f]{64})$", out, re.M)
    assert found, out
    return found[-1]


def _run(argv: list[str], capfd) -> tuple[int, str]:
    code = train_cli.main(argv)
    res = capfd.readouterr()
    return code, res.out + res.err


def _reference(argv: list[str], capfd) -> str:
    """The uninterrupted run's digest, with the same layout and options (cached)."""
    key = tuple(argv)
    if key not in _REFERENCE:
        code, out = _run(argv, capfd)
        assert code == 0, out
        _REFERENCE[key] = _digest(out)
    return _REFERENCE[key]


def _trial(seed: int) -> tuple[str, list[str], str, int]:
    """A random (layout, options, fault spec, checkpoint interval)."""
    rng = random.Random(seed)
    layout = rng.choice(sorted(LAYOUTS))
    world = 4 if layout == "dp2-tp2" else 1 if layout == "one" else 2
    every = rng.choice([1, 2, 3])
    options = [o for o in OPTIONS if rng.random() < 0.4]
    if sum(o[0] == "--spike" for o in options) > 1:
        options = [o for o in options if o != ["--spike", "detect"]]
    kind = rng.choice(["sigkill", "exit", "raise", "sleep"]   # a hang needs a peer that
                      + (["sigstop"] if world > 1 else []))     # waits on it to be found
    point = rng.choice(["start", "end"] + ([] if ["--async-checkpoint"] in options
                                           else ["save"]))
    steps = [s for s in range(9) if point != "save" or (s + 1) % every == 0 or s == 8]
    spec = f"{kind}:rank={rng.randrange(world)}:step={rng.choice(steps)}:point={point}"
    spec += ":seconds=0.2" if kind == "sleep" else ""
    spec += f":phase={rng.choice(PHASES)}" if point == "save" else ""
    return layout, [x for o in options for x in o], spec, every


def _check_trial(seed: int, tmp_path, capfd, monkeypatch) -> None:
    layout, options, spec, every = _trial(seed)
    if spec.startswith("sigstop"):                        # a SIGSTOPped rank: found in 5 s
        monkeypatch.setenv("MINIDIST_TIMEOUT", "5")
    base = TINY + LAYOUTS[layout] + options         # a layout's --n-layer wins
    argv = base + ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", str(every),
                   "--inject", spec, "--max-restarts", "2"]
    code, out = _run(argv, capfd)
    what = (layout, options, spec, every)
    assert code == 0, (what, out)
    if not spec.startswith("sleep") and "point=save" not in spec:
        assert "recovery: attempt 0 failed" in out, (what, out)
    assert _digest(out) == _reference(base, capfd), what


@pytest.mark.slow
def test_one_random_trial_of_every_option_recovers_bitwise(tmp_path, capfd):
    """A fixed trial beside the sweep below: pp's interleaved schedule with every stateful
    option on and a SIGKILL in the middle of a save."""
    base = TINY + LAYOUTS["pp2-interleaved"] + ["--spike", "skip", "--straggler", "detect",
                                                "--keep", "1"]
    argv = base + ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
                   "--inject", "sigkill:rank=1:step=5:point=save:phase=marker_written",
                   "--max-restarts", "1"]
    code, out = _run(argv, capfd)
    assert code == 0 and "recovery: attempt 0 failed" in out, out
    assert _digest(out) == _reference(base, capfd)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(60))
def test_random_layouts_options_and_faults_recover_bitwise(seed, tmp_path, capfd, monkeypatch):
    _check_trial(seed, tmp_path, capfd, monkeypatch)


# --- kills from outside the run ------------------------------------------------------------

CMD = [sys.executable, "-m", "minidist", "train", "--dp", "2", "--steps", "40", "--every",
       "100", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--batch", "8", "--dtype",
       "float64", "--seed", "7", "--checkpoint-every", "2", "--spike", "skip"]


def _children(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until `path` exists (the first checkpoint committed) while `proc` runs."""
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def _uninterrupted(tmp_path) -> str:
    out = subprocess.run(CMD + ["--checkpoint-dir", str(tmp_path / "whole")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return _digest(out.stdout)


@pytest.mark.slow
def test_a_rank_killed_from_outside_is_recovered_bitwise(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.Popen(CMD + ["--checkpoint-dir", str(ck), "--max-restarts", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    _wait_for(ck / "latest", proc)
    os.kill(_children(proc.pid)[-1], signal.SIGKILL)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "recovery: attempt 0 failed" in out, out
    assert _digest(out) == _uninterrupted(tmp_path)


@pytest.mark.slow
def test_the_launcher_killed_and_the_command_run_again_ends_bitwise(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.Popen(CMD + ["--checkpoint-dir", str(ck)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    _wait_for(ck / "latest", proc)
    ranks = _children(proc.pid)
    proc.kill()
    proc.communicate(timeout=60)
    end = time.monotonic() + 30
    while any(_alive(r) for r in ranks):              # they die with their launcher
        assert time.monotonic() < end, "ranks outlived their SIGKILLed launcher"
        time.sleep(0.05)
    again = subprocess.run(CMD + ["--checkpoint-dir", str(ck)], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.search(r"^resuming from .*ck/step\d{8} \(step \d+\)$", again.stdout, re.M), \
        again.stdout
    assert _digest(again.stdout) == _uninterrupted(tmp_path)
