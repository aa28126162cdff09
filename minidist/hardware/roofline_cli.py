"""The roofline on this machine: measured roofs, NumPy ops timed against their bounds, the CLI.

`python -m minidist roofline` prints the tables of hardware/roofline.py and draws the PNG.

A CPU has no data sheet that NumPy reaches, so its roofs are measured, one thread as
every rank runs: the compute roof is NumPy's matmul FLOP/s (observe/peak.py, cached per
CPU, NumPy version and dtype), the memory roof the best of three streaming patterns
(copy, read, write) over arrays twice the size of the last-level cache.

The check that keeps the counts honest: every NumPy op, run at sizes well beyond the
caches, must take at least its roofline bound, max(FLOPs / peak, bytes / bandwidth) with
the bytes its unfused passes move (hardware/op_costs.py): nothing beats the roof. A pass
count that is too high would put the bound above the measured time. The roofs of that
check are the best rates measured in the same run, times SLACK, so that a clock boost or a
quiet moment during an op cannot fail it; a count wrong by more than SLACK still does.

One run's view (`main`):
    1. build the op list of the model (roofline.gpt_ops) at --batch, --seq, --precision;
    2. print the counts: FLOPs, bytes fused and unfused, launches, intensity;
    3. place every op on the H200's roofs and, unless --no-cpu, on this CPU's;
    4. with matplotlib (the `plot` extra), draw both rooflines and the ops into --png.

Shapes: the timed NumPy ops take ~`elements` numbers per array (rows of C = 1024; attention
(1, H, 1024, 64) with H = elements / 2^20; matmul (n, n)). No communication: one thread.
Reference: Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4) (measured roofs:
    a STREAM-like bandwidth and the peak of the best kernel).
Read next: gpu/kernels/ (the fused kernels these counts describe), demos/27_roofline.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from minidist.autograd import Tensor, no_grad
from minidist.autograd.tensor import Context
from minidist.autograd.fused import CrossEntropy, Gelu, LayerNorm, Softmax
from minidist.cli import CliParser, at_least, cli_error, file_path
from minidist.data import DataConfig, model_config_for
from minidist.hardware import op_costs as oc
from minidist.hardware.roofline import (PRECISIONS, Op, Roof, gpt_ops, h200, step_seconds,
                                        totals)
from minidist.memory.budget_models import preset
from minidist.nn.attention import attention_core
from minidist.nn.layers import Dropout
from minidist.observe.peak import peak_flops
from minidist.optim.adamw import adamw_step

CACHE_BYTES = 32 << 20          # a last-level cache this size or smaller is streamed past
SLACK = 1.5                     # roofs of the check = best measured rate x SLACK


def measure_bandwidth(nbytes: int = 2 * CACHE_BYTES, repeats: int = 5) -> dict[str, float]:
    """Best B/s of copy (counted 2 x nbytes), read (a sum) and write (a fill) of float64
    arrays of nbytes: {"copy", "read", "write"}."""
    n = max(1, nbytes // 8)
    src, dst = np.ones(n), np.empty(n)
    patterns = {"copy": (lambda: np.copyto(dst, src), 2), "read": (src.sum, 1),
                "write": (lambda: dst.fill(1.0), 1)}
    return {name: passes * 8 * n / best_seconds(run, repeats)
            for name, (run, passes) in patterns.items()}


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The shortest of `repeats` timed calls of run(), after one untimed warm-up call."""
    run()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_roof(dtype: str = "float32", *, peak_size: int = 1024, path: str | None = None,
             bandwidth: float | None = None) -> Roof:
    """This CPU's roofs for one thread: matmul FLOP/s from observe/peak.py (cached at
    `path`), also taken as the vector roof, and the best streaming bandwidth (measured
    now unless given)."""
    peak = peak_flops(dtype, n=peak_size, path=path).flops
    bw = max(measure_bandwidth().values()) if bandwidth is None else bandwidth
    return Roof(f"this CPU {dtype} (1 thread)", peak, peak, bw, overlap=False)


@dataclass(frozen=True)
class Timed:
    """One NumPy op at a fixed size: its costs, and the seconds it took (best of k)."""

    name: str
    op: Op
    seconds: float


def numpy_ops(dtype: str = "float32", elements: int = 1 << 24, gemm_n: int = 1024
              ) -> list[tuple[str, Op, Callable[[], object]]]:
    """(name, costs, run) of the NumPy twins at ~`elements` per array, C = 1024 rows."""
    s, C, rng = np.dtype(dtype).itemsize, 1024, np.random.default_rng(0)
    R = max(1, elements // C)
    x, g = (rng.standard_normal((R, C), dtype) for _ in range(2))
    w, b = np.ones(C, dtype), np.zeros(C, dtype)
    a, bm = (rng.standard_normal((gemm_n, gemm_n), dtype) for _ in range(2))
    t = rng.integers(0, C, R)
    H, T, D = max(1, elements // (1024 * 1024)), 1024, 64           # B = 1: H T^2 scores
    q, k, v = (Tensor(rng.standard_normal((1, H, T, D), dtype)) for _ in range(3))
    pos = np.arange(T)
    ln, sm, ge = _ctx(LayerNorm, x, w, b), _ctx(Softmax, x), _ctx(Gelu, x)
    p, m, vv = x.copy(), np.zeros_like(x), np.zeros_like(x)

    def attend():
        with no_grad():
            attention_core(q, k, v, pos, pos, Dropout(0.0), None, 0, H, T)

    def op(name, phase, kernels):
        return Op(name, phase, 1, *kernels)
    return [
        ("matmul", op("matmul", "forward", oc.gemm(gemm_n, gemm_n, gemm_n, s)),
         lambda: a @ bm),
        ("layernorm", op("layernorm", "forward", oc.layernorm(R, C, s)),
         lambda: LayerNorm.forward(Context(), x, w, b)),
        ("layernorm bwd", op("layernorm", "backward", oc.layernorm_backward(R, C, s)),
         lambda: LayerNorm.backward(ln, g)),
        ("softmax", op("softmax", "forward", oc.softmax(R, C, s)),
         lambda: Softmax.forward(Context(), x)),
        ("softmax bwd", op("softmax", "backward", oc.softmax_backward(R, C, s)),
         lambda: Softmax.backward(sm, g)),
        ("gelu", op("gelu", "forward", oc.bias_gelu(R, C, s, bias=False)),
         lambda: Gelu.forward(Context(), x)),
        ("gelu bwd", op("gelu", "backward", oc.bias_gelu_backward(R, C, s, bias=False)),
         lambda: Gelu.backward(ge, g)),
        ("cross-entropy", op("cross-entropy", "forward", oc.cross_entropy(R, C, s)),
         lambda: CrossEntropy.forward(Context(), x, t=t, ignore_index=-100, reduction="sum")),
        ("adamw", op("adamw", "optimizer", oc.adamw([R * C], s)),
         lambda: adamw_step(p, g, m, vv, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, t=1)),
        ("attention", op("attention", "forward", oc.attention(1, H, T, D, s)), attend),
    ]


def _ctx(function, *inputs):
    """The context a forward leaves, for timing the backward alone."""
    ctx = Context()
    ctx.needs_input_grad = (True,) * len(inputs)
    function.forward(ctx, *inputs)
    return ctx


def measured_roof(dtype: str = "float32", gemm_n: int = 1024, repeats: int = 3) -> Roof:
    """This CPU's roofs measured now as the BEST of `repeats` runs (not observe/peak.py's
    cached median: a roof measured while another process held the core would be too low
    and make an op seem to beat it): an (n, n) matmul and the streaming patterns."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((gemm_n, gemm_n), dtype) for _ in range(2))
    out = np.empty_like(a)
    peak = 2.0 * gemm_n ** 3 / best_seconds(lambda: np.matmul(a, b, out=out), repeats)
    bw = max(measure_bandwidth(repeats=repeats).values())
    return Roof(f"this CPU {dtype} (1 thread)", peak, peak, bw, overlap=False)


def higher(r1: Roof, r2: Roof) -> Roof:
    """The higher of two measurements of the same roofs, rate by rate."""
    return Roof(r1.name, max(r1.matmul, r2.matmul), max(r1.vector, r2.vector),
                max(r1.bandwidth, r2.bandwidth), r1.overlap)


def time_numpy_ops(dtype: str = "float32", elements: int = 1 << 24, repeats: int = 2,
                   roof: Roof | None = None) -> tuple[list[Timed], Roof]:
    """Each NumPy twin of numpy_ops, best of `repeats` timed runs, and this CPU's roofs:
    the higher of a measurement before the ops and one after (and `roof`, if given), so
    that a busy moment during either cannot lower them."""
    before = measured_roof(dtype, repeats=3)
    timed = [Timed(name, op, best_seconds(run, repeats))
             for name, op, run in numpy_ops(dtype, elements)]
    after = higher(before, measured_roof(dtype, repeats=3))
    return timed, after if roof is None else higher(after, roof)


def beats_roof(timed: list[Timed], roof: Roof, slack: float = SLACK) -> list[Timed]:
    """The ops that ran faster than their unfused bound on `roof` with its rates x slack
    (an empty list: nothing beats the roof)."""
    fast = Roof(roof.name, roof.matmul * slack, roof.vector * slack, roof.bandwidth * slack,
                roof.overlap)
    return [t for t in timed if t.seconds < fast.seconds(t.op, "unfused")]


# --- the table and the picture ----------------------------------------------------------

def si(x: float, unit: str = "") -> str:
    """x with 3 significant digits and an SI prefix: 1.23G, 45.6u, 0."""
    if x == 0:
        return "0" + unit
    exp = min(4, max(-3, int(math.floor(math.log10(abs(x)) / 3))))
    return f"{x / 1000 ** exp:.3g}{'num kMGT'[exp + 3].strip()}{unit}"


def counts_table(ops: list[Op]) -> list[str]:
    """Per op: runs per step, FLOPs, bytes fused and unfused, launches, FLOP/B fused."""
    lines = [f"{'op':<18}{'phase':<10}{'x':>3}{'FLOPs':>9}{'bytes fused':>13}"
             f"{'unfused':>9}{'ratio':>7}{'launches f/u':>14}{'FLOP/B':>8}"]
    for o in ops:
        bf, bu = o.bytes("fused"), o.bytes("unfused")
        lines.append(f"{o.name:<18}{o.phase:<10}{o.times:>3}{si(o.flops()):>9}{si(bf):>13}"
                     f"{si(bu):>9}{f'{bu / bf:.1f}x' if bf else '-':>7}"
                     f"{o.launches('fused'):>7}/{o.launches('unfused'):<6}"
                     f"{o.intensity():>8.2f}")
    f, u = totals(ops, "fused"), totals(ops, "unfused")
    lines.append(f"{'step total':<31}{si(f['flops']):>9}{si(f['bytes']):>13}"
                 f"{si(u['bytes']):>9}{u['bytes'] / f['bytes']:>6.1f}x"
                 f"{f['launches']:>7}/{u['launches']:<6}{f['flops'] / f['bytes']:>8.2f}")
    return lines


def roofs_table(ops: list[Op], roofs: list[Roof]) -> list[str]:
    """Per op and roof: the bound in seconds, fused and unfused, and what limits it."""
    head = f"{'op':<18}{'phase':<10}"
    for i, _ in enumerate(roofs):
        head += f"{f'[{i + 1}] fused':>11}{'unfused':>9}{'bound':>9}"
    lines = [head]
    for o in ops:
        row = f"{o.name:<18}{o.phase:<10}"
        for r in roofs:
            row += (f"{si(r.seconds(o), 's'):>11}{si(r.seconds(o, 'unfused'), 's'):>9}"
                    f"{r.limit(o):>9}")
        lines.append(row)
    row = f"{'step total':<28}"
    for r in roofs:
        row += (f"{si(step_seconds(ops, r), 's'):>11}"
                f"{si(step_seconds(ops, r, 'unfused'), 's'):>9}{'':>9}")
    lines.append(row)
    return lines + [f"[{i + 1}] {r.name}: {si(r.matmul)}FLOP/s matmul, {si(r.vector)}FLOP/s "
                    f"other, {si(r.bandwidth)}B/s; ridge {r.ridge():.1f} FLOP/B"
                    for i, r in enumerate(roofs)]


def attainable(op: Op, roof: Roof, variant: str = "fused") -> float:
    """FLOP/s the op can reach on `roof`: its FLOPs over its bound."""
    t = roof.seconds(op, variant)
    return op.flops(variant) / t if t else 0.0


_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def plot(ops: list[Op], roofs: list[Roof], path: str, title: str) -> None:
    """The rooflines (matmul solid, vector dashed) and each op at (FLOP/B, FLOP/s), fused
    filled and unfused hollow, into a PNG at `path` (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 6.5))
    grid = np.logspace(-2, 4, 200)
    for r, color in zip(roofs, ("tab:green", "tab:blue")):
        ax.plot(grid, np.minimum(r.matmul, grid * r.bandwidth), color=color, label=r.name)
        ax.plot(grid, np.minimum(r.vector, grid * r.bandwidth), color=color, ls="--", lw=0.8)
        for o in ops:
            for variant, face in (("fused", color), ("unfused", "none")):
                if o.kernels(variant) and o.intensity(variant) > 0:
                    ax.scatter(o.intensity(variant), attainable(o, r, variant), s=18,
                               edgecolors=color, facecolors=face)
            if o.fused:
                ax.annotate(f"{o.name} {_SHORT[o.phase]}", (o.intensity(), attainable(o, r)),
                            fontsize=6, xytext=(3, -3), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="attainable FLOP/s", title=title)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")     # at `path` itself, suffix or not
    plt.close(fig)


def _arguments():
    p = CliParser(prog="python -m minidist roofline", description=(
        "FLOPs, compulsory bytes and launches of every op of a GPT training step, fused and "
        "unfused, and their bounds on the H200's roofs and this CPU's."))
    p.add_argument("--model", default="tiny",
                   help="'tiny' (the GPT of `python -m minidist train`) or a GPT-3 size: "
                        "gpt3-125m, gpt3-350m, ..., gpt3-175b (memory/budget_models.py)")
    p.add_argument("--batch", type=at_least(1), default=None,
                   help="sequences per step (default 32 for tiny, 8 for a GPT-3 size)")
    p.add_argument("--seq", type=at_least(1), default=None, help="T (default block_size)")
    p.add_argument("--precision", default="float32", choices=list(PRECISIONS))
    tiny = p.add_argument_group("the tiny GPT (--model tiny)")
    tiny.add_argument("--task", default="sort", choices=["copy", "reverse", "sort", "add"])
    tiny.add_argument("--length", type=at_least(1), default=6)
    tiny.add_argument("--n-layer", type=at_least(1), default=2)
    tiny.add_argument("--n-embd", type=at_least(1), default=32)
    tiny.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--no-cpu", action="store_true",
                   help="leave out this CPU's roofs (they take ~1 s to measure)")
    p.add_argument("--peak-cache", type=file_path, default=None,
                   help="observe/peak.py's cache file")
    p.add_argument("--png", type=file_path, default="roofline.png",
                   help="the picture (needs matplotlib)")
    p.add_argument("--no-png", action="store_true", help="write no picture")
    return p


def _model(a):
    """(GPTConfig, batch, one-line name) of the parsed --model options."""
    if a.model != "tiny":              # imported only here: it imports the parallel layers
        return preset(a.model), a.batch or 8, a.model
    cfg = model_config_for(DataConfig(task=a.task, length=a.length), n_layer=a.n_layer,
                           n_embd=a.n_embd, n_head=a.n_head, dtype="float32")
    return cfg, a.batch or 32, (f"tiny GPT ({cfg.n_layer} layers, C={cfg.n_embd}, "
                                f"H={cfg.n_head}, V={cfg.vocab_size}, task {a.task})")


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist roofline`: print the tables, write the PNG; exit code."""
    a = _arguments().parse_args(argv)
    try:
        cfg, batch, name = _model(a)
        ops = gpt_ops(cfg, batch, a.seq, a.precision)
    except ValueError as e:
        return cli_error(e)
    T = a.seq or cfg.block_size
    print(f"roofline · {name} · batch {batch} x T={T} · {a.precision} · AdamW")
    print("\nper training step (fused: compulsory bytes, one kernel per op; unfused: one "
          "kernel per NumPy pass):")
    print("\n".join(counts_table(ops)))
    roofs = [h200(a.precision)]
    if not a.no_cpu:
        roofs.append(cpu_roof("float64" if a.precision == "float64" else "float32",
                              path=a.peak_cache))
    print("\nbound per step, max(FLOPs / peak, bytes / bandwidth) per kernel, on each roof:")
    print("\n".join(roofs_table(ops, roofs)))
    for i, r in enumerate(roofs, start=1):
        memory = sum(r.limit(o) == "memory" for o in ops if o.fused)
        gain = step_seconds(ops, r, "unfused") / step_seconds(ops, r)
        print(f"[{i}] memory-bound: {memory} of {sum(1 for o in ops if o.fused)} ops; fusion "
              f"lowers the step's bound {gain:.2f}x")
    if not a.no_png:
        try:
            plot(ops, roofs, a.png, f"roofline · {name} · {a.precision}")
            print(f"wrote {a.png}")
        except ImportError:
            print("no PNG: matplotlib is not installed (pip install -e '.[plot]')")
    return 0


if __name__ == "__main__":          # `python -m minidist roofline` also pins BLAS to 1 thread
    raise SystemExit(main())
