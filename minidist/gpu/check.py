"""`python -m minidist gpu check`: the GPU path on a real GPU, in a few minutes, one verdict a part.

Every kernel of gpu/kernels/ is verified on the CPU already (the emulator runs the same .cu
source on CPU threads against its NumPy twin; the compile gate compiles it for sm_90). What
needs the GPU itself is timing, the device's own rounding and the CuPy backend. A GPU is
lent rarely and briefly, so this is ONE prepared script, its code run on the CPU first:

    kernels    emulate/cases.py (every fused and unfused kernel against its float64 twin, at
               3 shapes and 2 block sizes) and flash attention at T = 2048, D = 64.
               OK: errors <= 1e-5 (1e-4 for attention)
    fusion     each fused kernel against its twin's NumPy passes run by CuPy (one kernel a
               pass) and against unfused.cu. OK: speedup >= 0.7 x the roofline's predicted
               ratio (of the op's two bounds on the H200: the byte ratio when memory-bound)
    bandwidth  read and copy over 1 GB (gpu/hierarchy.py), fused kernels in compulsory B/s.
               OK: copy and bias + GELU >= 80 % of 4.8 TB/s, LayerNorm and AdamW >= 70 %
    ladder     the SGEMM ladder at 4096^3 against cupy.matmul FP32 (CUPY_TF32 unset).
               OK: errors <= 1e-4, GFLOP/s rise rung by rung, the last >= 50 %
    hierarchy  pointer-chase latency and read bandwidth over working sets of 16 KB .. 1 GB.
               OK: latency x2 and bandwidth /1.5 from the smallest set to the largest
    training   3 AdamW steps of a tiny GPT through backend.xp = CuPy vs the same in NumPy.
               OK: float64 within 1e-10; float32's distance to the CPU float64 run at most
               4x the CPU float32 run's
One run's view (`main`): find CuPy and a device (else one line, "skipped", exit 0); run
the parts in order, each printing its rows, then `OK: <part>: ...` or `MISMATCH: <part>:
...` (a part that raises is a MISMATCH naming the error); exit 1 if any part mismatched.
In the performance parts (fusion, bandwidth, ladder) a MISMATCH is a missed target.

Imports: NumPy at the top; each part imports what it needs, none of it `multiprocess` or
`dill` (the GPU machine lacks both: if `python -m minidist` cannot start, run the module).

References: Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4); S. Boehm 2022,
    "How to Optimize a CUDA Matmul Kernel for cuBLAS-like Performance"; Dao et al. 2022,
    arXiv:2205.14135 (FlashAttention).
Read next: gpu/fused.py, gpu/hierarchy.py, hardware/roofline.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

HBM = 4.8e12                     # B/s, the H200's data sheet
SKIPPED = ("gpu check: skipped ({why}); it needs CuPy (the 'gpu' extra: CUDA 13) and a CUDA "
           "device.")
# activations N x C (128 MB), BH heads T x D, NV rows of V logits, AdamW over GPT-2 small
SIZES = dict(N=32768, C=1024, BH=16, T=2048, D=64, V=50257, NV=8192, cases="all",
             gpt=dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))


@dataclass
class Part:
    """One part's verdict: its rows (printed as they come) and one summary line."""

    name: str
    ok: bool = True
    summary: str = ""
    rows: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"{'OK' if self.ok else 'MISMATCH'}: {self.name}: {self.summary}"


@dataclass
class Rig:
    """What the parts run on: the array module, a gpu/fused.py Device, the backend the twins
    use, and the sizes. On a GPU: CuPy, CupyDevice, "cupy"; the CPU tests pass NumPy, the
    emulator, "numpy" and small sizes, so every line of a part runs before a GPU does."""

    xp: Any
    device: Any
    backend: str = "cupy"
    sizes: dict = field(default_factory=lambda: dict(SIZES))

    def ms(self, fn: Callable[[], object], repeats: int = 5) -> float:
        """The fastest of `repeats` runs of fn() in ms, after a warm-up (CUDA events on a
        GPU, perf_counter with NumPy)."""
        fn()
        best = float("inf")
        for _ in range(repeats):
            if self.xp is np:
                t0 = time.perf_counter()
                fn()
                best = min(best, (time.perf_counter() - t0) * 1e3)
            else:
                start, end = self.xp.cuda.Event(), self.xp.cuda.Event()
                start.record()
                fn()
                end.record()
                end.synchronize()
                best = min(best, self.xp.cuda.get_elapsed_time(start, end))
        return best

    @contextlib.contextmanager
    def twins(self):
        """backend.xp = the rig's module inside (the twins' math), NumPy after."""
        from minidist import backend
        backend.use(self.backend)
        try:
            yield
        finally:
            backend.use("numpy")


def find_gpu() -> tuple[Any, str]:
    """(cupy, "") when CuPy and a CUDA device are usable; else (None, why, in words)."""
    os.environ.setdefault("CUPY_TF32", "0")      # plain FP32 matmuls: the ladder's reference
    from minidist import backend
    why = backend.gpu_problem()
    if why is not None:
        return None, why
    import cupy
    return cupy, ""


# --- the parts: each takes the Rig and returns its Part ------------------------------------

def kernels(rig: Rig) -> Part:
    """emulate/cases.py's cases (fused, unfused, twin) on the rig's device, and flash
    attention at the issue's T = 2048, D = 64 (rig.sizes T and D)."""
    from minidist.gpu import fused, twins
    from minidist.gpu.emulate import cases
    dev, z = rig.device, rig.sizes
    checks = cases.run_all(dev, z["cases"])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, z["T"], z["D"])).astype(np.float32) for _ in range(3))
    o, _ = fused.flash_attention_forward(dev, *(dev.asarray(a) for a in (q, k, v)))
    checks.append(cases.Check(f"flash_attention T={z['T']} D={z['D']} o", cases.rel_error(
        dev.to_numpy(o), twins.attention(q, k, v)["o"]), cases.TOL_ATTENTION))
    groups: dict[str, list] = {}
    for c in checks:
        groups.setdefault(c.what.rsplit(" ", 1)[0], []).append(c)      # less the output
    p = Part("kernels", all(c.ok for c in checks))
    p.rows = [f"  {name:<48}{len(cs):>3} checks, worst {max(c.error for c in cs):.1e} "
              f"(tol {cs[0].tol:g}){'' if all(c.ok for c in cs) else '  BAD'}"
              for name, cs in groups.items()]
    bad = [c.what for c in checks if not c.ok]
    p.summary = (f"{len(checks) - len(bad)} of {len(checks)} comparisons within tolerance "
                 "(fused and unfused kernels vs the float64 twins)"
                 + (f"; failing: {', '.join(bad[:5])}" if bad else ""))
    return p


def fusion_ops(rig: Rig) -> list[tuple]:
    """(name, fused(), the twin's passes(), unfused.cu(), op_costs pair) for each op."""
    from minidist.autograd.function import Context
    from minidist.autograd.fused import CrossEntropy, Gelu, LayerNorm, Softmax
    from minidist.gpu import fused as fu
    from minidist.gpu import unfused as un
    from minidist.hardware import op_costs as oc
    from minidist.hardware.roofline import parameter_sizes
    from minidist.nn import GPTConfig
    from minidist.optim.adamw import adamw_step
    xp, dev, z, f32 = rig.xp, rig.device, rig.sizes, np.float32
    N, C, BH, T, D, V, NV = (z[k] for k in ("N", "C", "BH", "T", "D", "V", "NV"))
    r = xp.random.default_rng(0)
    x, dy, S = (r.standard_normal(shape, f32) for shape in ((N, C), (N, C), (BH, T, T)))
    w, b, scale, mask = xp.ones(C, f32), xp.zeros(C, f32), D ** -0.5, xp.tril(xp.ones((T, T),
                                                                                      bool))
    logits, t = r.standard_normal((NV, V), f32), xp.asarray(np.arange(NV) % V, np.int32)
    q, k, v = (r.standard_normal((BH, T, D), f32) for _ in range(3))
    sizes = parameter_sizes(GPTConfig(**z["gpt"]))
    pgmv = [[r.standard_normal(n, f32) for n in sizes] for _ in range(3)]
    pgmv.append([r.random(n, f32) for n in sizes])                  # v >= 0
    hyper = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, wd=0.0, t=1)
    _, mean, rstd = fu.layernorm_forward(dev, x, w, b)
    _, _, u_rstd, u_xhat = un.layernorm_forward(dev, x, w, b)     # what the unfused bwd needs
    y = fu.softmax_forward(dev, S, scale)
    with rig.twins():
        ln, ge, sm = _ctx(LayerNorm, x, w, b), _ctx(Gelu, x + b), \
            _ctx(Softmax, xp.where(mask, S * scale, -np.inf))
        ce = _ctx(CrossEntropy, logits, t=t, ignore_index=-100, reduction="sum")

    def attention_twin():
        s = xp.where(mask, (q @ k.transpose(0, 2, 1)) * scale, -np.inf)
        return Softmax.forward(Context(), s) @ v
    return [
        ("layernorm forward", lambda: fu.layernorm_forward(dev, x, w, b),
         lambda: LayerNorm.forward(Context(), x, w, b),
         lambda: un.layernorm_forward(dev, x, w, b), oc.layernorm(N, C, 4)),
        ("layernorm backward", lambda: fu.layernorm_backward(dev, dy, x, w, mean, rstd),
         lambda: LayerNorm.backward(ln, dy),
         lambda: un.layernorm_backward(dev, dy, u_xhat, w, u_rstd),
         oc.layernorm_backward(N, C, 4)),
        ("bias + gelu forward", lambda: fu.bias_gelu_forward(dev, x, b),
         lambda: Gelu.forward(Context(), x + b), lambda: un.bias_gelu_forward(dev, x, b),
         oc.bias_gelu(N, C, 4)),
        ("bias + gelu backward", lambda: fu.bias_gelu_backward(dev, dy, x, b),
         lambda: Gelu.backward(ge, dy)[0].sum(axis=0),
         lambda: un.bias_gelu_backward(dev, dy, x, b), oc.bias_gelu_backward(N, C, 4)),
        ("causal softmax", lambda: fu.softmax_forward(dev, S, scale),
         lambda: Softmax.forward(Context(), xp.where(mask, S * scale, -np.inf)),
         lambda: un.softmax_forward(dev, S, scale), oc.scaled_masked_softmax(BH * T, T, 4)),
        ("causal softmax backward", lambda: fu.softmax_backward(dev, S, y, scale),
         lambda: xp.where(mask, Softmax.backward(sm, S)[0], 0) * scale,
         lambda: un.softmax_backward(dev, S, y, scale),
         oc.scaled_masked_softmax_backward(BH * T, T, 4)),
        ("cross-entropy + grad", lambda: fu.cross_entropy(dev, logits, t, reduction="sum"),
         lambda: (CrossEntropy.forward(Context(), logits, t=t, ignore_index=-100,
                                       reduction="sum"), CrossEntropy.backward(ce, 1.0)),
         lambda: un.cross_entropy(dev, logits, t, reduction="sum"),
         (oc.cross_entropy(NV, V, 4)[0], oc.cross_entropy(NV, V, 4)[1]
          + oc.cross_entropy_backward(NV, V, 4)[1])),
        (f"adamw ({len(sizes)} tensors)", lambda: fu.adamw_multi_tensor(dev, *pgmv, **hyper),
         lambda: [adamw_step(*a, **hyper) for a in zip(*pgmv)],
         lambda: un.adamw(dev, *pgmv, **hyper), oc.adamw(sizes, 4)),
        (f"attention T={T} D={D}", lambda: fu.flash_attention_forward(dev, q, k, v),
         attention_twin, lambda: un.attention_forward(dev, q, k, v), oc.attention(1, BH, T, D, 4)),
    ]


def _ctx(function, *arrays, **kwargs):
    """The context `function`'s forward leaves on `arrays`, for timing its backward."""
    from minidist.autograd.function import Context
    ctx = Context()
    ctx.needs_input_grad = (True,) * len(arrays)
    function.forward(ctx, *arrays, **kwargs)
    return ctx


def fusion(rig: Rig) -> Part:
    """Fused kernel vs its twin's NumPy passes on CuPy (and vs unfused.cu), beside the
    speedup the roofline predicts: the ratio of the op's two bounds on the H200 (the byte
    ratio where the op is memory-bound)."""
    from minidist.hardware.roofline import Op, h200
    roof = h200("float32")
    p = Part("fusion")
    p.rows = [f"  {'op (ms)':<26}{'fused':>9}{'twin':>9}{'.cu':>9}{'speedup':>9}"
              f"{'predicted':>10}{'launches':>10}"]
    short = []
    for name, fast, twin, slow, (fk, uk) in fusion_ops(rig):
        op = Op(name, "forward", 1, fk, uk)
        with rig.twins():
            ms_twin = rig.ms(twin, 3)
        ms, ms_cu = rig.ms(fast), rig.ms(slow, 3) if slow is not None else float("nan")
        # speedup: the twin's time over the fused kernel's; .cu: unfused.cu's sequence
        predicted = roof.seconds(op, "unfused") / roof.seconds(op)
        if ms_twin / ms < 0.7 * predicted:
            short.append(name)
        p.rows.append(f"  {name:<26}{ms:>9.3f}{ms_twin:>9.3f}{ms_cu:>9.3f}"
                      f"{ms_twin / ms:>8.1f}x{predicted:>9.1f}x"
                      f"{op.launches('fused'):>5}/{op.launches('unfused')}")
    p.ok = not short
    p.summary = (f"{len(p.rows) - 1 - len(short)} of {len(p.rows) - 1} fused ops reach 0.7 x "
                 "the predicted speedup over their twin's passes"
                 + (f"; short: {', '.join(short)}" if short else ""))
    return p


def bandwidth(rig: Rig) -> Part:
    """Read and copy over 1 GB (gpu/hierarchy.py), and fused kernels in compulsory B/s,
    against the H200's 4.8 TB/s."""
    from minidist.gpu.hierarchy import GB, gpu_bandwidth
    from minidist.hardware.roofline import Op
    (_, read), (_, copy) = gpu_bandwidth((GB,))                    # GB/s
    rates = {"read (bandwidth_read, 1 GB)": (read * 1e9, None),
             "copy (bandwidth_copy, 1 GB)": (copy * 1e9, 0.8)}
    targets = {"layernorm forward": 0.7, "bias + gelu forward": 0.8, "adamw": 0.7}
    for name, fast, _, _, (fk, uk) in fusion_ops(rig):
        goal = targets.get(name.split(" (")[0])
        if goal is not None:
            seconds = rig.ms(fast) * 1e-3
            rates[f"{name} (fused)"] = (Op(name, "forward", 1, fk, uk).bytes() / seconds, goal)
    p = Part("bandwidth")
    p.rows = [f"  {name:<34}{bps / 1e12:>7.2f} TB/s {bps / HBM:>6.1%} of 4.8 TB/s"
              + (f"  (target {goal:.0%})" if goal else "") for name, (bps, goal) in rates.items()]
    low = [n for n, (bps, goal) in rates.items() if goal and bps < goal * HBM]
    p.ok = not low
    p.summary = (f"copy at {copy * 1e9 / HBM:.0%} of 4.8 TB/s; " + (
        "every kernel reaches its target" if not low else f"below target: {', '.join(low)}"))
    return p


def ladder(rig: Rig, n: int = 4096) -> Part:
    """The SGEMM ladder (gpu/hierarchy.py) at n^3 as % of cupy.matmul in FP32."""
    from minidist.gpu.hierarchy import gpu_ladder
    rows = gpu_ladder(n)                                      # cuBLAS last
    cublas, p = rows[-1][1], Part("ladder")
    p.rows = [f"  {label:<42}{gflops:>9.0f} GFLOP/s {gflops / cublas:>6.1%}  error {err:.1e}"
              for label, gflops, err in rows]
    rungs = rows[:-1]
    rising = all(b[1] >= a[1] for a, b in zip(rungs, rungs[1:]))
    worst, last = max(err for _, _, err in rungs), rungs[-1][1] / cublas
    p.ok = rising and worst <= 1e-4 and last >= 0.5
    p.summary = (f"{len(rungs)} rungs at {n}^3 {'rise' if rising else 'do NOT rise'} rung by "
                 f"rung; the last reaches {last:.0%} of cupy.matmul FP32 (target >= 50 %); "
                 f"max error {worst:.1e} (<= 1e-4)")
    return p


def hierarchy(rig: Rig) -> Part:
    """Latency and read bandwidth over 16 KB .. 1 GB working sets: the cache plateaus."""
    from minidist.gpu.hierarchy import WORKING_SETS, gpu_bandwidth, gpu_latency
    lat, p = gpu_latency(WORKING_SETS), Part("hierarchy")
    bw = gpu_bandwidth(WORKING_SETS)[:-1]                     # the last row is the copy
    p.rows = [f"  {size / 1024:>12,.0f} KB {ns:>9.1f} ns {gbs:>9.0f} GB/s"
              for (size, ns), (_, gbs) in zip(lat, bw)]
    p.ok = lat[-1][1] >= 2 * lat[0][1] and bw[0][1] >= 1.5 * bw[-1][1]
    p.summary = (f"latency {lat[0][1]:.0f} ns at 16 KB -> {lat[-1][1]:.0f} ns at 1 GB, read "
                 f"bandwidth {bw[0][1]:.0f} -> {bw[-1][1]:.0f} GB/s (want latency x2 and "
                 "bandwidth /1.5 from the smallest set to the largest)")
    return p


def training(rig: Rig, steps: int = 3, batch: int = 16) -> Part:
    """`steps` AdamW steps of a tiny GPT through backend.xp = rig.backend, against NumPy."""
    from minidist import backend
    from minidist.baseline import model_config_for, train_single_process
    from minidist.data import DataConfig
    data_cfg, device = DataConfig(task="sort", length=6), rig.backend

    def run(dtype: str, module: str) -> tuple[np.ndarray, dict]:
        cfg = model_config_for(data_cfg, n_layer=2, n_embd=32, n_head=4, dtype=dtype)
        backend.use(module)
        try:
            r = train_single_process(cfg, data_cfg, steps=steps, global_batch=batch, lr=1e-2)
        finally:
            backend.use("numpy")
        return np.array(r.losses), r.params

    cpu64, dev64, cpu32, dev32 = (run(dt, m) for dt in ("float64", "float32")
                                  for m in ("numpy", device))
    e64, e_dev32, e_cpu32 = gap(dev64, cpu64), gap(dev32, cpu64), gap(cpu32, cpu64)
    p = Part("training")
    p.rows = [f"  {name:<20} losses {' '.join(f'{x:.6f}' for x in r[0])}" for name, r in (
        ("CPU float64", cpu64), (f"{device} float64", dev64), ("CPU float32", cpu32),
        (f"{device} float32", dev32))]
    p.ok = e64 <= 1e-10 and e_dev32 <= max(4 * e_cpu32, 1e-6)
    p.summary = (f"{steps} steps on {device}: float64 max |GPU - CPU| = {e64:.1e} (<= 1e-10); "
                 f"float32 max |run - CPU float64| = {e_dev32:.1e} on the GPU, {e_cpu32:.1e} "
                 "on the CPU (GPU <= 4x CPU)")
    return p


def gap(a: tuple[np.ndarray, dict], b: tuple[np.ndarray, dict]) -> float:
    """The largest absolute difference between two runs' losses and final parameters."""
    return max([float(np.max(np.abs(a[0] - b[0])))] + [float(np.max(np.abs(
        np.asarray(a[1][name], np.float64) - value))) for name, value in b[1].items()])


# --- the script --------------------------------------------------------------------------

PARTS: dict[str, Callable[..., Part]] = {"kernels": kernels, "fusion": fusion,
                                         "bandwidth": bandwidth, "ladder": ladder,
                                         "hierarchy": hierarchy, "training": training}


def run_part(name: str, rig: Rig) -> Part:
    """PARTS[name](rig), its rows and verdict printed; an exception is that part's MISMATCH."""
    t0 = time.perf_counter()
    print(f"\n== {name} ==", flush=True)
    try:
        part = PARTS[name](rig)
    except Exception as e:                         # a broken part must not hide the others
        part = Part(name, False, f"raised {type(e).__name__}: {' '.join(str(e).split())}")
    for row in part.rows:
        print(row)
    part.summary += f" [{time.perf_counter() - t0:.0f} s]"
    print(part.line(), flush=True)
    return part


def describe(cp) -> str:
    """One line: the device, its memory and SMs, CuPy's and the CUDA runtime's versions."""
    d, v = cp.cuda.runtime.getDeviceProperties(0), cp.cuda.runtime.runtimeGetVersion()
    return (f"{bytes(d['name']).decode(errors='replace')}, {d['totalGlobalMem'] / 2**30:.0f} "
            f"GiB, {d['multiProcessorCount']} SMs · CuPy {cp.__version__} · CUDA {v // 1000}."
            f"{v % 1000 // 10}")


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist gpu check [--parts a,b]`: the exit code (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m minidist gpu check", description=(
        "Check the GPU path on this machine's GPU: kernels against their NumPy twins, "
        "fusion, bandwidth, the SGEMM ladder, the memory hierarchy and GPT training steps."))
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, in order (default all: {','.join(PARTS)})")
    a = p.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    if not parts or set(parts) - set(PARTS):
        p.exit(2, f"error: --parts {a.parts!r}: unknown {sorted(set(parts) - set(PARTS))}; "
                  f"choose from {', '.join(PARTS)}\n")
    cp, why = find_gpu()
    if cp is None:
        print(SKIPPED.format(why=" ".join(why.split())))
        return 0
    print(f"gpu check · {describe(cp)}", flush=True)
    from minidist.gpu.fused import CupyDevice
    results = [run_part(name, Rig(cp, CupyDevice())) for name in parts]
    bad = [r.name for r in results if not r.ok]
    print(f"\ngpu check: {len(results) - len(bad)} of {len(results)} parts OK"
          + (f"; MISMATCH in {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
