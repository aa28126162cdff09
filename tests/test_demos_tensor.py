"""The tensor- and sequence-parallel demos run as a user runs them and end with their OK line.
The default run keeps one run, demo 09 on tp=2 (sequence parallelism on top of tensor
parallelism, the cheapest); the other tp sizes, demo 08, the determinism checks and the
detailed printouts are in the slow set."""


import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
DEMOS = ["08_tensor_parallel.py", "09_sequence_parallel.py"]


# the same ids as two stacked parametrizes ("2-08_tensor_parallel.py"); one case by default
@pytest.mark.parametrize("tp, name", [
    pytest.param(tp, name, marks=() if (tp, name) == (2, DEMOS[1]) else pytest.mark.slow)
    for tp in (2, 3, 4) for name in DEMOS])
def test_demo_ends_with_ok(name, tp):
    rc, out = run_demo(name, "--tp", str(tp))
    assert rc == 0 and out[-1].startswith(f"OK: tp={tp} "), "\n".join(out)
    assert out[0].startswith(f"demo 0{name[1]} · ") and f"tp={tp}" in out[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", DEMOS)
def test_demo_output_is_deterministic(name):
    assert run_demo(name, "--steps", "2") == run_demo(name, "--steps", "2")


@pytest.mark.slow
def test_tensor_parallel_demo_shows_shards_flow_and_padded_vocabulary():
    rc, out = run_demo("08_tensor_parallel.py", "--tp", "3", "--steps", "1")
    assert rc == 0, "\n".join(out)
    text = "\n".join(out)
    assert "rank 1: columns q 16-31, k 64-79, v 112-127" in text        # fused qkv, C=48
    assert "rank 2: rows 8-10 + 1 padding (zeros)" in text               # wte, V=11 over 3
    assert "rank 2: token ids 8-10 + padding 11" in text
    assert "every piece is exactly its slice of the 1-process weight, padded with 0: True" in text
    assert text.count("g      (2, 12, 48)  Partial()   -> (2, 12, 48)  Replicate()") == 2 * 3
    assert sum(line.startswith("step ") for line in out) == 1


@pytest.mark.slow
def test_sequence_parallel_demo_shows_positions_and_summed_layernorm_grad():
    rc, out = run_demo("09_sequence_parallel.py", "--tp", "4", "--steps", "1")
    assert rc == 0, "\n".join(out)
    text = "\n".join(out)
    for r in range(4):
        assert f"rank {r}: the embedding's output (after its reduce-scatter) (2, 3, 48)" in text
        assert f"pos {3 * r}-{3 * r + 2}" in text
    lines = {line[:42].strip(): line[42:] for line in out if line.startswith("  ")}
    summed = lines["their sum over the tp ranks"]
    assert all(lines[f"rank {r}, .grad after f's all-reduce"] == summed for r in range(4))
    assert lines["1 process"] == summed
