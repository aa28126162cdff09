"""The torch.distributed-shaped API: isend/irecv pair up in program order and their Work
waits; init_process_group joins the running job (or refuses, in one clear line, when its
arguments disagree); destroy_process_group leaves it without breaking the launcher's exit;
and a torch-style script runs unchanged under `python -m minidist run` and mpiexec."""

import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import minidist
from minidist.runtime import RankFailure, spawn
from tests.helpers import mpiexec_or_skip

ROOT = Path(__file__).resolve().parent.parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
BIG = 3 * (1 << 20) // 8          # 3 MiB of float64: more than a mailbox holds (4 x 512 KiB)


def test_the_new_names_are_exported_at_top_level():
    for name in ("send", "recv", "isend", "irecv", "init_process_group",
                 "destroy_process_group", "is_initialized", "get_backend"):
        assert name in minidist.__all__ and callable(getattr(minidist, name)), name


def _exchange(ctx, n):
    """Rank 0: isend then irecv; rank 1: irecv then isend (the order they must pair in)."""
    peer = 1 - ctx.rank
    mine, theirs = np.full(n, float(ctx.rank + 1)), np.empty(n)
    if ctx.rank == 0:
        works = [minidist.isend(mine, peer, tag=5), minidist.irecv(theirs, peer, tag=6)]
    else:
        works = [minidist.irecv(theirs, peer, tag=5), minidist.isend(mine, peer, tag=6)]
    results = [w.wait() for w in works]
    assert all(w.is_completed() for w in works)
    got = results[1] if ctx.rank == 0 else results[0]       # irecv's wait() gives out
    sent = results[0] if ctx.rank == 0 else results[1]      # isend's gives None
    assert got is theirs and sent is None
    return float(theirs.min()), float(theirs.max())


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [1, BIG])
def test_isend_irecv_pair_up_in_program_order(n):
    assert spawn(2, _exchange, n) == [(2.0, 2.0), (1.0, 1.0)]


def _both_isend_first(ctx):
    peer = 1 - ctx.rank
    out = np.empty(BIG)
    w1 = minidist.isend(np.ones(BIG), peer)
    w2 = minidist.irecv(out, peer)
    w1.wait(), w2.wait()


@pytest.mark.slow                  # wall-clock: reported in < 10 s
@pytest.mark.multiproc
def test_both_ranks_sending_first_is_a_mismatch_not_a_hang():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(2, _both_isend_first, collective_timeout=20)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "CollectiveMismatch" in text and "send #1" in text, text


def _recv_any_source(ctx):
    with pytest.raises(ValueError, match=r"src=None .*Pass src="):
        minidist.recv(np.empty(1))
    with pytest.raises(ValueError, match=r"src=None"):
        minidist.irecv(np.empty(1), None)
    return True


@pytest.mark.multiproc
def test_recv_from_any_source_is_refused_in_one_clear_error():
    assert spawn(2, _recv_any_source) == [True, True]


def _lifecycle(ctx):
    assert minidist.is_initialized()                       # a launched rank is in the job
    minidist.init_process_group(backend="shm", world_size=2, rank=ctx.rank,
                                timeout=datetime.timedelta(seconds=7))
    minidist.init_process_group()                           # again, agreeing: a no-op
    assert minidist.get_backend() == "shm" == minidist.get_backend(ctx.world)
    assert ctx.world.timeout == 7.0 and ctx.new_group([0, 1]).timeout == 7.0
    errors = []
    for kwargs in (dict(backend="gloo"), dict(backend="mpi"), dict(world_size=3),
                   dict(rank=1 - ctx.rank), dict(init_method="tcp://10.0.0.1:23456"),
                   dict(timeout=0)):
        with pytest.raises(ValueError) as info:
            minidist.init_process_group(**kwargs)
        errors.append(str(info.value))
    with pytest.raises(ValueError, match="no group"):
        minidist.destroy_process_group(ctx.world)
    before = minidist.all_reduce(np.array([1.0]), async_op=True)
    minidist.destroy_process_group()                        # waits for `before` first
    assert before.is_completed() and not minidist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        minidist.all_reduce(np.ones(1))
    with pytest.raises(RuntimeError, match="not initialised"):
        minidist.get_backend()
    minidist.init_process_group()                           # rejoins the same job
    assert minidist.get_rank() == ctx.rank and minidist.get_world_size() == 2
    return errors, float(minidist.all_reduce(np.array([2.0]))[0])


@pytest.mark.multiproc
def test_init_and_destroy_process_group_in_a_launched_rank():
    for errors, total in spawn(2, _lifecycle):              # the exit barrier still ran
        assert total == 4.0
        gloo, mpi, size, rank, method, timeout = errors
        assert "backend='gloo' is not a minidist backend" in gloo and "'shm'" in gloo
        assert "was not started by mpiexec" in mpi
        assert "world_size=3" in size and "of a shared-memory job of 2 ranks" in size
        assert "run -n 3" in size
        assert "rank=" in rank and "Pass rank=-1" in rank
        assert "no rendezvous" in method and "timeout=0" in timeout
        assert all("\n" not in e for e in errors)


PLAIN = """
    import numpy as np
    import minidist
    assert not minidist.is_initialized()
    try:
        minidist.init_process_group(world_size=2)
    except ValueError as e:
        print("refused:", e)
    assert not minidist.is_initialized()                # a refused call leaves no job
    minidist.init_process_group("shm")
    print("one rank:", minidist.get_world_size(), minidist.all_reduce(np.ones(2)).tolist())
    minidist.destroy_process_group()
    print("after destroy:", minidist.is_initialized())
"""


def test_a_plain_process_becomes_a_one_rank_job():
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(PLAIN)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env=ENV)
    assert res.returncode == 0, res.stderr
    refused, one, after = res.stdout.splitlines()
    assert "world_size=2" in refused and "one-rank job" in refused and "run -n 2" in refused
    assert (one, after) == ("one rank: 1 [1.0, 1.0]", "after destroy: False")


TORCH_STYLE = """
    import sys
    import numpy as np
    import minidist as dist

    dist.init_process_group(backend=sys.argv[1])
    rank, world = dist.get_rank(), dist.get_world_size()
    total = dist.all_reduce(np.full(3, float(rank + 1)))     # torch: in place; here returned
    dist.barrier()
    pair = dist.new_group([0, 1])           # every rank calls it; ranks 0 and 1 get the group
    token = np.zeros(1)                     # p2p on a group of just the two (README)
    if rank == 0:
        dist.send(np.array([41.0]), dst=1, group=pair)
        dist.recv(token, src=1, group=pair)
    elif rank == 1:
        dist.recv(token, src=0, group=pair)
        dist.isend(token + 1, dst=0, group=pair).wait()
    sys.stdout.write(f"rank {rank} of {world} backend {dist.get_backend()}: "
                     f"sum {total.tolist()} token {token[0]:.0f}\\n")   # one write: mpiexec
    sys.stdout.flush()                                      # forwards lines whole
    dist.destroy_process_group()
    assert not dist.is_initialized()
"""


def _check_torch_style(stdout: str, W: int, backend: str, tag: bool) -> None:
    lines = sorted(stdout.splitlines())
    total = float(W * (W + 1) // 2)
    assert lines == [(f"[rank{r}]:" if tag else "") + f"rank {r} of {W} backend {backend}: "
                     f"sum {[total] * 3} token {[42, 41, 0][r]}" for r in range(W)]


@pytest.mark.multiproc
@pytest.mark.parametrize("W", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_torch_style_script_runs_under_minidist_run(tmp_path, W):
    script = tmp_path / "torch_style.py"
    script.write_text(textwrap.dedent(TORCH_STYLE))
    res = subprocess.run([sys.executable, "-m", "minidist", "run", "-n", str(W), str(script),
                          "shm"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
    assert res.returncode == 0, res.stderr
    _check_torch_style(res.stdout, W, "shm", tag=True)


@pytest.mark.slow                  # mpiexec (~0.5 s): the default run has test_mpi.py's
@pytest.mark.mpi
@pytest.mark.parametrize("W", [2, 3])
def test_the_same_script_runs_under_mpiexec(tmp_path, W):
    mpiexec = mpiexec_or_skip()
    script = tmp_path / "torch_style.py"
    script.write_text(textwrap.dedent(TORCH_STYLE))
    res = subprocess.run([mpiexec, "-n", str(W), sys.executable, str(script), "mpi"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert res.returncode == 0, res.stdout + res.stderr
    _check_torch_style(res.stdout, W, "mpi", tag=False)


@pytest.mark.slow
@pytest.mark.mpi
def test_under_mpiexec_the_shm_backend_is_refused(tmp_path):
    mpiexec = mpiexec_or_skip()
    script = tmp_path / "wrong_backend.py"
    script.write_text(textwrap.dedent("""
        import minidist
        try:
            minidist.init_process_group("shm")
        except ValueError as e:
            print(e)
    """))
    res = subprocess.run([mpiexec, "-n", "1", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert res.returncode == 0, res.stderr
    assert "backend='shm', but this process was started by mpiexec" in res.stdout


def test_torchrun_variables_in_a_plain_process_are_refused_by_name(tmp_path):
    """RANK=0 WORLD_SIZE=2 python x.py: no launcher to join; it said nothing and failed
    later. Now init() says what to start instead."""
    import subprocess
    import sys
    script = tmp_path / "x.py"
    script.write_text("import minidist\nminidist.init()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"})
    assert run.returncode == 1
    assert "WORLD_SIZE=2 (and RANK=0) ask for a job of several ranks" in run.stderr
    assert "python -m minidist run -n 2 SCRIPT" in run.stderr
