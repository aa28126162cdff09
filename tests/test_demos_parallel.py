"""The parallel-layout demos run as a user runs them and end with their OK line.
The default run keeps the cheapest test, demo 06's plain run; demo 07 (ZeRO), the
determinism checks and the 3-rank accumulation run are in the slow set."""


import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
DEMOS = ["06_data_parallel.py", "07_zero.py"]


@pytest.mark.parametrize("name", [DEMOS[0], pytest.param(DEMOS[1], marks=pytest.mark.slow)])
def test_demo_ends_with_ok(name):
    rc, out = run_demo(name)
    assert rc == 0 and out[-1].startswith("OK: "), "\n".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", DEMOS)
def test_demo_output_is_deterministic(name):
    assert run_demo(name, "--steps", "2") == run_demo(name, "--steps", "2")


@pytest.mark.slow
def test_data_parallel_demo_with_accumulation_ring_and_3_ranks():
    rc, out = run_demo("06_data_parallel.py", "--world-size", "3", "--micro-batches", "2",
                   "--global-batch", "12", "--algo", "ring", "--steps", "3")
    assert rc == 0, "\n".join(out)
    assert out[-1].startswith("OK: 3-rank loss curve = 1-process run's")
    assert sum(line.startswith("step ") for line in out) == 3
    assert out[2] == "rank 0 reads rows 0-3 of each global batch of 12 (rank 1: 4-7, rank 2: 8-11)"
