"""The GPU memory hierarchy, one rung at a time: seven SGEMM kernels, each feeding the inner
loop from a faster level (DRAM -> lines -> shared memory -> registers -> wide loads -> warps).

What you will see: (1) the ladder, one line per rung: what it changes, its global loads per
FMA (from the C tile one block computes) and what Boehm measured on an A6000; (2) every
kernel instantiation of every rung run on CPU threads by the emulator (the same .cu source
nvcc compiles) and compared with NumPy's float64 product, at a shape that is no multiple of
any tile, plus the pointer-chase and bandwidth kernels against their references; (3) this
CPU's own hierarchy from NumPy timings: read GB/s and random-access ns per working set, one
plateau per cache level; (4) on a GPU, each rung's GFLOP/s beside cuBLAS; here, why not.

Run:       python demos/28_memory_hierarchy.py [--m 100 --n 76 --k 52 --max-mb 64]
Read with: minidist/gpu/kernels/sgemm_1_naive.cu .. sgemm_7_warptile.cu (one rung each),
           minidist/gpu/hierarchy.py, minidist/hardware/cpu_caches.py, gpu/compile_gate.py
Paper:     S. Boehm 2022, "How to Optimize a CUDA Matmul Kernel for cuBLAS-like Performance";
           Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4)
"""

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from minidist.cli import CliParser       # noqa: E402
from minidist.gpu import hierarchy as h  # noqa: E402
from minidist.hardware import cpu_caches  # noqa: E402

# --- settings (each can be overridden on the command line) ---
M, N, K, MAX_MB, GPU_N, SEED, TOL = 100, 76, 52, 64, 4096, 0, 1e-4


# each number option's (low, high): the demo stays small
LIMITS = dict(m=(1, 512), n=(4, 512), k=(4, 512), max_mb=(1, 1024), gpu_n=(1, 8192),
              seed=(0, 2 ** 32))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(m=M, n=N, k=K, max_mb=MAX_MB, gpu_n=GPU_N, seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.k % 4 or a.n % 4:
        ap.error("need --k and --n multiples of 4 (the float4 rungs 6 and 7 load four floats "
                 "at a time)")
    return a


def ladder() -> None:
    print("\n== 1. the ladder (GPU tile sizes; Boehm's GFLOP/s on an A6000 at 4096^3) ==")
    print(f"  {'rung':<13} {'kernel':<34} {'loads/FMA':>9} {'FLOP/B':>6} {'GFLOP/s':>7} "
          f"{'cuBLAS':>6}")
    for r in h.LADDER:
        print(f"  {r.step} {r.name:<11} {r.kernel:<34} {r.loads_per_fma:>9.3f} "
              f"{0.5 / r.loads_per_fma:>6.2f} {r.boehm:>7.0f} {r.boehm / h.BOEHM_CUBLAS:>6.1%}"
              f"\n      {r.what}")
    print("  loads/FMA: global loads per multiply-add; FLOP/B = 2 / (4 B x loads/FMA), the "
          "intensity\n  against L2/DRAM. Rungs 6 and 7 keep rung 5's tile: they cut "
          "instructions, not bytes.")


def emulated(a, emu) -> float:
    print(f"\n== 2. on CPU threads (the emulator): C = 1.5 A @ B - 0.5 C, M, N, K = "
          f"{a.m}, {a.n}, {a.k} ==")
    rng = np.random.default_rng(a.seed)
    A, B, C = (rng.standard_normal(s).astype(np.float32) for s in
               ((a.m, a.k), (a.k, a.n), (a.m, a.n)))
    ref = 1.5 * (A.astype(np.float64) @ B.astype(np.float64)) - 0.5 * C
    worst, first = 0.0, None
    print(f"  {'rung and kernel':<36} {'block':<9} {'grid':<8} {'rel err':>8}  "
          "bitwise = first row")
    for r in h.EMULATED:
        grid, block = r.dims(a.m, a.n)
        got = h.run_emulated(emu, r, A, B, C, 1.5, -0.5)
        first = got if first is None else first
        err, same = h.relative_error(got, ref), np.array_equal(got, first)
        worst = max(worst, err)
        print(f"  {r.step} {r.kernel:<34} {str(block):<9} {str(grid):<8} {err:>8.1e}  "
              f"{'yes' if same else 'no'}")
    print("  every thread adds its k terms in order 0..K-1, whatever the tiling: the rungs "
          "differ in\n  where operands come from, not in the arithmetic")
    return worst


def probes(emu) -> bool:
    nxt, out = h.chase_cycle(slots=1000, stride=h.CHASE_STRIDE), np.zeros(1, np.uint32)
    emu.launch("pointer_chase.cu", "pointer_chase", (1,), (1,), (nxt, 2500, 0, out))
    chase_ok = int(out[0]) == h.walk(nxt, 0, 2500)
    x = np.random.default_rng(1).standard_normal(4 * 256).astype(np.float32)
    got = np.zeros(2 * 128, np.float32)
    emu.launch("bandwidth.cu", "bandwidth_read", (2,), (128,), (x, 255, 5000, got))
    read_ok = np.allclose(got, h.read_reference(x, 5000, 256), rtol=1e-5, atol=1e-4)
    print(f"  pointer_chase: 2500 hops over a 1000-slot cycle end at index {int(out[0])} (slot "
          f"{int(out[0]) // h.CHASE_STRIDE}, {'=' if chase_ok else '!='} the Python walk)")
    print(f"  bandwidth_read: 5000 float4 loads wrapped over 4 KB: per-thread sums "
          f"{'match' if read_ok else 'DIFFER from'} NumPy")
    return chase_ok and read_ok


def on_gpu(a) -> None:
    print("\n== 4. on a GPU ==")
    cp, why = h.gpu()
    if cp is None:
        print(f"  no GPU found: {why}.\n  With CuPy and a device this part prints each rung's "
              f"GFLOP/s at {a.gpu_n}^3\n  beside cupy.matmul (FP32).")
        return
    rows = h.gpu_ladder(n=a.gpu_n)
    top = rows[-1][1]
    for label, gflops, err in rows:
        print(f"  {label:<52} {gflops:>9.0f} GFLOP/s {gflops / top:>7.1%} of cuBLAS "
              f"(rel err {err:.1e})")


def main(argv=None) -> int:
    a = parse_args(argv)
    from minidist.gpu.emulate.build import build_many, compiler_missing
    print(f"demo 28 · memory hierarchy · SGEMM ladder of {len(h.LADDER)} rungs, "
          f"{len(h.EMULATED)} kernels emulated · float32")
    ladder()
    if compiler_missing():
        print(f"MISMATCH: the emulator cannot build the kernels: {compiler_missing()}")
        return 1
    from minidist.gpu.emulate.runner import Emulator
    build_many(sorted({r.file for r in h.EMULATED} | {"pointer_chase.cu", "bandwidth.cu"}))
    emu = Emulator()
    worst, probes_ok = emulated(a, emu), probes(emu)
    print(f"\n== 3. this CPU's hierarchy (NumPy, one thread, 16 KB .. {a.max_mb} MB) ==")
    points = cpu_caches.sweep(a.max_mb * cpu_caches.MB)
    print("\n".join("  " + line for line in cpu_caches.report(points, cpu_caches.cache_sizes())))
    on_gpu(a)
    if worst > TOL or not probes_ok:
        print(f"MISMATCH: worst SGEMM relative error {worst:.1e} (bound {TOL:g}); pointer "
              f"chase and bandwidth kernels {'match' if probes_ok else 'DIFFER'}")
        return 1
    print(f"worst SGEMM relative error {worst:.1e} (bound {TOL:g}); the chase and bandwidth "
          "kernels match")
    print(f"OK: all {len(h.EMULATED)} SGEMM kernels of the 7 rungs match NumPy float64 on the "
          "CPU emulator")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
