"""Kernel fusion: the same math in one kernel instead of many, counted in bytes and launches.

What you will see: (1) each fused op of the GPT at GPT-2 small's sizes (LayerNorm, bias +
GELU, causal softmax, cross-entropy with its gradient, AdamW over all 148 arrays in one
launch, FlashAttention): the bytes its one kernel must move (inputs read once, outputs
written once) against those of the twin's NumPy passes, each writing its result to memory
for the next to read back; the launches; the speedup the H200's roofline predicts. (2) the
fused kernels and gpu/kernels/unfused.cu's simple ones (one per step) on CPU threads in the
emulator, against float64 twins, with the launches it counts. (3) GPU timings, if any.

Run:       python demos/29_kernel_fusion.py [--tokens 8192 --width 768 --seq 1024]
Read with: minidist/hardware/op_costs.py, minidist/gpu/fused.py, minidist/gpu/unfused.py,
           minidist/gpu/kernels/layernorm.cu (and the other fused kernels), gpu/twins.py
Paper:     Dao et al. 2022, "FlashAttention", arXiv:2205.14135, Sec. 3 (IO-awareness)
"""

import argparse
import os
import sys
import textwrap

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from minidist.cli import CliParser                                # noqa: E402
from minidist.hardware import op_costs as oc  # noqa: E402
from minidist.hardware.roofline import Op, h200, parameter_sizes  # noqa: E402
from minidist.hardware.roofline_cli import si  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402

# --- settings (each can be overridden on the command line) ---
TOKENS, WIDTH, HEADS, SEQ, VOCAB, SEED = 8192, 768, 12, 1024, 50257, 0


# each number option's (low, high): the demo stays small
LIMITS = dict(tokens=(1, 1 << 24), width=(1, 1 << 16), heads=(1, 1024), seq=(1, 1 << 20),
              vocab=(1, 1 << 20), seed=(0, 2 ** 32))


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_numbers(dict(tokens=TOKENS, width=WIDTH, heads=HEADS, seq=SEQ, vocab=VOCAB,
                        seed=SEED), LIMITS)
    a = ap.parse_args(argv)
    if a.width % a.heads:
        ap.error(f"--width {a.width} is not a multiple of --heads {a.heads}")
    return a


def counted(a) -> list[Op]:
    """The fused ops at these sizes, as hardware/op_costs.py counts them."""
    N, C, H, T, V = a.tokens, a.width, a.heads, a.seq, a.vocab
    B = max(1, N // T)
    sizes = parameter_sizes(GPTConfig(vocab_size=V, block_size=T, n_layer=12, n_head=H,
                                      n_embd=C))
    ce = oc.cross_entropy(N, V, 4)
    return [Op(name, "step", 1, *pair) for name, pair in (
        ("layernorm", oc.layernorm(N, C, 4)), ("layernorm bwd", oc.layernorm_backward(N, C, 4)),
        ("bias + gelu", oc.bias_gelu(N, 4 * C, 4)),
        ("bias + gelu bwd", oc.bias_gelu_backward(N, 4 * C, 4)),
        ("causal softmax", oc.scaled_masked_softmax(B * H * T, T, 4)),
        ("causal softmax bwd", oc.scaled_masked_softmax_backward(B * H * T, T, 4)),
        ("cross-entropy+grad", (ce[0], ce[1] + oc.cross_entropy_backward(N, V, 4)[1])),
        (f"adamw ({len(sizes)})", oc.adamw(sizes, 4)),
        ("attention", oc.attention(B, H, T, C // H, 4)))]


def emulated(ops: list[Op], seed: int) -> tuple[list[str], float, list[str]]:
    """Rows of part (2), the worst error / tolerance, and the ops whose fused launches
    (counted by the emulator) differ from the roofline's."""
    from minidist.gpu import fused as fu, twins, unfused as un
    from minidist.gpu.emulate.cases import TOL, TOL_ATTENTION, rel_error
    from minidist.gpu.emulate.runner import Emulator
    r, f32, emu = np.random.default_rng(seed), np.float32, Emulator()
    x, dy, z, b = (r.standard_normal(shape, f32) for shape in ((7, 100), (7, 100), (9, 100),
                                                                 100))   # N x C, N x V, C
    w, S = (1 + 0.1 * r.standard_normal(100)).astype(f32), r.standard_normal((2, 13, 13), f32)
    t, (q, k, v) = r.integers(0, 100, 9).astype(np.int32), r.standard_normal((3, 2, 45, 16), f32)
    pgmv = [[r.standard_normal(n, f32) for n in (100, 37, 5)] for _ in range(3)] + \
        [[r.random(n, f32) for n in (100, 37, 5)]]                        # v >= 0
    hyper, sc, S2 = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, t=3), 0.35, S.reshape(26, 13)
    _, mean, rstd = fu.layernorm_forward(emu, x, w, b)
    y = twins.softmax_forward(S2, sc)["y"].astype(f32).reshape(S.shape)

    def adam(step):
        p, g, m, vv = ([a.copy() for a in arrays] for arrays in pgmv)
        step(emu, p, g, m, vv, **hyper)
        return np.concatenate(p)

    def ce(zz):
        fu.cross_entropy(emu, zz, t, reduction="sum")
        return zz                                                   # dz, written in place
    _, _, u_rstd, u_xhat = un.layernorm_forward(emu, x, w, b)   # the unfused bwd's inputs
    cases = [  # name: (fused(), unfused.cu() or None, the twin's output, tolerance)
        (lambda: fu.layernorm_forward(emu, x, w, b)[0],
         lambda: un.layernorm_forward(emu, x, w, b)[0], twins.layernorm_forward(x, w, b)["y"]),
        (lambda: fu.layernorm_backward(emu, dy, x, w, mean, rstd)[0],
         lambda: un.layernorm_backward(emu, dy, u_xhat, w, u_rstd)[0],
         twins.layernorm_backward(dy, x, w, b)["dx"]),
        (lambda: fu.bias_gelu_forward(emu, x, b), lambda: un.bias_gelu_forward(emu, x, b),
         twins.bias_gelu_forward(x, b)["y"]),
        (lambda: fu.bias_gelu_backward(emu, dy, x, b)[0],
         lambda: un.bias_gelu_backward(emu, dy, x, b)[0],
         twins.bias_gelu_backward(dy, x, b)["dx"]),
        (lambda: fu.softmax_forward(emu, S, sc), lambda: un.softmax_forward(emu, S, sc),
         y.reshape(26, 13)),
        (lambda: fu.softmax_backward(emu, S, y, sc), lambda: un.softmax_backward(emu, S, y, sc),
         twins.softmax_backward(S2, S2, sc)["dx"]),
        (lambda: ce(z.copy()), lambda: un.cross_entropy(emu, z, t, reduction="sum")[2],
         twins.cross_entropy(z, t, reduction="sum")["dlogits"]),
        (lambda: adam(fu.adamw_multi_tensor), lambda: adam(un.adamw),
         np.concatenate(twins.adamw(*pgmv, **hyper)["p"])),
        (lambda: fu.flash_attention_forward(emu, q, k, v)[0],
         lambda: un.attention_forward(emu, q, k, v), twins.attention(q, k, v)["o"])]
    rows, worst, wrong = [], 0.0, []
    for op, (fused, unfused, want) in zip(ops, cases):
        tol, cells = TOL_ATTENTION if op.name == "attention" else TOL, []
        for run in (fused, unfused):
            if run is None:
                cells.append("-")
                continue
            before = len(emu.launches)
            err = rel_error(np.asarray(run()).reshape(want.shape), want)
            launches, worst = len(emu.launches) - before, max(worst, err / tol)
            cells.append(f"{launches} launch{'es' * (launches > 1)}, error {err:.1e}")
            if run is fused and launches != op.launches("fused"):
                wrong.append(f"{op.name} ({launches} launches, counted {op.launches('fused')})")
        rows.append(f"  {op.name:<20}{cells[0]:<30}{cells[1]}")
    return rows, worst, wrong


def main() -> None:
    a = parse_args()
    ops, roof = counted(a), h200("float32")
    print(f"demo 29 · kernel fusion · {a.tokens} tokens, C={a.width}, {a.heads} heads, "
          f"T={a.seq}, V={a.vocab} · float32")
    print("\n(1) bytes and launches of one call, fused vs the twin's NumPy passes "
          "(hardware/op_costs.py):")
    print(f"  {'op':<20}{'fused':>9}{'unfused':>9}{'ratio':>8}{'launches':>12}"
          f"{'H200 fused':>12}{'speedup':>9}")
    for op in ops:
        bf, bu, sf = op.bytes("fused"), op.bytes("unfused"), roof.seconds(op)
        print(f"  {op.name:<20}{si(bf, 'B'):>9}{si(bu, 'B'):>9}{bu / bf:>7.1f}x"
              f"{op.launches('fused'):>6}/{op.launches('unfused'):<5}{si(sf, 's'):>12}"
              f"{roof.seconds(op, 'unfused') / sf:>8.1f}x")
    total = sum(o.bytes("unfused") for o in ops) / sum(o.bytes("fused") for o in ops)
    bound = [o.name for o in ops if roof.limit(o) == "compute"]
    print(f"  fusion moves {total:.1f}x fewer bytes over these ops; speedup: the ratio of the "
          "two bounds\n  on the H200 (the byte ratio where memory-bound; compute-bound fused: "
          f"{', '.join(bound) or 'none'})")

    from minidist.gpu.emulate.build import compiler_missing
    if compiler_missing() is None:
        print("\n(2) on the emulator (CPU threads, the same .cu source), against float64 "
              "twins:")
        print(f"  {'op':<20}{'fused kernel':<30}unfused.cu")
        rows, worst, wrong = emulated(ops, a.seed)
        print("\n".join(rows))
    else:
        worst, wrong = 0.0, []
        print(f"\n(2) emulator unavailable: {compiler_missing()}")

    from minidist.gpu.check import Rig, find_gpu, fusion
    cp, why = find_gpu()
    if cp is None:
        print(f"\n(3) timings: none here ({why});\n  `python -m minidist gpu check --parts "
              "fusion` times them on a GPU")
    else:
        from minidist.gpu.fused import CupyDevice
        print("\n(3) timings on this GPU:\n" + "\n".join(
            textwrap.fill(row, 100, subsequent_indent="    ")
            for row in fusion(Rig(cp, CupyDevice())).rows))

    if worst <= 1 and not wrong:
        print(f"worst error {worst:.2f} x tolerance; fused launches = the roofline's\n"
              "OK: fused and unfused kernels match their float64 twins; fusion moves "
              f"{total:.1f}x fewer bytes")
    else:
        print(f"MISMATCH: worst error {worst:.2f} x tolerance; launches differ: {wrong}")
    raise SystemExit(worst > 1 or bool(wrong))


if __name__ == "__main__":
    main()
