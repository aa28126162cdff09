"""Every test is checked for leaks: no child process and no new /dev/shm entry of its own
after it."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time

# One BLAS thread in the test process too (ranks pin theirs in runtime/launch.py); set
# before anything imports NumPy, which reads these once when it loads its BLAS.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# Placement checks on in every test (parallel/placement.py reads this when imported); a
# test that measures bytes turns them off in its Plan, as their digests are traffic too.
os.environ.setdefault("MINIDIST_CHECK_PLACEMENTS", "1")

# `train` runs write a run directory (observe/run_dir.py), by default under ./runs: the tests'
# go to a temporary folder instead (their subprocesses inherit it), removed at the end.
_RUNS = tempfile.mkdtemp(prefix="minidist-test-runs-")
os.environ["MINIDIST_RUN_DIR"] = _RUNS
atexit.register(shutil.rmtree, _RUNS, ignore_errors=True)   # also when no test ran

import pytest  # noqa: E402

from tests.helpers import child_pids, shm_entries  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# /dev/shm names this test's own stack can create: multiprocess's semaphores and shared
# memory, and, in a test that runs mpiexec (marked mpi), MPICH's segments. The runtime's
# own arena is anonymous memory and never appears there. Anything else is another job's (a
# leak check counts only what the test itself created).
OURS = ("sem.mp-", "mp-", "psm_")
MPI_OURS = ("mpich_shm_", "mpi_")


@pytest.fixture(autouse=True, scope="session")
def run_dirs_removed():
    yield
    shutil.rmtree(_RUNS, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(request):
    ours = OURS + (MPI_OURS if request.node.get_closest_marker("mpi") else ())
    before_shm = shm_entries()
    before_kids = set(child_pids())
    yield
    deadline = time.monotonic() + 2.0
    while True:
        new_kids = set(child_pids()) - before_kids
        if not new_kids or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    new_shm = {e for e in shm_entries() - before_shm if e.startswith(ours)}
    assert not new_kids, f"test left child processes behind: {sorted(new_kids)}"
    assert not new_shm, f"test left shared-memory segments behind: {sorted(new_shm)}"
