"""The collectives benchmark: its conventions (sizes, busbw factors) against the formulas of
nccl-tests, its tables on a tiny sweep, its shared-memory mode, its calibration file, and the
MPI side when mpi4py is installed. The MPI side (~0.5 s under mpiexec) is in the slow set;
collectives/test_mpi.py runs the algorithms over MPI in the default run."""

import json

import pytest

from minidist.bench import collectives as bench
from minidist.bench.mpi_collectives import find_mpiexec, mpi_times
from minidist.collectives import cost

COLUMNS = ["size(B)", "count", "algo", "time(us)", "algbw", "busbw", "model(us)", "#wrong"]


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, 8])
def test_bus_factors_are_the_nccl_tests_formulas(W):
    expected = {"all_reduce": 2 * (W - 1) / W, "reduce_scatter": (W - 1) / W,
                "all_gather": (W - 1) / W, "all_to_all": (W - 1) / W, "gather": (W - 1) / W,
                "scatter": (W - 1) / W, "broadcast": 1.0, "reduce": 1.0}
    assert {op: bench.bus_factor(op, W) for op in bench.OPS} == expected


def test_sizes_and_counts_follow_the_size_convention():
    assert bench.sweep_sizes(8, 64 << 20, 8) == [8 * 8 ** k for k in range(8)] + [64 << 20]
    assert bench.sweep_sizes(8, 8, 4) == [8] and bench.sweep_sizes(8, 40, 4) == [8, 32, 40]
    assert [bench.parse_bytes(t) for t in ("8", "4K", "64M", "1G", "2MiB")] == \
        [8, 4096, 64 << 20, 1 << 30, 2 << 20]
    with pytest.raises(ValueError, match="byte count"):
        bench.parse_bytes("lots")
    # (elements of one rank's input, bytes in the size column)
    assert bench.counts("all_reduce", 64, 4, 4) == (16, 64)
    assert bench.counts("all_gather", 64, 4, 4) == (4, 64)          # size = W * input
    assert bench.counts("scatter", 8, 4, 4) == (1, 16)              # at least one element
    assert bench.counts("reduce_scatter", 40, 3, 4) == (9, 36)      # divisible by W
    assert bench.counts("all_to_all", 8, 4, 4) == (4, 16)


@pytest.mark.multiproc
def test_tiny_sweep_prints_a_table_per_op_with_the_expected_columns(capsys):
    argv = ["--world-sizes", "2", "--ops", "all_reduce,all_gather", "--max-bytes", "64",
            "--iters", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# command: python -m minidist bench collectives " + " ".join(argv)
    headers = [i for i, line in enumerate(out) if line.startswith("#    size(B)")]
    assert len(headers) == 2                                        # one table per op
    assert [c for c in out[headers[0]].split() if c != "#"] == COLUMNS
    rows, op_of_row = [], []
    for i, line in enumerate(out):
        if line[:1] == " " and line.split()[0].isdigit():
            rows.append(line.split())
            op_of_row.append("all_reduce" if i < headers[1] else "all_gather")   # table order
    algos = {r[2].split(":")[0] for r in rows}
    assert algos == {"auto", *cost.ALGOS["all_reduce"], *cost.ALGOS["all_gather"]}
    assert len(rows) == 2 * (1 + len(cost.ALGOS["all_reduce"])) + 2 * (1 + 2)  # sizes 8, 64
    for r, op in zip(rows, op_of_row):
        size, t, algbw, busbw, wrong = int(r[0]), float(r[3]), float(r[4]), float(r[5]), r[7]
        assert wrong == "0" and t > 0
        assert algbw == pytest.approx(size / t / 1e3, abs=6e-4)         # GB/s from B and us
        # both printed with 3 decimals: at most 5e-4 f + 5e-4 apart (f <= 1)
        assert busbw == pytest.approx(algbw * bench.bus_factor(op, 2), abs=1e-3 + 1e-12)


@pytest.mark.multiproc
def test_points_carry_busbw_from_the_formula_and_no_wrong_elements():
    ops = tuple(bench.OPS)
    plan = bench.Plan(ops, {op: ("auto", *cost.ALGOS[op]) for op in ops}, (8, 100), "float32",
                      2, False)
    points = bench.run(3, plan)
    assert {(p.op, p.algo) for p in points} == {(op, a) for op in ops for a in plan.algos[op]}
    for p in points:
        assert p.wrong == 0, p
        assert p.busbw == pytest.approx(p.size / p.seconds / 1e9 * bench.bus_factor(p.op, 3))
        assert p.ran in cost.ALGOS[p.op]


@pytest.mark.multiproc
def test_shared_mode_adds_the_zero_copy_direct_path_and_stays_correct():
    plan = bench.Plan(("all_reduce",), {"all_reduce": ("direct", bench.SHM_ALGO)}, (4, 1000),
                      "float64", 2, True)
    points = bench.run(3, plan)
    assert [(p.algo, p.size, p.wrong) for p in points] == [
        ("direct", 8, 0), (bench.SHM_ALGO, 8, 0), ("direct", 1000, 0), (bench.SHM_ALGO, 1000, 0)]


@pytest.mark.multiproc
def test_calibrate_times_every_algorithm_and_writes_the_file_auto_reads(tmp_path, capsys,
                                                                        monkeypatch):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("MINIDIST_COST_FILE", str(path))
    table = bench.calibrate([1, 2], [8, 64, 512, 4096], 2, str(path), passes=1)
    assert [w for w, _ in table.sets] == [2]                     # W = 1 sends nothing: skipped
    raw = json.loads(path.read_text())
    assert raw["version"] == 2 and set(raw["constants"]) == {"2"} and raw["fit"]["2"]["points"]
    assert cost.load_table(path) == table and cost.constants(2) == table.at(2)   # what auto uses
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:2] == "  "]
    assert {(r[0], r[1]) for r in rows} == {(op, a) for op in bench.OPS for a in cost.ALGOS[op]}
    for r in rows:                     # measured, model (0.1 us) and their ratio (0.01) printed
        t, m, ratio = float(r[3]), float(r[4]), float(r[5])
        assert ratio == pytest.approx(m / t, abs=0.005 + m / t * (0.05 / t + 0.05 / m) + 1e-9)
    assert "# fitted W=2: call" in out and "# W=2: worst model/measured" in out
    with pytest.raises(ValueError, match="at least 3 sizes"):
        bench.calibrate([2], [8, 64], 2, str(path))
    with pytest.raises(ValueError, match="world size > 1"):
        bench.calibrate([1], [8, 64, 512], 2, str(path))


@pytest.mark.multiproc
def test_header_says_defaults_or_which_calibration(tmp_path, capsys, monkeypatch):
    path = tmp_path / "cost.json"
    monkeypatch.setenv("MINIDIST_COST_FILE", str(path))          # main() sets it: undone after
    argv = ["--world-sizes", "2", "--max-bytes", "8", "--iters", "1", "--algos", "ring",
            "--cost-file", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert f"# cost model: defaults (no calibration file at {path})\n" in out
    assert "# model/measured, worst per algorithm: ring " in out
    cost.save(cost.Table(((2, cost.DEFAULT), (4, cost.DEFAULT)), fitted="2025-01-02 03:04"),
              path)
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert f"# cost model: calibrated {path} (2025-01-02 03:04, W = 2, 4 fitted)\n" in out
    assert "#   W=4: call 10.00 us, alpha 10.00 us" in out
    path.write_text('{"alpha": 1}')              # broken: one error line before the header
    assert bench.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: calibration file {path} is not valid")
    assert err.count("\n") == 1


def test_bad_arguments_are_refused(capsys):
    for argv in (["--world-sizes", "9"], ["--ops", "all_reduce,shuffle"],
                 ["--algos", "quantum"], ["--max-bytes", "big"], ["--dtype", "bool"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert "world sizes must be 1..8" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(find_mpiexec() is None, reason="needs mpiexec")
def test_mpi_side_runs_every_op_correctly():
    pytest.importorskip("mpi4py")
    plan = bench.Plan(bench.OPS, {}, (8, 256), "float32", 2, False)
    got = mpi_times(2, plan, timeout=60)
    assert isinstance(got, dict), got
    assert {op for op, _ in got} == set(bench.OPS)
    for (op, size), (seconds, wrong) in got.items():
        assert wrong == 0 and seconds > 0, (op, size)


def test_without_mpi_the_table_says_why(monkeypatch):
    from minidist.bench import mpi_collectives
    monkeypatch.setattr(mpi_collectives, "find_mpiexec", lambda: None)
    plan = bench.Plan(("all_reduce",), {"all_reduce": ("ring",)}, (8,), "float32", 1, False)
    note = mpi_collectives.mpi_times(2, plan)
    assert note.startswith("MPI skipped: mpi4py or mpiexec is not installed")
    point = bench.Point("all_reduce", 2, "ring", "ring", 8, 2, 1e-5, 0, 8)
    table = bench.format_table([point], note, "float32")
    assert "mpi(us)" not in table and table.endswith("# " + note)
