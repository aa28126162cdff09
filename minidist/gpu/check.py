"""`python -m minidist gpu check`: the GPU path on a real GPU, in a few minutes, one verdict a part.

Every kernel of gpu/kernels/ is verified on the CPU already (the emulator runs the same .cu
source on CPU threads against its NumPy twin; the compile gate compiles it for sm_90). What
needs the GPU itself is timing, the device's own rounding and the CuPy backend. A GPU is
lent rarely and briefly, so this is ONE prepared script, its code run on the CPU first:
`--dry-run` runs every part through gpu/standin.py (NumPy for CuPy, the emulator for the
GPU, every launch checked), which is also how the CPU tests run it.

    kernels    emulate/cases.py (every fused and unfused kernel against its float64 twin, at
               3 shapes and 2 block sizes) and flash attention at T = 2048, D = 64.
               OK: errors <= 1e-5 (1e-4 for attention)
    fusion     each fused kernel against its twin's NumPy passes run by CuPy (one kernel a
               pass) and against unfused.cu. OK: speedup >= 0.7 x the roofline's predicted
               ratio (of the op's two bounds on the H200: the byte ratio when memory-bound)
    bandwidth  read and copy over 1 GB (gpu/hierarchy.py), fused kernels in compulsory B/s.
               OK: copy and bias + GELU >= 80 % of 4.8 TB/s, LayerNorm and AdamW >= 70 %
    ladder     the SGEMM ladder at 4096^3 against cupy.matmul FP32 (CUPY_TF32 unset), and as
               % of the FP32 peak. OK: errors <= 1e-4, GFLOP/s rise rung by rung, the last
               >= 50 % of cupy.matmul
    hierarchy  pointer-chase latency and read bandwidth over working sets of 16 KB .. 1 GB,
               each kernel's result checked. OK: latency beyond 4 x L2 (HBM) >= 1.5 x the
               latency of sets of L2/16 .. L2/4 (L2 hits), which is >= 2 x the smallest set's
               (L1); read bandwidth of the smallest set >= 1.5 x the largest's
    training   3 AdamW steps of a tiny GPT through backend.xp = CuPy vs the same in NumPy.
               OK: float64 within 1e-10; float32's distance to the CPU float64 run at most
               4x the CPU float32 run's
Timing (gpu/timing.py): K calls back to back between one CUDA event pair, queued behind a
spin kernel that outlasts the host's enqueueing; kernels compiled, tables built and targets
counted before; nothing in a timed call makes the host wait for the GPU.

One run's view (`main`): find CuPy and a device (else one line and exit 3, or 4 when CuPy
is there without its CUDA libraries); run the parts in order, each printing its rows, then
`OK: <part>: ...` or `MISMATCH: <part>: ...` (a part that raises is a MISMATCH naming the
error). Each part ends with a synchronize, so an asynchronous CUDA error is reported by the
part that caused it; when the context is then lost (a sticky error: every later CUDA call
fails) the run stops there, naming the parts not run. Exit 0 when every part is OK, 1 when
one mismatched; in the performance parts (fusion, bandwidth, ladder) a MISMATCH is a missed
target.

Imports: none of them needs `multiprocess` or `dill` (the GPU machine lacks both: if
`python -m minidist` cannot start, run the module).

References: Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4); S. Boehm 2022,
    "How to Optimize a CUDA Matmul Kernel for cuBLAS-like Performance"; Dao et al. 2022,
    arXiv:2205.14135 (FlashAttention).
Read next: gpu/fused.py, gpu/hierarchy.py, gpu/timing.py, gpu/standin.py,
    hardware/roofline.py.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from minidist import backend
from minidist.autograd.tensor import Context
from minidist.autograd.fused import CrossEntropy, Gelu, LayerNorm, Softmax
from minidist.baseline import train_single_process
from minidist.cli import CliParser
from minidist.data import DataConfig, model_config_for
from minidist.gpu import fused, twins
from minidist.gpu import unfused as un
from minidist.gpu.emulate import cases
from minidist.gpu.emulate.build import compiler_missing
from minidist.gpu.hierarchy import gpu_bandwidth, gpu_ladder, gpu_latency
from minidist.gpu.standin import LEVELS, StandIn
from minidist.gpu.timing import Timer
from minidist.hardware import op_costs as oc
from minidist.hardware.roofline import Op, h200, parameter_sizes
from minidist.nn import GPTConfig
from minidist.optim.adamw import adamw_step

HBM = 4.8e12                     # B/s, the H200's data sheet
KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
EXIT_OK, EXIT_MISMATCH, EXIT_NO_GPU, EXIT_NO_CUDA_LIBRARIES = 0, 1, 3, 4
SKIPPED = ("gpu check: skipped, nothing was checked ({why}); it needs CuPy (the 'gpu' "
           "extra: CUDA 13) and a CUDA device. `--dry-run` runs it on a stand-in.")
NO_LIBRARIES = ("gpu check: CuPy is installed but cannot use CUDA here ({why}); install the "
                "CUDA 13 libraries it needs: pip install 'cupy-cuda13x[ctk]' (or the CUDA "
                "toolkit).")
# activations N x C (128 MB), BH heads T x D, NV rows of V logits, AdamW over GPT-2 small;
# the ladder's n, the hierarchy's working sets and hops, the bandwidth set and loads; the
# timer's calls per event pair and repeats
SIZES = dict(N=32768, C=1024, BH=16, T=2048, D=64, V=50257, NV=8192, cases="all",
             gpt=dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
             ladder_n=4096, working_sets=tuple(16 * KB << i for i in range(17)), hops=1 << 17,
             bandwidth_set=GB, loads=1 << 27, calls=10, repeats=3)
# --dry-run: small enough for the emulator, with the stand-in's caches scaled down to
# L1 16 KB and L2 512 KB so that the working sets 4 KB .. 4 MB cross every level
DRY_SIZES = dict(N=64, C=128, BH=2, T=64, D=16, V=100, NV=16, cases="one",
                 gpt=dict(vocab_size=11, block_size=12, n_layer=1, n_head=2, n_embd=8),
                 ladder_n=64, working_sets=tuple(4 * KB << i for i in range(11)), hops=1 << 10,
                 bandwidth_set=1 * MB, loads=1 << 14, calls=2, repeats=1)
# The five first parts need the device; training runs the backend (NumPy on the stand-in).
GPU_PARTS = ("kernels", "fusion", "bandwidth", "ladder", "hierarchy")


@dataclass
class Part:
    """One part's verdict: its rows (printed as they come) and one summary line."""

    name: str
    ok: bool = True
    summary: str = ""
    rows: list[str] = field(default_factory=list)
    context_lost: bool = False

    def line(self) -> str:
        return f"{'OK' if self.ok else 'MISMATCH'}: {self.name}: {self.summary}"


@dataclass
class Rig:
    """What the parts run on: the array module, a gpu/fused.py Device, the backend the twins
    use, and the sizes. On a GPU: CuPy, CupyDevice, "cupy"; the CPU tests and --dry-run pass
    gpu/standin.StandIn, a CupyDevice on it, "numpy" and small sizes, so every line of a part
    runs before a GPU does."""

    xp: Any
    device: Any
    backend: str = "cupy"
    sizes: dict = field(default_factory=lambda: dict(SIZES))
    timer: Any = None

    def __post_init__(self) -> None:
        if self.timer is None and getattr(self.device, "cp", None) is not None:
            self.timer = Timer(self.device, calls=self.sizes.get("calls", 10),
                               repeats=self.sizes.get("repeats", 3))

    def ms(self, fn: Callable[[], object], repeats: int | None = None) -> float:
        """ms per call of fn() (gpu/timing.py; perf_counter when there is no device)."""
        if self.timer is None:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return self.timer.ms(fn)

    def last(self):
        """The last measurement's timing.Timing (None without a device)."""
        return self.timer.last if self.timer is not None else None

    def sync(self) -> None:
        """Wait for the device: an asynchronous CUDA error surfaces here."""
        if getattr(self.device, "cp", None) is not None:
            self.device.cp.cuda.Device().synchronize()

    def alive(self) -> bool:
        """False when the CUDA context is lost: even a synchronize fails."""
        try:
            self.sync()
        except Exception:
            return False
        return True

    @contextlib.contextmanager
    def twins(self):
        """backend.xp = the rig's module inside (the twins' math), NumPy after."""
        backend.use(self.backend)
        try:
            yield
        finally:
            backend.use("numpy")


def gpu_status() -> tuple[Any, str, int]:
    """(cupy, "", EXIT_OK) when CuPy can compile and run kernels on a CUDA device; else
    (None, why in words, EXIT_NO_GPU or EXIT_NO_CUDA_LIBRARIES)."""
    os.environ.setdefault("CUPY_TF32", "0")      # plain FP32 matmuls: the ladder's reference
    try:
        import cupy
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "cupy":
            return None, "CuPy is not installed", EXIT_NO_GPU
        return None, f"CuPy cannot import {e.name}", EXIT_NO_CUDA_LIBRARIES
    except (ImportError, OSError) as e:          # e.g. libcudart.so.13 not found
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}", \
            EXIT_NO_CUDA_LIBRARIES
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                       # no driver, no device: CUDARuntimeError
        return None, (f"CuPy {getattr(cupy, '__version__', '?')} finds no usable CUDA device "
                      f"({type(e).__name__}: {' '.join(str(e).split())[:120]})"), EXIT_NO_GPU
    if count < 1:
        return None, "CuPy sees 0 CUDA devices", EXIT_NO_GPU
    try:                                         # NVRTC and the runtime: a trivial kernel
        cupy.RawModule(code='extern "C" __global__ void probe() {}').get_function("probe")
    except Exception as e:
        return None, (f"NVRTC cannot compile a kernel: {type(e).__name__}: "
                      f"{' '.join(str(e).split())[:160]}"), EXIT_NO_CUDA_LIBRARIES
    return cupy, "", EXIT_OK


def find_gpu() -> tuple[Any, str]:
    """(cupy, "") when CuPy and a CUDA device are usable; else (None, why, in words)."""
    cp, why, _ = gpu_status()
    return cp, why


def stand_in_rig(sizes: dict | None = None):
    """A Rig on gpu/standin.StandIn: NumPy arrays, kernels on the CPU emulator, the caches
    scaled down for DRY_SIZES' working sets (module doc); needs g++."""
    levels = (replace(LEVELS[0], bytes=16 * KB), replace(LEVELS[1], bytes=512 * KB), LEVELS[2])
    cp = StandIn(levels=levels)
    return Rig(cp, fused.CupyDevice(cp), "numpy", dict(sizes or DRY_SIZES))


# --- the parts: each takes the Rig and returns its Part ------------------------------------

def kernels(rig: Rig) -> Part:
    """emulate/cases.py's cases (fused, unfused, twin) on the rig's device, and flash
    attention at the issue's T = 2048, D = 64 (rig.sizes T and D)."""
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
    table = fused.ChunkTable(dev, *pgmv)                    # built once, as a training loop would
    count, _ = fused.ce_setup(dev, t, V, "sum", -100)     # the targets' one host copy, here
    _, mean, rstd = fused.layernorm_forward(dev, x, w, b)
    _, _, u_rstd, u_xhat = un.layernorm_forward(dev, x, w, b)     # what the unfused bwd needs
    y = fused.softmax_forward(dev, S, scale)
    with rig.twins():
        ln, ge, sm = _ctx(LayerNorm, x, w, b), _ctx(Gelu, x + b), \
            _ctx(Softmax, xp.where(mask, S * scale, -np.inf))
        ce = _ctx(CrossEntropy, logits, t=t, ignore_index=-100, reduction="sum")

    def attention_twin():
        s = xp.where(mask, (q @ k.transpose(0, 2, 1)) * scale, -np.inf)
        return Softmax.forward(Context(), s) @ v
    return [
        ("layernorm forward", lambda: fused.layernorm_forward(dev, x, w, b),
         lambda: LayerNorm.forward(Context(), x, w, b),
         lambda: un.layernorm_forward(dev, x, w, b), oc.layernorm(N, C, 4)),
        ("layernorm backward", lambda: fused.layernorm_backward(dev, dy, x, w, mean, rstd),
         lambda: LayerNorm.backward(ln, dy),
         lambda: un.layernorm_backward(dev, dy, u_xhat, w, u_rstd),
         oc.layernorm_backward(N, C, 4)),
        ("bias + gelu forward", lambda: fused.bias_gelu_forward(dev, x, b),
         lambda: Gelu.forward(Context(), x + b), lambda: un.bias_gelu_forward(dev, x, b),
         oc.bias_gelu(N, C, 4)),
        ("bias + gelu backward", lambda: fused.bias_gelu_backward(dev, dy, x, b),
         lambda: Gelu.backward(ge, dy)[0].sum(axis=0),
         lambda: un.bias_gelu_backward(dev, dy, x, b), oc.bias_gelu_backward(N, C, 4)),
        ("causal softmax", lambda: fused.softmax_forward(dev, S, scale),
         lambda: Softmax.forward(Context(), xp.where(mask, S * scale, -np.inf)),
         lambda: un.softmax_forward(dev, S, scale), oc.scaled_masked_softmax(BH * T, T, 4)),
        ("causal softmax backward", lambda: fused.softmax_backward(dev, S, y, scale),
         lambda: xp.where(mask, Softmax.backward(sm, S)[0], 0) * scale,
         lambda: un.softmax_backward(dev, S, y, scale),
         oc.scaled_masked_softmax_backward(BH * T, T, 4)),
        ("cross-entropy + grad", lambda: fused.cross_entropy(dev, logits, t, reduction="sum",
                                                          count=count),
         lambda: (CrossEntropy.forward(Context(), logits, t=t, ignore_index=-100,
                                       reduction="sum"), CrossEntropy.backward(ce, 1.0)),
         lambda: un.cross_entropy(dev, logits, t, reduction="sum", count=count),
         (oc.cross_entropy(NV, V, 4)[0], oc.cross_entropy(NV, V, 4)[1]
          + oc.cross_entropy_backward(NV, V, 4)[1])),
        (f"adamw ({len(sizes)} tensors)", lambda: fused.adamw_multi_tensor(dev, *pgmv, table=table,
                                                                    **hyper),
         lambda: [adamw_step(*a, **hyper) for a in zip(*pgmv)],
         lambda: un.adamw(dev, *pgmv, **hyper), oc.adamw(sizes, 4)),
        (f"attention T={T} D={D}", lambda: fused.flash_attention_forward(dev, q, k, v),
         attention_twin, lambda: un.attention_forward(dev, q, k, v), oc.attention(1, BH, T, D, 4)),
    ]


def _ctx(function, *arrays, **kwargs):
    """The context `function`'s forward leaves on `arrays`, for timing its backward."""
    ctx = Context()
    ctx.needs_input_grad = (True,) * len(arrays)
    function.forward(ctx, *arrays, **kwargs)
    return ctx


def fusion(rig: Rig) -> Part:
    """Fused kernel vs its twin's NumPy passes on CuPy (and vs unfused.cu), beside the
    speedup the roofline predicts: the ratio of the op's two bounds on the H200 (the byte
    ratio where the op is memory-bound)."""
    roof = h200("float32")
    p = Part("fusion")
    p.rows = [f"  {'op (ms)':<26}{'fused':>9}{'twin':>9}{'.cu':>9}{'speedup':>9}"
              f"{'predicted':>10}{'launches':>10}"]
    short = []
    for name, fast, twin, slow, (fk, uk) in fusion_ops(rig):
        op = Op(name, "forward", 1, fk, uk)
        with rig.twins():
            ms_twin = rig.ms(twin)
            timings = [rig.last()]
        ms = rig.ms(fast)
        timings.append(rig.last())
        ms_cu = rig.ms(slow)
        timings.append(rig.last())
        # speedup: the twin's time over the fused kernel's; .cu: unfused.cu's sequence
        predicted = roof.seconds(op, "unfused") / roof.seconds(op)
        host_bound = not all(t is None or t.hidden for t in timings)
        if ms_twin / ms < 0.7 * predicted:
            short.append(name)
        p.rows.append(f"  {name:<26}{ms:>9.3f}{ms_twin:>9.3f}{ms_cu:>9.3f}"
                      f"{ms_twin / ms:>8.1f}x{predicted:>9.1f}x"
                      f"{op.launches('fused'):>5}/{op.launches('unfused')}"
                      + ("  host-bound" if host_bound else ""))
    p.ok = not short
    p.summary = (f"{len(p.rows) - 1 - len(short)} of {len(p.rows) - 1} fused ops reach 0.7 x "
                 "the predicted speedup over their twin's passes"
                 + (f"; short: {', '.join(short)}" if short else "")
                 + ("; host-bound: a row's host enqueueing outlasted the hold (its time "
                    "includes host time)" if any("host-bound" in r for r in p.rows) else ""))
    return p


def bandwidth(rig: Rig) -> Part:
    """Read and copy over rig.sizes["bandwidth_set"] (1 GB; gpu/hierarchy.py), and fused
    kernels in compulsory B/s, against the H200's 4.8 TB/s."""
    z = rig.sizes
    size = z["bandwidth_set"]
    (_, read), (_, copy) = gpu_bandwidth((size,), z["loads"], rig.device, rig.timer)  # GB/s
    label = f"{size / GB:g} GB" if size >= GB else f"{size / MB:g} MB"
    rates = {f"read (bandwidth_read, {label})": (read * 1e9, None),
             f"copy (bandwidth_copy, {label})": (copy * 1e9, 0.8)}
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


def ladder(rig: Rig) -> Part:
    """The SGEMM ladder (gpu/hierarchy.py) at n^3 as % of cupy.matmul in FP32 and of the
    H200's FP32 peak (hardware/roofline.py)."""
    n, peak = rig.sizes["ladder_n"], h200("float32").vector / 1e9          # GFLOP/s
    rows = gpu_ladder(n, dev=rig.device, timer=rig.timer)                  # cuBLAS last
    cublas, p = rows[-1][1], Part("ladder")
    p.rows = [f"  {'rung (kernel)':<48}{'GFLOP/s':>9}{'cuBLAS':>8}{'peak':>7}  error"] + [
        f"  {label:<48}{gflops:>9.0f}{gflops / cublas:>8.1%}{gflops / peak:>7.1%}  {err:.1e}"
        for label, gflops, err in rows]
    rungs = rows[:-1]
    rising = all(b[1] >= a[1] for a, b in zip(rungs, rungs[1:]))
    worst, last = max(err for _, _, err in rungs), rungs[-1][1] / cublas
    p.ok = rising and worst <= 1e-4 and last >= 0.5
    p.summary = (f"{len(rungs)} rungs at {n}^3 {'rise' if rising else 'do NOT rise'} rung by "
                 f"rung; the last reaches {last:.0%} of cupy.matmul FP32 (target >= 50 %) and "
                 f"{rungs[-1][1] / peak:.0%} of the {peak / 1e3:.1f} TFLOP/s FP32 peak; max "
                 f"error {worst:.1e} (<= 1e-4)")
    return p


def latency_verdict(lat: list[tuple[int, float]], l2: int) -> tuple[bool, str]:
    """(ok, why) of the latency sweep: beyond 4 x L2 (HBM) the median latency is >= 1.5 x
    that of the sets of L2/16 .. L2/4 (L2 hits), which is >= 2 x the smallest set's (L1).
    A flat curve past the L2 (every set served from L2) fails."""
    in_l2 = [ns for size, ns in lat if l2 / 16 <= size <= l2 / 4]
    beyond = [ns for size, ns in lat if size >= 4 * l2]
    if not in_l2 or not beyond:
        return False, (f"the working sets do not reach both L2/16 .. L2/4 and >= 4 x L2 "
                       f"(L2 = {l2 / MB:g} MB): extend the sweep")
    l1_ns, l2_ns, hbm_ns = lat[0][1], float(np.median(in_l2)), float(np.median(beyond))
    ok = hbm_ns >= 1.5 * l2_ns and l2_ns >= 2 * l1_ns
    return ok, (f"latency {l1_ns:.0f} ns (smallest set) -> {l2_ns:.0f} ns (L2/16 .. L2/4) -> "
                f"{hbm_ns:.0f} ns (>= 4 x L2 = {4 * l2 / MB:g} MB); want x2 into L2 and x1.5 "
                "beyond it")


def hierarchy(rig: Rig) -> Part:
    """Latency and read bandwidth over the working sets (16 KB .. 1 GB): the cache plateaus,
    judged against the device's own L2 size (latency_verdict)."""
    z, dev, timer = rig.sizes, rig.device, rig.timer
    sets = z["working_sets"]
    l2 = int(dev.cp.cuda.Device().attributes["L2CacheSize"])
    lat, p = gpu_latency(sets, z["hops"], dev, timer), Part("hierarchy")
    bw = gpu_bandwidth(sets, z["loads"], dev, timer)[:-1]         # the last row is the copy
    p.rows = [f"  {size / KB:>12,.0f} KB {ns:>9.1f} ns {gbs:>9.0f} GB/s"
              + ("  <- L2" if size <= l2 < 2 * size else "")
              for (size, ns), (_, gbs) in zip(lat, bw)]
    ok, why = latency_verdict(lat, l2)
    p.ok = ok and bw[0][1] >= 1.5 * bw[-1][1]
    p.summary = (f"{why}; read bandwidth {bw[0][1]:.0f} -> {bw[-1][1]:.0f} GB/s (want /1.5); "
                 "every chase and read result checked")
    return p


def training(rig: Rig, steps: int = 3, batch: int = 16) -> Part:
    """`steps` AdamW steps of a tiny GPT through backend.xp = rig.backend, against NumPy."""
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
    """PARTS[name](rig), its rows and verdict printed; an exception is that part's MISMATCH.
    The part ends with a synchronize, so its own asynchronous errors are its own; then
    `context_lost` says whether the device still answers (a sticky error: it does not)."""
    t0 = time.perf_counter()
    print(f"\n== {name} ==", flush=True)
    try:
        part = PARTS[name](rig)
        rig.sync()                                 # this part's kernels end inside it
    except Exception as e:                         # a broken part must not hide the others
        part = Part(name, False, f"raised {type(e).__name__}: {' '.join(str(e).split())}")
    part.context_lost = not rig.alive()
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


def run_parts(parts: list[str], rig: Rig) -> list[Part]:
    """run_part for each name in order; after a part that lost the CUDA context, stop and
    say which parts did not run and how to run them."""
    results = []
    for k, name in enumerate(parts):
        results.append(run_part(name, rig))
        if results[-1].context_lost:
            rest = parts[k + 1:]
            print(f"\ngpu check: stopped after {name}: the CUDA context is lost (a sticky "
                  "error: every later CUDA call fails, so later parts would report it under "
                  f"their own names)." + (f" Not run: {', '.join(rest)}; run them in a fresh "
                                          f"process: python -m minidist gpu check --parts "
                                          f"{','.join(rest)}" if rest else ""))
            break
    return results


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist gpu check [--parts a,b] [--dry-run]`: the exit code (module doc)."""
    p = CliParser(prog="python -m minidist gpu check", description=(
        "Check the GPU path on this machine's GPU: kernels against their NumPy twins, "
        "fusion, bandwidth, the SGEMM ladder, the memory hierarchy and GPT training steps. "
        f"Exit {EXIT_OK}: every part OK; {EXIT_MISMATCH}: a part mismatched; "
        f"{EXIT_NO_GPU}: no GPU (nothing checked); {EXIT_NO_CUDA_LIBRARIES}: CuPy without "
        "its CUDA libraries."))
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, in order (default all: {','.join(PARTS)})")
    p.add_argument("--dry-run", action="store_true",
                   help="run every part on the CPU through a stand-in device (gpu/standin.py): "
                        "small sizes, kernels on the emulator, MODELED times")
    a = p.parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    if not parts or set(parts) - set(PARTS):
        p.exit(2, f"error: --parts {a.parts!r}: unknown {sorted(set(parts) - set(PARTS))}; "
                  f"choose from {', '.join(PARTS)}\n")
    if a.dry_run:
        return dry_run(parts)
    cp, why, code = gpu_status()
    if cp is None:
        text = NO_LIBRARIES if code == EXIT_NO_CUDA_LIBRARIES else SKIPPED
        print(text.format(why=" ".join(why.split())))
        return code
    print(f"gpu check · {describe(cp)}", flush=True)
    rig = Rig(cp, fused.CupyDevice())
    if rig.timer is not None:
        print(rig.timer.describe(), flush=True)
    results = run_parts(parts, rig)
    bad = [r.name for r in results if not r.ok]
    print(f"\ngpu check: {len(results) - len(bad)} of {len(parts)} parts OK"
          + (f"; MISMATCH in {', '.join(bad)}" if bad else ""))
    return EXIT_MISMATCH if bad or len(results) < len(parts) else EXIT_OK


def dry_run(parts: list[str]) -> int:
    """Every part through gpu/standin.py: 0 when each part ran to its verdict."""
    if compiler_missing():
        print(f"gpu check --dry-run: cannot run the kernels on the CPU: {compiler_missing()}")
        return EXIT_MISMATCH
    rig = stand_in_rig()
    print("gpu check --dry-run · stand-in device: NumPy arrays, kernels on the CPU emulator, "
          "every launch checked · small sizes · times are MODELED, not measured", flush=True)
    print(rig.timer.describe(), flush=True)
    results = run_parts(parts, rig)
    raised = [r.name for r in results if r.summary.startswith("raised ")]
    ok = sum(r.ok for r in results)
    print(f"\ngpu check --dry-run: {len(results)} of {len(parts)} parts ran, {ok} OK "
          "(performance verdicts come from modeled times: only the kernels' results, the "
          "checks and the launches mean something here)"
          + (f"; RAISED in {', '.join(raised)}" if raised else ""))
    return EXIT_MISMATCH if raised or len(results) < len(parts) else EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
