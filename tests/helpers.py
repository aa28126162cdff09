"""Helpers shared by the tests: comparisons that name what differs, and leak probes."""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest


def assert_close(actual, expected, *, atol: float = 0.0, rtol: float = 0.0, what: str = ""):
    """np.allclose with a message that names the worst element."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    err = np.abs(a.astype(np.float64) - e.astype(np.float64))
    bound = atol + rtol * np.abs(e.astype(np.float64))
    if not np.all(err <= bound):
        i = np.unravel_index(int(np.argmax(err - bound)), a.shape) if a.ndim else ()
        raise AssertionError(f"{what}: max |Δ| = {err.max():.3e} at {i} "
                             f"(got {a[i]!r}, expected {e[i]!r}; atol={atol}, rtol={rtol})")


DEMO_WIDTH = 100                # characters: the longest line a demo may print


def run_demo(name: str, *args: str, timeout: float = 110,
             cwd: str | os.PathLike | None = None) -> tuple[int, list[str]]:
    """Run demos/<name> as a user would, in `cwd` (default the checkout); return (exit code,
    output lines, stderr last), each checked to fit DEMO_WIDTH (assert_lines_fit).
    `timeout` is a hang guard under pytest-timeout's 120 s, not a speed check: a demo that
    takes 20 s on an idle machine takes several times that on a loaded one."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "demos", name), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or root)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert_lines_fit(lines, f"demos/{name} {' '.join(args)}".rstrip())
    return done.returncode, lines


def assert_lines_fit(lines: list[str], what: str, width: int = DEMO_WIDTH) -> None:
    """Every line a demo prints is at most `width` characters: a newcomer's terminal shows
    it whole, without wrapping. A user error is exempt: it is one `error:` line, however
    long (the project's convention for every command); and an absolute path counts as
    one character wide (it is as long as the machine's temporary folder makes it)."""
    long = [f"{len(line)}: {line!r}" for line in lines if not line.startswith("error: ")
            and len(re.sub(r"(?<![\w.])/[^\s,)]+", "/", line)) > width]
    assert not long, f"{what}: {len(long)} lines over {width} characters:\n" + "\n".join(long)


def child_pids(pid: int | None = None) -> list[int]:
    """PIDs whose parent is `pid` (this process by default), from /proc. Every test runs
    this twice (the leak check), so each stat file is read with one os.read: 1.2 ms a scan
    here, where open() and a text read took 3.9 ms."""
    pid = os.getpid() if pid is None else pid
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{entry}/stat", os.O_RDONLY)
            try:
                stat = os.read(fd, 1024)
            finally:
                os.close(fd)
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()       # the name may hold spaces and ')'
        if int(fields[1]) == pid and fields[0] != b"Z":
            kids.append(int(entry))
    return kids


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def mpiexec_or_skip() -> str:
    """Path of mpiexec (next to this Python first); skips the calling module without
    mpi4py or mpiexec. Call at module level in tests marked `mpi`."""
    import shutil
    import sys

    import pytest
    exe = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
           or shutil.which("mpiexec"))
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        exe = None
    if exe is None:
        pytest.skip("needs mpi4py and mpiexec (pip install -e '.[mpi]')", allow_module_level=True)
    return exe


def dist_gradcheck(fn, x, group, *, x_placement: str, loss_placement: str, what: str,
                   eps: float = 1e-6, atol: float = 1e-7, seed: int = 0):
    """Finite differences for an operation that runs over a group (call on every rank).

    The objective is L = sum(u * fn(x)) on each rank, u random (rank-dependent when the
    loss is "partial"); the GLOBAL objective is the sum of the ranks' L for "partial" and
    the (identical) L itself for "replicate". x is "replicate" (one tensor held by every
    rank: each finite difference perturbs every copy) or "shard" (each rank's own piece:
    perturbed one rank at a time). autograd's x.grad on each rank must equal the
    derivative of the global objective with respect to this rank's x.
    """
    from minidist import collectives as C
    from minidist.autograd import Tensor

    rank = group.rank
    x = np.array(x, dtype=np.float64)
    rng = np.random.default_rng(seed + (rank if loss_placement == "partial" else 0))
    xt = Tensor(x.copy(), requires_grad=True)
    y = fn(xt)
    u = rng.standard_normal(y.shape)
    (y * u).sum().backward()
    analytic = xt.grad

    def objective(values):
        local = float(np.sum(u * fn(Tensor(values)).data))
        if loss_placement == "partial":
            return float(C.all_reduce(np.array([local]), group=group, algo="direct")[0])
        return local

    numeric = np.zeros_like(x)
    owners = [None] if x_placement == "replicate" else range(group.size)
    for owner in owners:
        for k in range(x.size):
            mine = owner is None or owner == rank
            shifted = []
            for sign in (1, -1):
                values = x.copy()
                if mine:
                    values.reshape(-1)[k] += sign * eps
                shifted.append(objective(values))
            if mine:
                numeric.reshape(-1)[k] = (shifted[0] - shifted[1]) / (2 * eps)
    assert_close(analytic, numeric, atol=atol, rtol=1e-6, what=f"{what} (rank {rank})")
    return True


def assert_runs_match(runs, ref, what: str, atol: float = 1e-12) -> None:
    """Every rank's RankResult equals the single-process TrainResult `ref` within atol (loss
    and norm per step, lrs, every parameter, the gathered optimizer state), and the ranks'
    parameters are bitwise identical to each other: any drift between replicas would grow
    silently over a long run."""
    for rank, run in enumerate(runs):
        tag = f"{what}, rank {rank}"
        assert_close(run.losses, ref.losses, atol=atol, what=f"{tag}: loss per step")
        assert_close(run.grad_norms, ref.grad_norms, atol=atol, what=f"{tag}: grad norm")
        assert run.lrs == ref.lrs, f"{tag}: learning rates"
        assert run.params.keys() == ref.params.keys(), f"{tag}: parameter names"
        for name, p in ref.params.items():
            assert_close(run.params[name], p, atol=atol, what=f"{tag}: param {name}")
        assert run.optimizer_state.keys() == ref.optimizer_state.keys(), f"{tag}: state keys"
        assert len(run.routing_biases) == len(ref.routing_biases), f"{tag}: routing biases"
        for step, (mine, want) in enumerate(zip(run.routing_biases, ref.routing_biases)):
            for name, b in want.items():     # moves of +-gamma from integer loads: exact
                assert np.array_equal(mine[name], b), f"{tag}: {name} bias at step {step}"
        for key, s in ref.optimizer_state.items():
            assert_close(run.optimizer_state[key], s, atol=atol, what=f"{tag}: state {key}")
    for rank, run in enumerate(runs[1:], start=1):
        for name, p in runs[0].params.items():
            assert np.array_equal(run.params[name], p), f"{what}: rank {rank} drifted in {name}"


def configs(**kw):
    """(RunConfig, OptimizerConfig) from baseline.train_single_process's keywords, so that a
    test hands the single process and train_on_rank the same settings."""
    from minidist.optim import OptimizerConfig      # here, so that the tests of the lower
    from minidist.train import RunConfig            # layers import no training stack
    run_fields = {f.name for f in dataclasses.fields(RunConfig)}
    opt = {("name" if k == "optimizer" else k): v for k, v in kw.items() if k not in run_fields}
    return RunConfig(**{k: v for k, v in kw.items() if k in run_fields}), OptimizerConfig(**opt)


def value_errors(*calls) -> list[str]:
    """The message of each call that raises ValueError, in order (one that does not raise
    adds nothing, so a caller counting them sees it)."""
    errors = []
    for call in calls:
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def slow_unless_kept(cases: list, kept: list) -> list:
    """Parametrize cases with those not in `kept` marked slow: the default run keeps the
    representatives, `-m slow` runs the rest (the ids stay those of the plain tuples)."""
    return [c if c in kept else pytest.param(*c, marks=pytest.mark.slow) for c in cases]
