"""`python -m minidist run` behaves like torchrun where a script can tell: torchrun's
variables in every rank, each rank's lines tagged "[rank<r>]:" (or logged per rank, or
filtered), nothing a rank wrote lost when it fails or is killed, the launcher's report
unprefixed and last, -n 1 by default, and one-line usage errors.

Most tests start a `run` job (~0.4 s); the default run keeps the variables, the
tags, a killed rank's output, a closed stdout, and run_script in-process (which also covers
--log-dir and a filter); the rest runs under -m slow (the convention of one-line usage
errors is in test_cli.py's default set, --help's in its top-level --help test)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

pytestmark = pytest.mark.multiproc


def run(tmp_path, body: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m minidist run ARGS script.py`, where script.py is `body`; ARGS that
    follow "--" go to the script."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    ours, theirs = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args \
        else (args, ())
    return subprocess.run([sys.executable, "-m", "minidist", "run", *ours, str(script), *theirs],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=ENV)


ENV_SCRIPT = f"""
    import os
    import minidist
    ctx = minidist.init()            # the variables are there before init, too
    names = {TORCHRUN_VARS!r}
    print(" ".join(f"{{n}}={{os.environ[n]}}" for n in names))
    assert int(os.environ["RANK"]) == ctx.rank and int(os.environ["WORLD_SIZE"]) == ctx.world_size
    os.system("echo child sees RANK=$RANK")      # a child process of the rank inherits them
"""


def test_each_rank_gets_torchruns_variables(tmp_path):
    assert not set(TORCHRUN_VARS) & set(ENV), "the test's own environment must not set them"
    res = run(tmp_path, ENV_SCRIPT, "-n", "3")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for r in range(3):
        want = (f"[rank{r}]:RANK={r} WORLD_SIZE=3 LOCAL_RANK={r} LOCAL_WORLD_SIZE=3 GROUP_RANK=0 "
                f"ROLE_RANK={r} ROLE_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500")
        assert want in lines, res.stdout
        assert f"[rank{r}]:child sees RANK={r}" in lines, res.stdout


@pytest.mark.slow
def test_n_defaults_to_one_rank(tmp_path):
    res = run(tmp_path, ENV_SCRIPT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith("[rank0]:RANK=0 WORLD_SIZE=1 "), res.stdout
    assert "[rank1]" not in res.stdout


TALKER = """
    import os, sys
    import minidist
    ctx = minidist.init()
    r = ctx.rank
    for i in range(200):
        sys.stdout.write(f"r{r} line {i} ")        # a line written in two pieces
        sys.stdout.flush()
        sys.stdout.write("end\\n")
    os.write(1, f"r{r} straight to fd 1\\n".encode())   # as a C extension would
    print(f"r{r} warning", file=sys.stderr)
    ctx.world.barrier()
    sys.stdout.write(f"r{r} no newline at the end")
"""


def _by_rank(lines: list[str], W: int) -> list[list[str]]:
    """Each rank's lines, tag removed, in the order they came; every line must be tagged."""
    out = [[] for _ in range(W)]
    for line in lines:
        tag, sep, rest = line.partition("]:")
        assert sep and tag.startswith("[rank"), f"untagged line {line!r}"
        out[int(tag[len("[rank"):])].append(rest)
    return out


def test_every_line_is_tagged_with_its_rank_and_keeps_its_order(tmp_path):
    res = run(tmp_path, TALKER, "-n", "2")
    assert res.returncode == 0, res.stderr
    for r, lines in enumerate(_by_rank(res.stdout.splitlines(), 2)):
        assert lines == ([f"r{r} line {i} end" for i in range(200)]
                         + [f"r{r} straight to fd 1", f"r{r} no newline at the end"])
    assert _by_rank(res.stderr.splitlines(), 2) == [["r0 warning"], ["r1 warning"]]


@pytest.mark.slow
def test_no_prefix_passes_lines_through_untagged(tmp_path):
    res = run(tmp_path, TALKER, "-n", "2", "--no-prefix")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 404 and "[rank" not in res.stdout
    for r in range(2):                     # whole lines, in each rank's order
        mine = [line for line in lines if line.startswith(f"r{r} ")]
        assert mine[:200] == [f"r{r} line {i} end" for i in range(200)]
    assert sorted(res.stderr.splitlines()) == ["r0 warning", "r1 warning"]


@pytest.mark.slow
def test_log_dir_holds_each_ranks_lines_untagged(tmp_path):
    logs = tmp_path / "logs" / "run1"                    # created, parents too
    res = run(tmp_path, TALKER, "-n", "2", "--log-dir", str(logs))
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(logs)) == ["rank0.log", "rank1.log"]
    for r in range(2):
        lines = (logs / f"rank{r}.log").read_text().splitlines()
        assert [x for x in lines if " line " in x] == [f"r{r} line {i} end" for i in range(200)]
        assert {f"r{r} straight to fd 1", f"r{r} warning"} <= set(lines)    # stdout and stderr
        assert lines[-1] == f"r{r} no newline at the end" and "[rank" not in "".join(lines)


@pytest.mark.slow
def test_the_filter_shows_some_ranks_and_the_log_files_still_get_all(tmp_path):
    res = run(tmp_path, TALKER, "-n", "3", "--local-ranks-filter", "0,2", "--log-dir",
              str(tmp_path / "logs"))
    assert res.returncode == 0, res.stderr
    shown = _by_rank(res.stdout.splitlines(), 3)
    assert shown[1] == [] and len(shown[0]) == len(shown[2]) == 202
    assert _by_rank(res.stderr.splitlines(), 3) == [["r0 warning"], [], ["r2 warning"]]
    assert "r1 warning" in (tmp_path / "logs" / "rank1.log").read_text()


FAILS = """
    import os, signal, sys
    import minidist
    ctx = minidist.init()
    if ctx.rank == 1:
        print("rank 1 warns first", file=sys.stderr)
        sys.stdout.write("last words, no newline")     # still in the rank's buffer
        if "--kill" in sys.argv:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("boom on rank 1")
    ctx.world.barrier()
"""


@pytest.mark.parametrize("how", [pytest.param("raise", marks=pytest.mark.slow), "kill"])
def test_a_failing_ranks_output_is_kept_and_the_report_comes_last_unprefixed(tmp_path, how):
    res = run(tmp_path, FAILS, "-n", "2", *(["--", "--kill"] if how == "kill" else []))
    assert res.returncode == 1
    assert res.stdout.splitlines() == ["[rank1]:last words, no newline"]
    err = res.stderr.splitlines()
    assert err[0] == "[rank1]:rank 1 warns first", res.stderr
    assert err[1].startswith("minidist run: rank 1 of 2 failed"), res.stderr
    assert not any(line.startswith("[rank") for line in err[1:]), res.stderr
    assert ("RuntimeError: boom on rank 1" if how == "raise" else "killed by SIGKILL") \
        in res.stderr


def test_run_script_returns_with_no_rank_and_no_reader_thread_left(tmp_path, capfd):
    from minidist.runtime.launch import run_script
    from tests.helpers import child_pids
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(FAILS))
    code = run_script(2, str(script), [], log_dir=str(tmp_path / "logs"), show={1})
    assert code == 1 and child_pids() == []
    assert not [t for t in threading.enumerate() if t.name == "minidist-rank-output"]
    out, err = capfd.readouterr()
    assert out == "[rank1]:last words, no newline\n"
    assert err.startswith("[rank1]:rank 1 warns first\nminidist run: rank 1 of 2 failed")
    assert (tmp_path / "logs" / "rank1.log").read_text() == \
        "rank 1 warns first\nlast words, no newline\n"


@pytest.mark.slow                  # wall-clock: took < 10 s
def test_a_child_left_running_does_not_keep_the_launcher_waiting(tmp_path):
    body = """
        import subprocess, sys
        import minidist
        minidist.init()
        child = subprocess.Popen(["sleep", "30"])      # inherits the rank's stdout pipe
        print(child.pid)
    """
    start = time.monotonic()
    res = run(tmp_path, body)
    took = time.monotonic() - start
    pid = int(res.stdout.split(":")[1])
    os.kill(pid, signal.SIGKILL)                        # leave nothing behind
    assert res.returncode == 0 and took < 10, (took, res.stderr)


def test_a_closed_stdout_ends_the_run_quietly_with_141(tmp_path):
    script = tmp_path / "forever.py"
    script.write_text(textwrap.dedent("""
        import itertools
        import minidist
        minidist.init()
        for i in itertools.count():
            print("line", i)
    """))
    proc = subprocess.Popen([sys.executable, "-m", "minidist", "run", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=ENV)
    first = [proc.stdout.readline() for _ in range(3)]        # `| head -3`
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert all(line.startswith("[rank") for line in first), first
    assert proc.returncode == 128 + signal.SIGPIPE and err == "", err


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--local-ranks-filter", "2", "-n", "2"], ["--local-ranks-filter", "rank 2", "0..1"]),
    (["--local-ranks-filter", "0,x"], ["--local-ranks-filter", "'0,x'"]),
    (["-n", "0"], ["-n", ">= 1"]),
    (["--log-dir", "FILE"], ["--log-dir", "is a file"]),
])
def test_a_usage_error_is_one_line_with_exit_code_2(tmp_path, args, words):
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    res = run(tmp_path, "print('never runs')", *args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert res.stdout == ""


@pytest.mark.slow
def test_help_lists_the_torchrun_options_on_stdout():
    res = subprocess.run([sys.executable, "-m", "minidist", "run", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
    assert res.returncode == 0 and res.stderr == ""
    for option in ("--nproc-per-node", "default: 1", "--no-prefix", "--log-dir",
                   "--local-ranks-filter", "MASTER_PORT"):
        assert option in res.stdout, option
