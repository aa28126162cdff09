"""The command line: `python -m minidist run -n N script.py` runs a script on N ranks.

The tests here that start a Python (~0.4 s each) repeat what the default run already
checks elsewhere (runtime/test_torchrun.py: `run -n 3`, a failing rank;
runtime/test_torch_api.py: a plain process is a one-rank job; test_cli.py: an unknown
command; test_baseline.py: the baseline imports no runtime), so they run under -m slow."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import minidist
    ctx = minidist.init()
    g = ctx.world
    x = np.array([float(ctx.rank)])
    other = g.sendrecv(x, (g.rank + 1) % g.size, (g.rank - 1) % g.size) if g.size > 1 else x
    line = f"rank {ctx.rank}/{ctx.world_size} got {other[0]:.0f} args {sys.argv[1:]}\\n"
    sys.stdout.write(line)        # one write per line: ranks share the terminal
    sys.stdout.flush()
    if "--fail" in sys.argv and ctx.rank == 1:
        raise SystemExit(3)
""")


def _run(tmp_path, *args):
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "minidist", "run", *args, str(script), "--x"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
@pytest.mark.multiproc
def test_run_starts_one_process_per_rank(tmp_path):
    res = _run(tmp_path, "-n", "3")
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert lines == [f"[rank{r}]:rank {r}/3 got {(r - 1) % 3} args ['--x']" for r in range(3)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_run_reports_a_failing_rank(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, "-m", "minidist", "run", "-n", "2", str(script),
                          "--fail"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "rank 1 of 2 failed" in res.stderr and "SystemExit: 3" in res.stderr


@pytest.mark.slow
def test_plain_python_script_gets_a_one_rank_job(tmp_path):
    script = tmp_path / "solo.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "rank 0/1 got 0 args []"


@pytest.mark.slow
def test_unknown_command_prints_usage():
    res = subprocess.run([sys.executable, "-m", "minidist", "frobnicate"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "python -m minidist run" in res.stderr


def test_top_level_api_is_torch_shaped():
    import minidist
    for name in ("spawn", "init", "get_rank", "get_world_size", "new_group", "all_reduce",
                 "broadcast", "reduce_scatter", "all_gather", "barrier", "RankFailure"):
        assert callable(getattr(minidist, name)), name
    with pytest.raises(AttributeError):
        minidist.no_such_thing


@pytest.mark.slow
def test_baseline_does_not_load_the_runtime():
    code = ("import sys, minidist.baseline; "
            "print(any(m.startswith('minidist.runtime') for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.stdout.strip() == "False", res.stderr


@pytest.mark.parametrize("env, args, says", [
    ({}, ["-n", "100000"], r"^error: 100000 ranks: this machine can start at most \d+ "),
    ({"MINIDIST_TIMEOUT": "abc"}, ["-n", "2"], r"^error: MINIDIST_TIMEOUT='abc' is not a"),
    ({"MINIDIST_GROUPS": "0"}, ["-n", "2"], r"^error: MINIDIST_GROUPS=0 must be >= 2"),
    ({"MINIDIST_GROUP_BYTES": "1000"}, ["-n", "2"],
     r"^error: MINIDIST_GROUP_BYTES=1000 is too small: the world group of 2 ranks needs")],
    ids=["-n 100000", "timeout", "groups", "group bytes"])
def test_run_refuses_what_cannot_start_in_one_line_before_any_rank(tmp_path, monkeypatch,
                                                                   env, args, says):
    """Too many ranks (too many open files), or MINIDIST_* variables the launcher cannot
    use: one `error:` line, exit 2, no traceback (README promises one launcher line)."""
    import re
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    res = _run(tmp_path, *args)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.count("\n") == 1 and re.search(says, res.stderr), res.stderr
