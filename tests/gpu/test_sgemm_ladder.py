"""The SGEMM ladder and the hierarchy kernels on the CPU emulator, against NumPy in float64.

Every instantiation of every rung (two or more block sizes each) computes C = alpha A @ B +
beta C within 1e-4 (max |error| / max |C|) of the float64 product, at 3-5 shapes, most of
them no multiple of any tile; the float4 rungs refuse the shapes they cannot load; under
AddressSanitizer and ThreadSanitizer the rungs stay in bounds and race nowhere. The pointer
chase ends where a Python walk of the same cycle ends; the bandwidth kernels read and copy
exactly what their NumPy references do.

Default set: three rungs at one shape each (the naive rung 1, the 2D block tile of rung 5 at
a shape far smaller than its tile, the warp tiles and float4 loads of rung 7 at a shape that
overhangs every tile), the pointer chase (one more library) and the checks that build
nothing. Slow: the other instantiations and shapes, both sanitizer runs, and the bandwidth
and at64 tests (each builds one more library, ~0.6 s)."""

import re

import numpy as np
import pytest

from minidist.gpu import hierarchy as h
from minidist.gpu.emulate.build import compiler_missing
from minidist.gpu.emulate.source import KERNELS_DIR, read_kernels

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=f"the CPU emulator cannot build: {compiler_missing()}")
SHAPES = [(37, 44, 28), (64, 64, 64), (130, 20, 12)]    # (M, N, K); K, N multiples of 4
ODD = [(33, 47, 29), (1, 5, 3)]                         # odd K and N: rungs 1-5 only
ALPHA, BETA, TOL = 1.5, -0.5, 1e-4


@pytest.fixture(scope="module")
def emu():
    from minidist.gpu.emulate.build import build_many
    from minidist.gpu.emulate.runner import Emulator
    build_many(sorted({r.file for r in h.EMULATED}))  # the 7 libraries, in parallel, once
    return Emulator()


def _case(M: int, N: int, K: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    A, B, C = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (K, N), (M, N)))
    ref = ALPHA * (A.astype(np.float64) @ B.astype(np.float64)) + BETA * C.astype(np.float64)
    return A, B, C, ref


CASES = [(r, s) for r in h.EMULATED for s in SHAPES + ([] if r.vector else ODD)]
# Default set: a couple of rungs, cheap shapes (rungs 1, 5 and 7); the rest are slow.
DEFAULT_CASES = {("sgemm_naive", (16, 16), (33, 47, 29)),
                 ("sgemm_2d_128x128x8_8x8", (256,), (1, 5, 3)),
                 ("sgemm_warp_64x64x8_32x32_2_4x4", (128,), (37, 44, 28))}


@pytest.mark.parametrize("rung,shape", [
    pytest.param(r, s, id=f"{r.kernel}-{r.block}-{'x'.join(map(str, s))}",
                 marks=() if (r.kernel, r.block, s) in DEFAULT_CASES else pytest.mark.slow)
    for r, s in CASES])
def test_rung_matches_numpy_float64(emu, rung, shape):
    M, N, K = shape
    A, B, C, ref = _case(M, N, K)
    got = h.run_emulated(emu, rung, A, B, C, ALPHA, BETA)
    err = h.relative_error(got, ref)
    assert err <= TOL, f"{rung.kernel} block {rung.block} at {shape}: relative error {err:.2e}"


# Run in a fresh interpreter with the sanitizer runtime preloaded (emulate/sanitize.py).
# AddressSanitizer: every instantiation at a shape with overhanging tiles (a missing bounds
# guard reads past A, B or C). ThreadSanitizer: the smallest block of each rung with shared
# memory (3-7); a missing __syncthreads is a race on As / Bs.
SANITIZED = """
import numpy as np

from minidist.gpu import hierarchy as h
from minidist.gpu.emulate.runner import Emulator
emu = Emulator({variant!r})
rungs = h.EMULATED if {variant!r} == "address" else [
    r for r in h.EMULATED if r.step >= 3 and r.threads <= 64]
rng = np.random.default_rng(0)
A, B, C = (rng.standard_normal(s).astype(np.float32) for s in ((37, 28), (28, 44), (37, 44)))
ref = A.astype(np.float64) @ B.astype(np.float64) + C
for r in rungs:
    err = h.relative_error(h.run_emulated(emu, r, A, B, C, 1.0, 1.0), ref)
    assert err <= 1e-4, (r.kernel, err)
print("checked", len(rungs))
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["address", "thread"])
def test_ladder_is_in_bounds_and_race_free_under_the_sanitizers(variant):
    from minidist.gpu.emulate.build import sanitizer_missing
    from minidist.gpu.emulate.sanitize import run_python
    if sanitizer_missing(variant):
        pytest.skip(sanitizer_missing(variant))
    report = run_python(SANITIZED.format(variant=variant), variant)
    assert report.clean, f"{report.findings}\n{report.stderr[-3000:]}"
    assert report.stdout.startswith("checked "), report.stdout


@pytest.mark.parametrize("rung", [r for r in h.EMULATED if r.vector], ids=lambda r: r.kernel)
def test_vector_rungs_refuse_k_or_n_not_multiple_of_4(emu, rung):
    A, B, C, _ = _case(8, 6, 8)
    with pytest.raises(ValueError, match=r"K = 8 and N = 6 must both be multiples of 4"):
        h.run_emulated(emu, rung, A, B, C)


def test_ladder_covers_every_kernel_and_every_rung_has_two_emulated_blocks():
    assert [r.step for r in h.LADDER] == list(range(1, 8))
    for step in range(1, 8):
        blocks = {r.block + r.tile for r in h.EMULATED if r.step == step}
        assert len(blocks) >= 2, f"rung {step} is emulated at fewer than 2 block sizes"
    assert max(r.threads for r in h.EMULATED) <= 256
    files = {r.file for r in h.LADDER}
    declared = {k for f in files for k in read_kernels(f)}
    assert declared == {r.kernel for r in h.LADDER + h.EMULATED}, "a kernel no rung launches"


def test_global_loads_per_fma_fall_as_the_c_tile_grows():
    # No reuse: 2 loads per FMA. A rows x cols C tile loads a column of A's tile (rows values)
    # and a row of B's (cols values) per k and does rows * cols FMAs with them.
    assert [r.loads_per_fma for r in h.LADDER] == [2, 2, 1 / 16, 1 / 32, 1 / 64, 1 / 64, 1 / 64]


@pytest.mark.parametrize("M,N", [(1, 1), (37, 44), (130, 20), (256, 256)])
def test_grid_covers_c_with_no_spare_block_row_or_column(M, N):
    for r in h.LADDER + h.EMULATED:
        (gx, gy), _ = r.dims(M, N)
        rows, cols = (gx, gy) if r.step == 1 else (gy, gx)
        assert rows * r.tile[0] >= M > (rows - 1) * r.tile[0], (r.kernel, M, N)
        assert cols * r.tile[1] >= N > (cols - 1) * r.tile[1], (r.kernel, M, N)


def test_chase_cycle_is_one_cycle_through_every_slot():
    nxt = h.chase_cycle(slots=50, stride=4, seed=3)
    seen, j = [], 0
    for _ in range(50):
        seen.append(j)
        j = int(nxt[j])
    assert j == 0 and sorted(seen) == list(range(0, 200, 4))    # back home after 50, not before


@pytest.mark.parametrize("hops", [0, 1, 49, 50, 123])
def test_pointer_chase_ends_where_the_python_walk_ends(emu, hops):
    nxt = h.chase_cycle(slots=50, stride=4, seed=1)
    out = np.zeros(1, np.uint32)
    emu.launch("pointer_chase.cu", "pointer_chase", grid=(2,), block=(32,),
               args=(nxt, hops, 8, out))                # extra threads and blocks must idle
    assert int(out[0]) == h.walk(nxt, 8, hops)


@pytest.mark.slow
@pytest.mark.parametrize("n4,total,grid,block", [(16, 1000, 3, 64), (64, 64, 1, 32),
                                                 (256, 77, 2, 96)])
def test_bandwidth_read_sums_the_wrapped_working_set(emu, n4, total, grid, block):
    x = np.random.default_rng(n4).standard_normal(4 * n4).astype(np.float32)
    out = np.full(grid * block, np.nan, np.float32)
    emu.launch("bandwidth.cu", "bandwidth_read", grid=(grid,), block=(block,),
               args=(x, n4 - 1, total, out))
    ref = h.read_reference(x, total, grid * block)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.slow
def test_bandwidth_copy_copies_n_float4s_and_nothing_else(emu):
    n4 = 203                                            # not a multiple of the 2 x 64 threads
    src = np.arange(4 * n4 + 8, dtype=np.float32)
    dst = np.full_like(src, np.nan)
    emu.launch("bandwidth.cu", "bandwidth_copy", grid=(2,), block=(64,), args=(src, dst, n4))
    assert np.array_equal(dst[:4 * n4], src[:4 * n4]) and np.isnan(dst[4 * n4:]).all()


@pytest.mark.gpu
def test_ladder_on_a_gpu_matches_cublas():
    cp, why = h.gpu()
    if cp is None:
        pytest.skip(why)
    rows = h.gpu_ladder(n=512, repeats=1)
    assert len(rows) == 8 and all(gflops > 0 for _, gflops, _ in rows)
    assert all(err <= TOL for _, _, err in rows), rows


def test_pointer_chase_continues_where_the_last_run_ended(emu):
    """start = CONTINUE: the kernel starts from out[0], so two runs of 30 hops end where one
    walk of 60 does (the host never copies the end slot between runs)."""
    nxt = h.chase_cycle(slots=50, stride=4, seed=2)
    out = np.array([8], np.uint32)
    for _ in range(2):
        emu.launch("pointer_chase.cu", "pointer_chase", grid=(1,), block=(1,),
                   args=(nxt, 30, h.CONTINUE, out))
    assert int(out[0]) == h.walk(nxt, 8, 60)


def test_every_global_offset_of_the_ladder_is_formed_in_64_bits():
    """A[...], B[...] and C[...] in every rung index through at64 (or a 64-bit local `at`
    it made): an int offset such as row * K wraps once M K, K N or M N passes 2^31."""
    for path in sorted(KERNELS_DIR.glob("sgemm_*.cu")):
        code = re.sub(r"//[^\n]*", "", path.read_text())          # the code, not the comments
        subscripts = re.findall(r"(?<![\w.])([ABC])\[([^\]]*)\]", code)
        assert subscripts, path.name
        bad = [f"{m}[{i}]" for m, i in subscripts if not (i.startswith("at64(") or i == "at")]
        assert not bad, f"{path.name}: 32-bit offsets {bad}"
        if any(i == "at" for _, i in subscripts):
            assert "unsigned long long at = at64(" in code, f"{path.name}: `at` is not 64-bit"


AT64 = """
extern "C" __global__ void offsets(const int* args, unsigned long long* out, int n) {
  const int i = threadIdx.x;
  if (i < n) out[i] = at64(args[3 * i], args[3 * i + 1], args[3 * i + 2]);
}
"""


@pytest.mark.slow
def test_at64_gives_offsets_past_2_to_the_31_exactly(emu, tmp_path):
    """The ladder's at64, run on the emulator: row * ld + col without wrapping, up to the
    largest (row, ld, col) three ints allow."""
    src = (KERNELS_DIR / "sgemm_6_vectorized.cu").read_text()
    helper = src[src.index("__device__ __forceinline__ unsigned long long at64"):]
    helper = helper[:helper.index("\n}\n") + 3]
    path = tmp_path / "at64.cu"
    path.write_text(helper + AT64)
    big = 2**31 - 1
    cases = [(0, 5, 3), (46341, 46341, 0), (65536, 65536, 3), (70000, 4096, 4095),
             (big, big, big)]
    out = np.zeros(len(cases), np.uint64)
    emu.launch(path, "offsets", 1, 32, (np.array(cases, np.int32).ravel(), out, len(cases)))
    assert [int(o) for o in out] == [r * ld + c for r, ld, c in cases]
