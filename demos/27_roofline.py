"""Arithmetic intensity: every op of a GPT training step under the H200's roofs and this CPU's.

What you will see: the ops of one training step of the tiny GPT (forward, backward, AdamW),
each with its FLOPs, its compulsory bytes fused into one kernel and the bytes of its
unfused NumPy passes, its launches and its intensity (FLOP/B); then each op's lower bound
in time on an H200 (data sheet) and on this CPU (measured, one thread), and whether memory
or compute sets it. On the H200 the tiny GPT is memory-bound everywhere; on this CPU
(ridge ~3 FLOP/B) its GEMMs are compute-bound; at GPT-3 125M size (--model gpt3-125m
--precision bf16) the H200's GEMMs and attention cross the ridge too. Last, the check that
keeps the counts honest: the NumPy twins, timed at 64 MB arrays, never run faster than
their roofline bound (rates x1.5 for timing noise): nothing beats the roof.

Run:       python demos/27_roofline.py [--model gpt3-125m --precision bf16 --elements 16777216]
Read with: minidist/hardware/roofline.py, minidist/hardware/op_costs.py,
           minidist/hardware/roofline_cli.py, minidist/observe/peak.py
Paper:     Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance
           model for multicore architectures", CACM 52(4)
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")           # one BLAS thread: the roofs are per thread

import argparse                                # noqa: E402
import sys                                     # noqa: E402
import textwrap                                # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minidist.cli import CliParser, at_least                      # noqa: E402
from minidist.hardware import roofline_cli as cli   # noqa: E402
from minidist.hardware.roofline import PRECISIONS, gpt_ops, h200  # noqa: E402
from minidist.memory.budget_models import GPT3_SHAPES              # noqa: E402

# --- settings (each can be overridden on the command line) ---
MODEL, BATCH, PRECISION, ELEMENTS, REPEATS = "tiny", 32, "float32", 1 << 24, 2
MAX_BATCH, MAX_ELEMENTS, MAX_REPEATS = 1 << 20, 1 << 26, 100   # the largest arrays: 512 MB
WIDTH = 100                                    # characters a line


def parse_args(argv=None) -> argparse.Namespace:
    ap = CliParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL, choices=["tiny", *GPT3_SHAPES],
                    help="'tiny' or a GPT-3 size, e.g. gpt3-125m")
    ap.add_argument("--batch", type=at_least(1), default=BATCH, help=f"1..{MAX_BATCH}")
    ap.add_argument("--precision", default=PRECISION, choices=list(PRECISIONS))
    ap.add_argument("--elements", type=at_least(1), default=ELEMENTS,
                    help=f"elements per array of the timed NumPy ops (keep it past the cache; "
                         f"at most {MAX_ELEMENTS:,})")
    ap.add_argument("--repeats", type=at_least(1), default=REPEATS, help=f"1..{MAX_REPEATS}")
    a = ap.parse_args(argv)
    if a.batch > MAX_BATCH or a.elements > MAX_ELEMENTS or a.repeats > MAX_REPEATS:
        ap.error(f"need --batch <= {MAX_BATCH}, --elements <= {MAX_ELEMENTS} and --repeats "
                 f"<= {MAX_REPEATS}")
    return a


def fit(lines: list[str]) -> str:
    """Table lines as they are; a longer line wrapped at WIDTH, the rest indented."""
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="    ")
                     if len(line) > WIDTH else line for line in lines)


def model(a):
    """(GPTConfig, name): the tiny GPT of `python -m minidist train`, or a preset."""
    if a.model != "tiny":
        from minidist.memory.budget_models import preset
        return preset(a.model), a.model
    from minidist.data import DataConfig, model_config_for
    cfg = model_config_for(DataConfig(task="sort", length=6), n_layer=2, n_embd=32, n_head=4,
                           dtype="float32")
    return cfg, "tiny GPT (2 layers, C=32, H=4)"


def main() -> None:
    a = parse_args()
    cfg, name = model(a)
    ops = gpt_ops(cfg, a.batch, precision=a.precision)
    cpu_dtype = "float64" if a.precision == "float64" else "float32"
    print(f"demo 27 · roofline · {name}, T={cfg.block_size}, V={cfg.vocab_size} · batch "
          f"{a.batch} · {a.precision}")
    print("\none training step, op by op (fused = compulsory bytes; unfused = NumPy passes):")
    print(fit(cli.counts_table(ops)))

    timed, cpu = cli.time_numpy_ops(cpu_dtype, a.elements, a.repeats)    # ~5 s: roofs too
    roofs = [h200(a.precision), cpu]
    print("\nlower bound of each op, max(FLOPs / peak, bytes / bandwidth) per kernel:")
    print(fit(cli.roofs_table(ops, roofs)))
    for i, r in enumerate(roofs, start=1):
        bound = sorted({o.name for o in ops if o.fused and r.limit(o) == "compute"})
        print(textwrap.fill(f"[{i}] compute-bound (the rest memory-bound): "
                            f"{', '.join(bound) or 'nothing'}", 92, subsequent_indent="    "))

    print(f"\nthe NumPy twins on this CPU at {a.elements:,} elements per array, best of "
          f"{a.repeats};\nbound = max(FLOPs / peak, bytes / bandwidth) of their unfused "
          "passes on [2]:")
    print(f"{'op':<16}{'FLOPs':>9}{'bytes':>9}{'bound':>10}{'measured':>10}{'ratio':>8}")
    ratios = {}
    for t in timed:                                 # t.op: the twin's costs at this size
        bound = cpu.seconds(t.op, "unfused")
        ratios[t.name] = t.seconds / bound
        print(f"{t.name:<16}{cli.si(t.op.flops('unfused')):>9}"
              f"{cli.si(t.op.bytes('unfused')):>9}{cli.si(bound, 's'):>10}"
              f"{cli.si(t.seconds, 's'):>10}{ratios[t.name]:>7.2f}x")
    fast = cli.beats_roof(timed, cpu)
    low, high = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    if not fast:
        print(f"(the check's roofs: the best rates measured here, x{cli.SLACK})\n"
              f"OK: no NumPy op beats this CPU's roof ({len(timed)} ops; measured/bound "
              f"{ratios[low]:.2f}x {low} .. {ratios[high]:.2f}x {high})")
    else:
        print(f"MISMATCH: {', '.join(t.name for t in fast)} ran faster than the roof "
              f"allows:\n  their FLOP or byte counts are too high")
    raise SystemExit(bool(fast))


if __name__ == "__main__":
    main()
