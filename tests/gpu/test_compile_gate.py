"""The compile gate: every kernel of gpu/kernels/ compiles for sm_90 with nvcc, spills nothing,
and uses the registers and shared memory gpu/kernels/resources.json records. The gate is shown
to fail where it must: on a spill (a kernel starved of registers) and on a broken kernel.

Default set: the ptxas parsing, the table and drift checks (no nvcc needed). Slow: every test
that runs nvcc (compiling all kernels takes ~12 s; the spill and broken-kernel files ~1 s)."""

import json

import pytest

from minidist.gpu import compile_gate as gate
from minidist.gpu.emulate.source import read_kernels

needs_nvcc = pytest.mark.skipif(gate.nvcc() is None, reason="nvcc not found (no CUDA toolkit "
                                "on PATH or in /usr/local/cuda): nothing can compile for sm_90")
REGENERATE = "python -m minidist.gpu.compile_gate --update"

# ptxas -v output as nvcc 13 prints it: one kernel with smem, one without (no "bytes smem").
PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'tiled' for 'sm_90'
ptxas info    : Function properties for tiled
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 8192 bytes smem, 380 bytes cmem[0]
ptxas info    : Compile time = 3.2 ms
ptxas info    : Compiling entry function 'plain' for 'sm_90'
ptxas info    : Function properties for plain
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 22 registers, used 0 barriers, 372 bytes cmem[0]
"""


def test_parse_ptxas_reads_registers_smem_stack_and_spills():
    got = gate.parse_ptxas(PTXAS, "k.cu")
    assert got == {"tiled": gate.Resources("k.cu", 40, 8192, 16, 8, 12),
                   "plain": gate.Resources("k.cu", 22, 0, 0, 0, 0)}


def test_checked_in_table_lists_every_kernel_of_every_file():
    table = json.loads(gate.TABLE.read_text())
    listed = {name: row["file"] for name, row in table["kernels"].items()}
    declared = {name: path.name for path in gate.kernel_files() for name in read_kernels(path)}
    assert listed == declared, (f"resources.json is stale: declared only "
                                f"{sorted(set(declared) - set(listed))}, listed only "
                                f"{sorted(set(listed) - set(declared))}; regenerate it with "
                                f"{REGENERATE}")


def test_drift_from_the_table_is_a_problem_that_names_the_fix():
    res = gate.FileResult("k.cu", gate.parse_ptxas(PTXAS, "k.cu"))
    table = gate.table([res], "13.0.88")
    table["kernels"]["plain"]["registers"] = 20                    # the table says 20, not 22
    table["kernels"]["gone"] = dict(table["kernels"]["plain"])
    found = gate.problems([gate.FileResult("k.cu", {"plain": res.kernels["plain"]})], table,
                          "13.0.88")
    assert any("plain (k.cu): registers 20 -> 22" in p and REGENERATE in p for p in found), found
    assert any("kernel gone is gone" in p for p in found), found
    assert any("kernel tiled is gone" in p for p in found), found
    assert gate.problems([res], gate.table([res], "13.0.88"), "13.0.88") == [
        p for p in gate.problems([res], None, "") if "spills" in p]  # only tiled's spill left
    assert gate.problems([res], table, "12.4.131") == gate.problems([res], None, "")  # other nvcc


@pytest.fixture(scope="module")
def compiled():
    return gate.compile_all(gate.kernel_files())


@pytest.mark.slow
@needs_nvcc
def test_every_kernel_compiles_for_sm90_without_spills(compiled):
    found = gate.problems(compiled, None, gate.nvcc_version())
    assert not found, "\n".join(found)
    for res in compiled:                                  # ptxas reported every kernel
        assert set(res.kernels) == set(read_kernels(gate.KERNELS / res.file)), res.file


@pytest.mark.slow
@needs_nvcc
def test_registers_and_smem_match_the_checked_in_table(compiled):
    table = json.loads(gate.TABLE.read_text())
    if table["nvcc"] != gate.nvcc_version():
        pytest.skip(f"resources.json was made with nvcc {table['nvcc']}, this is "
                    f"{gate.nvcc_version()}: register counts differ between releases")
    found = gate.problems(compiled, table, gate.nvcc_version())
    assert not found, "\n".join(found)


@pytest.mark.slow
@needs_nvcc
def test_the_gate_fails_on_a_spill():
    # 8 x 8 accumulators and 16 operands cannot live in 32 registers: ptxas must spill.
    res = gate.compile_file(gate.KERNELS / "sgemm_5_blocktile_2d.cu",
                            extra=("-maxrregcount=32",))
    big = res.kernels["sgemm_2d_128x128x8_8x8"]
    assert big.registers <= 32 and big.spill_stores > 0 and big.spill_loads > 0, big
    found = gate.problems([res], None, gate.nvcc_version())
    assert any(p.startswith("sgemm_2d_128x128x8_8x8 (sgemm_5_blocktile_2d.cu) spills")
               for p in found), found


@pytest.mark.slow
@needs_nvcc
def test_the_gate_fails_on_a_kernel_that_does_not_compile(tmp_path):
    source = (gate.KERNELS / "sgemm_1_naive.cu").read_text()
    broken = tmp_path / "broken.cu"
    broken.write_text(source.replace("acc += A[at64(row, K, k)]", "acc += A[at64(row, K, k)"))
    res = gate.compile_file(broken)
    assert res.kernels == {} and "error" in res.error and "nvcc" in res.error, res.error
    found = gate.problems([res], None, gate.nvcc_version())
    assert found and found[0].startswith("broken.cu does not compile for sm_90"), found


@pytest.mark.slow
@needs_nvcc
def test_cli_prints_the_table_and_ends_ok(compiled, capsys):
    rc = gate.main([])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, "\n".join(out)
    assert out[0].startswith(f"compile gate · nvcc {gate.nvcc_version()} · sm_90 · ")
    assert any(line.split()[:2] == ["sgemm_smem_32", "sgemm_3_smem.cu"] for line in out)
    assert out[-1] == ("OK: every kernel compiles for sm_90 without spills and matches "
                       "resources.json")


def test_nvrtc_compiles_every_kernel_for_sm90():
    errors, skipped = gate.nvrtc_errors(gate.kernel_files())
    if skipped:
        pytest.skip(skipped)
    assert not errors, "\n".join(errors)
