"""The fused kernels and their unfused sequences, run by the CPU emulator on the same .cu
source nvcc compiles, against their NumPy float64 twins; fusion's launch savings counted;
and the emulator itself: its barriers and shuffles, its deadlock report, its builds, and
sanitizer builds that stay silent on the real kernels but catch a planted data race and a
planted out-of-bounds access.

Default set (each g++ build of a kernel file costs ~0.6 s): one case per kernel against its
twin, the check that every kernel is launched by a case, the LayerNorm backward pass counts
at the small shape, and the cheap checks of signatures, builds and the cache. Slow: the other
cases, the launch-count table, the emulator's barrier and shuffle tests (each builds its own
file; the deadlock report depends on a 0.3 s wall-clock timeout) and every sanitizer test
(each builds the kernels again under TSan or ASan)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from minidist.gpu import fused, unfused
from minidist.gpu.emulate import build as build_module
from minidist.gpu.emulate.build import BuildError, build
from minidist.gpu.emulate.cases import CASES, run_all, run_case
from minidist.gpu.emulate.runner import Emulator, EmulatorError
from minidist.gpu.emulate.sanitize import run_python
from minidist.gpu.emulate.source import KERNELS_DIR, read_kernels, rewrite_dynamic_shared
from minidist.hardware import op_costs as oc
from tests.gpu.conftest import KERNEL_FILES

PARAMS = [(name, shape, block) for name, (_, shapes, blocks) in CASES.items()
          for shape in shapes for block in blocks]
# Default set: one cheap case per kernel; the other shapes and block sizes are slow. Softmax
# and attention take a slightly larger case than their cheapest (1x1, 1x1x8), where a row
# of one element leaves nothing to reduce over; adamw takes two tensors, not one element.
DEFAULT_CASES = {("layernorm", (1, 32), 64), ("bias_gelu", (1, 5), 64),
                 ("softmax", (3, 13), 32), ("cross_entropy", (1, 10), 64),
                 ("adamw", (100, 37), 32), ("flash_attention", (2, 45, 16), 32)}


@pytest.mark.parametrize("name,shape,block", [
    pytest.param(n, s, b, id=f"{n}-{'x'.join(map(str, s))}-b{b}",
                 marks=() if (n, s, b) in DEFAULT_CASES else pytest.mark.slow)
    for n, s, b in PARAMS])
def test_kernel_matches_its_float64_twin_and_its_unfused_sequence(emulator, name, shape, block):
    checks = run_case(name, emulator, shape, block)
    bad = [str(c) for c in checks if not c.ok]
    assert not bad, f"{name} at {shape}, block {block}:\n" + "\n".join(bad)
    assert any("vs unfused" in c.what for c in checks), "no fused-vs-unfused comparison"


def test_every_kernel_of_the_fused_and_unfused_files_is_checked(emulator):
    emu = Emulator()
    run_all(emu, "one")
    launched = {(r.file, r.kernel) for r in emu.launches}
    declared = {(f, k) for f in KERNEL_FILES for k in read_kernels(f)}
    assert declared - launched == set(), f"never launched by a case: {declared - launched}"


def _launch_counts(emu: Emulator) -> dict[str, tuple[int, int]]:
    """(fused, unfused) launches of each op, measured on small inputs."""
    rng = np.random.default_rng(0)
    x, w, b = (emu.asarray(rng.standard_normal(s).astype(np.float32))
               for s in ((9, 100), (100,), (100,)))
    scores = emu.asarray(rng.standard_normal((2, 13, 13)).astype(np.float32))
    t = emu.asarray(np.arange(9, dtype=np.int32))
    q = emu.asarray(rng.standard_normal((2, 13, 8)).astype(np.float32))
    ps = [emu.asarray(rng.standard_normal(n).astype(np.float32)) for n in (5, 70, 3)]
    hyper = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.0, t=1)
    _, mean, rstd, xhat = unfused.layernorm_forward(emu, x, w, b)
    ops = {
        "LayerNorm forward": (lambda: fused.layernorm_forward(emu, x, w, b),
                              lambda: unfused.layernorm_forward(emu, x, w, b)),
        "LayerNorm backward": (lambda: fused.layernorm_backward(emu, x, x, w, mean, rstd),
                               lambda: unfused.layernorm_backward(emu, x, xhat, w, rstd)),
        "bias + GeLU fwd": (lambda: fused.bias_gelu_forward(emu, x, b),
                            lambda: unfused.bias_gelu_forward(emu, x, b)),
        "bias + GeLU bwd": (lambda: fused.bias_gelu_backward(emu, x, x, b),
                            lambda: unfused.bias_gelu_backward(emu, x, x, b)),
        "causal softmax": (lambda: fused.softmax_forward(emu, scores, 0.5),
                           lambda: unfused.softmax_forward(emu, scores, 0.5)),
        "softmax backward": (lambda: fused.softmax_backward(emu, scores, scores, 0.5),
                             lambda: unfused.softmax_backward(emu, scores, scores, 0.5)),
        "cross-entropy": (lambda: fused.cross_entropy(emu, emu.asarray(x), t),
                          lambda: unfused.cross_entropy(emu, x, t)),
        "AdamW": (lambda: fused.adamw_multi_tensor(emu, ps, ps, ps, ps, **hyper),
                  lambda: unfused.adamw(emu, ps, ps, ps, ps, **hyper)),
        "attention": (lambda: fused.flash_attention_forward(emu, q, q, q),
                      lambda: unfused.attention_forward(emu, q, q, q)),
    }
    counts = {}
    for op, versions in ops.items():
        n = []
        for run in versions:
            before = len(emu.launches)
            run()
            n.append(len(emu.launches) - before)
        counts[op] = tuple(n)
    return counts


@pytest.mark.slow
def test_fusion_saves_the_launches_the_unfused_docstring_table_states(emulator):
    counts = _launch_counts(Emulator())
    table = {}
    for line in unfused.__doc__.splitlines():
        m = re.match(r"\s{4}(\S.*?\S)\s{2,}(\d+)\s+(\d+)( per tensor)?\s", line + " ")
        if m:
            table[m.group(1)] = (int(m.group(2)), int(m.group(3)) * (3 if m.group(4) else 1))
    assert table == counts, f"docstring table {table}\nmeasured (3 AdamW tensors) {counts}"
    assert all(f < u for f, u in counts.values())


@pytest.mark.parametrize("N,C", [(1, 5), pytest.param(9, 100, marks=pytest.mark.slow)])
def test_unfused_layernorm_backward_makes_exactly_the_roofline_unfused_passes(emulator, N, C):
    """unfused.cu's LayerNorm backward is hardware/op_costs.py's unfused count, kernel by
    kernel: as many launches, and each launch's array arguments (each read or written whole,
    once; an array updated in place is passed twice) add up to that pass's bytes."""
    emu, moved = Emulator(), []
    launch = emu.launch

    def counting(cu, kernel, grid, block, args, shared_bytes=0):
        moved.append(sum(a.nbytes for a in args if isinstance(a, np.ndarray)))
        launch(cu, kernel, grid, block, args, shared_bytes)
    rng = np.random.default_rng(2)
    dy, x = (rng.standard_normal((N, C)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(C).astype(np.float32)
    _, _, rstd, xhat = unfused.layernorm_forward(emu, x, w, w)
    emu.launch = counting
    unfused.layernorm_backward(emu, dy, xhat, w, rstd)
    assert moved == [k.bytes for k in oc.layernorm_backward(N, C, 4)[1]]


def test_layernorm_backward_fills_the_gpu_and_sums_one_partial_row_per_block(emulator,
                                                                             monkeypatch):
    """Stage 1 runs min(N, LN_BWD_BLOCKS) blocks with the partial dw, db rows (8 C bytes) in
    shared memory; stage 2 adds them with blocks of (32, min(G, 32)) threads, 32 columns
    each. Here LN_BWD_BLOCKS = 4 < N = 9, so blocks take 3 or 2 rows, as ~8 an SM do on a GPU
    at N = 32768; the columns (100) overhang stage 2's last block."""
    from minidist.gpu import twins
    monkeypatch.setattr(fused, "LN_BWD_BLOCKS", 4)
    emu, rng = Emulator(), np.random.default_rng(5)
    x, dy = (rng.standard_normal((9, 100)).astype(np.float32) for _ in range(2))
    w, b = (rng.standard_normal(100).astype(np.float32) for _ in range(2))
    _, mean, rstd = fused.layernorm_forward(emu, x, w, b)
    before = len(emu.launches)
    dx, dw, db = fused.layernorm_backward(emu, dy, x, w, mean, rstd, block=64)
    stage1, stage2 = emu.launches[before:]
    assert (stage1.kernel, stage1.grid, stage1.block, stage1.shared_bytes) == (
        "layernorm_backward", (4, 1, 1), (64, 1, 1), 8 * 100)
    assert (stage2.kernel, stage2.grid, stage2.block) == (
        "layernorm_param_grads", (4, 1, 1), (32, 4, 1))
    want = twins.layernorm_backward(dy, x, w, b)
    for name, got in (("dx", dx), ("dw", dw), ("db", db)):
        err = np.abs(got - want[name]).max() / np.abs(want[name]).max()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    wide = np.zeros((1, 29041), np.float32)       # 8 C + 128 B > 227 KiB of shared memory
    with pytest.raises(ValueError, match=r"C = 29041 columns need .* \(C <= 29040\)"):
        fused.layernorm_backward(emu, wide, wide, wide[0], wide[0], wide[0])


# ---- the emulator itself ----
SHIM_TEST = r"""
extern "C" __global__ void reverse_first_n(float* out, int n) {
  extern __shared__ float buf[];
  if (threadIdx.x >= n) return;  // these threads leave before the barrier
  buf[threadIdx.x] = out[blockIdx.x * n + threadIdx.x];
  __syncthreads();
  out[blockIdx.x * n + threadIdx.x] = buf[n - 1 - threadIdx.x];
}
extern "C" __global__ void warp_ops(const float* x, float* sums, float* firsts) {
  float v = x[threadIdx.x];
  for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  const float first = __shfl_sync(0xffffffffu, x[threadIdx.x], 0);
  if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = v;
  firsts[threadIdx.x] = first;
}
extern "C" __global__ void shuffle_in_a_branch(float* x) {
  if (threadIdx.x < 16) x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, x[threadIdx.x], 1);
  __syncthreads();
}
"""


@pytest.fixture
def shim_test(emulator, tmp_path):
    path = tmp_path / "shim_test.cu"
    path.write_text(SHIM_TEST)
    return path


@pytest.mark.slow
def test_threads_that_return_early_do_not_hold_up_the_barrier(shim_test):
    out = np.arange(3 * 40, dtype=np.float32)
    Emulator().launch(shim_test, "reverse_first_n", 3, 64, (out, 40), shared_bytes=40 * 4)
    assert np.array_equal(out, np.arange(120, dtype=np.float32).reshape(3, 40)[:, ::-1].ravel())


@pytest.mark.slow
def test_warp_shuffles_match_numpy(shim_test):
    x = np.random.default_rng(1).standard_normal(96).astype(np.float32)
    sums, firsts = np.zeros(3, np.float32), np.zeros(96, np.float32)
    Emulator().launch(shim_test, "warp_ops", 1, 96, (x, sums, firsts))
    np.testing.assert_allclose(sums, x.reshape(3, 32).sum(axis=1), rtol=1e-6)
    assert np.array_equal(firsts, np.repeat(x[::32], 32))


@pytest.mark.slow        # timing: under load, fewer than 16 threads may arrive within 0.3 s
def test_a_shuffle_inside_a_branch_is_reported_not_a_hang(shim_test, capfd):
    x = np.zeros(32, np.float32)
    with pytest.raises(EmulatorError, match="deadlocked at a barrier"):
        Emulator(timeout_s=0.3).launch(shim_test, "shuffle_in_a_branch", 1, 32, (x,))
    assert "at a warp shuffle: 16 of 32 threads arrived" in capfd.readouterr().err


def test_arguments_are_checked_against_the_kernel_signature(emulator):
    emu, x = Emulator(), np.zeros((2, 4), np.float64)
    y = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"argument 'x' \(float\*\) needs a C-contiguous "
                                         r"float32 NumPy array; got a float64 array"):
        emu.launch("layernorm.cu", "layernorm_forward", 2, 64, (x, y[0], y[0], y, y[0], y[0],
                                                                 2, 4, 1e-5))
    with pytest.raises(ValueError, match=r"takes 9 arguments .* got 2"):
        emu.launch("layernorm.cu", "layernorm_forward", 2, 64, (y, y))
    with pytest.raises(ValueError, match="block .* has 2048 threads"):
        emu.launch("layernorm.cu", "layernorm_forward", 1, (2048,), ())
    with pytest.raises(ValueError, match="block=48 threads; it must be a multiple of 32"):
        fused.layernorm_forward(emu, y, y[0], y[0], block=48)


def test_signatures_are_read_from_the_source():
    ln = read_kernels("layernorm.cu")["layernorm_forward"]
    assert ln.signature() == ("layernorm_forward(float* x, float* w, float* b, float* y, "
                              "float* mean, float* rstd, int N, int C, float eps)")
    table = read_kernels("adamw.cu")["adamw_multi_tensor"].params
    assert [(p.name, p.pointer, p.dtype) for p in table[:5]] == [
        ("params", 2, "uint64"), ("grads", 2, "uint64"), ("ms", 2, "uint64"),
        ("vs", 2, "uint64"), ("chunks", 1, "int64")]
    assert rewrite_dynamic_shared("  extern __shared__ __align__(16) float smem[];") == (
        "  float* smem = reinterpret_cast<float*>(cuda_shim::dynamic_shared());")


def test_a_failed_build_names_the_command_and_the_compiler_error(emulator, tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(BuildError) as err:
        build(bad)
    text = str(err.value)
    assert "command: " in text and "-include" in text and "undefined_name" in text
    assert f"{bad}:1:" in text, "the error should point at the .cu file's own line"


def test_a_second_build_of_the_same_source_and_flags_comes_from_the_cache(emulator,
                                                                          monkeypatch):
    first = build("softmax.cu")
    monkeypatch.setattr(build_module, "_compile", lambda *a: pytest.fail("recompiled"))
    assert build("softmax.cu").path == first.path


# ---- sanitizers: silent on the real kernels, loud on planted bugs ----
CHILD = """
from minidist.gpu.emulate.cases import run_all, run_case
from minidist.gpu.emulate.runner import Emulator
emu = Emulator({variant!r}, kernel_dir={kernel_dir!r})
checks = {call}
print(sum(c.ok for c in checks), "of", len(checks), "checks ok")
"""


def _run(variant: str, call: str, kernel_dir: str | None = None):
    return run_python(CHILD.format(variant=variant, kernel_dir=kernel_dir, call=call), variant)


def _broken_copy(tmp_path, name: str, old: str, new: str) -> str:
    src = (KERNELS_DIR / name).read_text()
    assert src.count(old) == 1, f"{name} no longer holds exactly one {old!r}: update this test"
    (tmp_path / name).write_text(src.replace(old, new))
    return str(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["thread", "address"])
def test_sanitizers_find_nothing_in_the_real_kernels(sanitized, variant):
    sanitized(variant)
    report = _run(variant, 'run_all(emu, "one")')
    assert report.clean, f"{variant}: {report.findings}\n{report.stderr[-4000:]}"
    ok, total = map(int, re.search(r"(\d+) of (\d+) checks ok", report.stdout).groups())
    assert ok == total > 0, report.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["thread", "address"])
def test_sanitizers_find_nothing_at_every_shape_and_block(sanitized, variant):
    sanitized(variant)
    report = _run(variant, 'run_all(emu, "all")')          # about 60 s under TSan
    assert report.clean, f"{variant}: {report.findings}\n{report.stderr[-4000:]}"
    ok, total = map(int, re.search(r"(\d+) of (\d+) checks ok", report.stdout).groups())
    assert ok == total > 0, report.stdout


@pytest.mark.slow
def test_thread_sanitizer_reports_the_race_of_a_removed_syncthreads(sanitized, tmp_path):
    sanitized("thread")
    kernels = _broken_copy(tmp_path, "layernorm.cu",
                           "  __syncthreads();  // every warp's sum is in scratch\n", "")
    report = _run("thread", 'run_case("layernorm", emu, (7, 100), 64)', kernels)
    assert any("data race" in f for f in report.findings), report.stderr[-4000:]
    assert "block_sum" in report.stderr and "layernorm.cu" in report.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name,old,new,call", [
    ("flash_attention.cu", "const bool inside = k0 + jj < T && d < D;",
     "const bool inside = d < D;",
     'run_case("flash_attention", emu, (2, 45, 16), 32)'),
    ("layernorm.cu", "const bool inside = c < C;", "const bool inside = true;",
     'run_case("layernorm", emu, (7, 100), 64)'),
], ids=["flash_attention-tile-load", "layernorm-param-grads"])
def test_address_sanitizer_reports_the_access_past_a_removed_bounds_guard(sanitized, tmp_path,
                                                                          name, old, new, call):
    sanitized("address")
    report = _run("address", call, _broken_copy(tmp_path, name, old, new))
    assert any("heap-buffer-overflow" in f for f in report.findings), report.stderr[-4000:]
    assert name in report.stderr, "ASan should name the kernel file's line"
