"""`python -m minidist memory`: a plan's memory budget, measured beside it, or the plans that fit.

    python -m minidist memory --model gpt3-13b --plan dp=1,tp=8,recompute=selective,precision=bf16
    python -m minidist memory --plan dp=2,zero=3 --measure          (the tiny GPT, real ranks)
    python -m minidist memory --fit --model gpt3-13b --device-memory 141GB --gpus 8

The first prints the per-rank estimate by category (memory/budget.py), one column per
pipeline stage; --measure runs one training step of the plan on real ranks and prints
estimated, measured and their difference (memory/budget_measure.py), ending in an OK or
MISMATCH line; --fit lists the plans that fit on --gpus devices of --device-memory bytes,
least communication first (memory/budget_fit.py).

Sizes: a number of bytes with an optional unit, SI or IEC as written: kB, MB, GB, TB are
powers of 1000 and KiB, MiB, GiB, TiB powers of 1024. 141GB = 141e9 bytes = 131.3 GiB,
the H200's datasheet figure read as decimal: a little under the ~140 GiB the card itself
reports, so the safe side. Printed sizes are SI (1 GB = 1e9 B, as in the ZeRO paper).
--plan keys: dp, tp, pp, cp, zero, recompute (none, selective, full), precision (fp64,
fp32, bf16, fp16), mb (micro-batches), sp (0/1), cp_algo, schedule (1f1b, gpipe),
optimizer (adamw, sgd_momentum, sgd); all default to 1 / none / fp64 / 1f1b / adamw.
Exit codes: 0; 1 a measured category differs from its estimate; 2 a usage error (one
`error:` line on stderr).
Read next: memory/budget.py.
"""

from __future__ import annotations

import argparse
import re

from minidist.cli import CliParser, at_least, cli_error
from minidist.data import DataConfig, model_config_for
from minidist.memory import budget_fit, budget_measure
from minidist.memory.budget import CATEGORIES, MemoryPlan, estimate_stages
from minidist.memory.budget_models import GPT3_SHAPES, parameter_count, preset
from minidist.parallel.pipeline.schedule_sim import bubble_closed_form

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
PLAN_KEYS = {"dp": int, "tp": int, "pp": int, "cp": int, "zero": int, "recompute": str,
             "precision": str, "mb": int, "micro_batches": int, "sp": bool, "cp_algo": str,
             "schedule": str, "optimizer": str}
ACTIVATION_TOLERANCE = 0.05          # the bound; the formulas meet it exactly here


def parse_size(text: str) -> int:
    """'141GB' -> 141_000_000_000, '1.5GiB' -> 1610612736, '4096' -> 4096 (bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in UNITS or not float(m.group(1)) > 0:
        raise ValueError(f"size {text!r} is not a positive number of bytes with a unit of "
                         "B, kB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (1024), "
                         "e.g. 141GB.")
    return int(round(float(m.group(1)) * UNITS[unit]))


def parse_plan(text: str) -> MemoryPlan:
    """'dp=2,tp=2,zero=1,recompute=selective,precision=bf16' -> MemoryPlan."""
    fields = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key == "ep":
            raise ValueError("--plan: ep (expert parallelism) is not modelled: the estimator "
                             "covers dense GPTs; drop ep.")
        if key not in PLAN_KEYS or not value:
            raise ValueError(f"--plan: {item!r} is not key=value with a key in "
                             f"{', '.join(PLAN_KEYS)}.")
        kind = PLAN_KEYS[key]
        try:
            fields["micro_batches" if key == "mb" else key] = \
                value.strip() in ("1", "true", "on") if kind is bool else kind(value.strip())
        except ValueError:
            raise ValueError(f"--plan: {key}={value!r} must be an int.") from None
    return MemoryPlan(**fields)


def fmt(n: float) -> str:
    """Bytes, SI: '1.88 GB', '384 B'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def _arguments() -> CliParser:
    ap = CliParser(prog="python -m minidist memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny",
                    help=f"'tiny' (the task's GPT) or a preset: {', '.join(GPT3_SHAPES)}")
    ap.add_argument("--plan", default="", help="e.g. dp=2,tp=2,zero=1,precision=bf16")
    ap.add_argument("--batch", type=at_least(1), default=None,
                    help="global batch in sequences (default dp x micro-batches)")
    ap.add_argument("--seq-len", type=at_least(1), default=None,
                    help="tokens per sequence (default the model's block size)")
    ap.add_argument("--measure", action="store_true", help="run one step on real ranks")
    ap.add_argument("--fit", action="store_true", help="list the plans that fit")
    ap.add_argument("--device-memory", type=_size, default=None, help="e.g. 141GB")
    ap.add_argument("--gpus", type=at_least(1), default=8, help="devices for --fit")
    ap.add_argument("--rows", type=at_least(1), default=1,
                    help="--fit: sequences per micro-batch (default 1)")
    ap.add_argument("--precisions", default="bf16", help="--fit: e.g. bf16,fp32")
    ap.add_argument("--top", type=at_least(1), default=20, help="--fit: rows shown")
    tiny = ap.add_argument_group("the tiny GPT (--model tiny)")
    tiny.add_argument("--task", default="sort", choices=["copy", "reverse", "sort", "add"])
    tiny.add_argument("--length", type=at_least(1), default=6)
    tiny.add_argument("--n-layer", type=at_least(1), default=2)
    tiny.add_argument("--n-embd", type=at_least(1), default=32)
    tiny.add_argument("--n-head", type=at_least(1), default=4)
    tiny.add_argument("--seed", type=at_least(0), default=0)
    return ap


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model(a, plan: MemoryPlan):
    """(GPTConfig, DataConfig or None, a one-line name) of --model."""
    if a.model != "tiny":
        cfg = preset(a.model)
        return cfg, None, f"{a.model} ({parameter_count(cfg) / 1e9:.2f}B parameters)"
    data = DataConfig(task=a.task, length=a.length)
    dtype = "float32" if plan.precision == "fp32" else "float64"
    cfg = model_config_for(data, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=dtype)
    return cfg, data, (f"tiny GPT ({a.n_layer} layers, C={a.n_embd}, {a.n_head} heads, "
                       f"T={data.block_size}, {parameter_count(cfg)} parameters)")


def main(argv: list[str] | None = None) -> int:
    """The command (module docstring); returns the exit code."""
    a = _arguments().parse_args(argv)
    try:
        plan = parse_plan(a.plan)
        cfg, data, name = _model(a, plan)
        if a.fit:
            return _fit(a, cfg, name)
        if a.device_memory is not None:
            raise ValueError("--device-memory goes with --fit (the plans that fit it).")
        if a.measure and data is None:
            raise ValueError(f"--measure runs the step here: use --model tiny; {a.model} "
                             "is estimated only (it would not fit in this machine).")
        batch = a.batch or plan.dp * plan.micro_batches
        if a.measure:
            budget_measure.check_measurable(cfg, plan)
        stages = estimate_stages(cfg, plan, batch, a.seq_len)
    except ValueError as e:
        return cli_error(e)
    T = a.seq_len or cfg.block_size
    print(f"memory budget · {name} · {plan.describe()} · batch {batch} x {T} tokens")
    if not a.measure:
        _estimate_table(plan, stages)
        return 0
    return print_comparison(budget_measure.compare(cfg, data, plan, batch, a.seed))


def _estimate_table(plan: MemoryPlan, stages) -> None:
    heads = [f"stage {e.stage}" for e in stages] if len(stages) > 1 else ["estimate"]
    print(f"{'per rank':<14}" + "".join(f"{h:>14}" for h in heads))
    for c in (*CATEGORIES, "total"):
        print(f"  {c:<12}" + "".join(f"{fmt(getattr(e, c)):>14}" for e in stages))
    e = max(stages, key=lambda s: s.total)
    print(f"activations: {e.held} micro-batch(es) held on stage {e.stage}, each:")
    for what, n in e.per_micro_batch.items():
        print(f"    {fmt(n):>10}  {what}")


def print_comparison(rows: dict) -> int:
    """Print estimated vs measured per stage and category (budget_measure.compare's
    result); the verdict line; the exit code (0 OK, 1 MISMATCH)."""
    worst_act, bad = 0.0, []
    print(f"{'stage':<6}{'category':<13}{'estimated B':>14}{'measured B':>14}  Δ")
    for stage, cats in rows.items():
        for c, (est, got) in cats.items():
            err = budget_measure.relative_error(est, got)
            ok = err <= ACTIVATION_TOLERANCE if c == "activations" else est == got
            worst_act = max(worst_act, err) if c == "activations" else worst_act
            bad += [] if ok else [f"stage {stage} {c}: {est:,} vs {got:,}"]
            print(f"{stage:<6}{c:<13}{est:>14,}{got:>14,}  {est - got:+,}")
    if bad:
        print("MISMATCH: estimated bytes differ from measured: " + "; ".join(bad))
        return 1
    print("OK: estimated bytes match measured (params, grads, optimizer, buffers, recompute "
          f"exactly; activations within 5%: max |Δ| = {100 * worst_act:.2f}%)")
    return 0


def _fit(a, cfg, name: str) -> int:
    if a.device_memory is None:
        raise ValueError("--fit needs --device-memory, e.g. --device-memory 141GB.")
    precisions = tuple(p.strip() for p in a.precisions.split(",") if p.strip())
    batch = a.batch or a.gpus * a.rows
    fits, valid = budget_fit.fit(cfg, a.gpus, a.device_memory, batch, a.rows, a.seq_len,
                                 precisions)
    print(f"memory fit · {name} on {a.gpus} x {fmt(a.device_memory)} · batch {batch} "
          f"sequences of {a.seq_len or cfg.block_size} tokens, {a.rows} per micro-batch · "
          f"{len(fits)} of {valid} plans fit")
    if not fits:
        print("no plan fits: more devices, a smaller model or a shorter sequence.")
        return 0
    print(f"{'plan':<52}{'params':>9}{'grads':>9}{'optim':>9}{'acts':>9}{'buffers':>9}"
          f"{'recomp':>9}{'total':>9}{'sent/step':>11}{'bubble':>8}")
    for f in fits[:a.top]:
        e, p = f.estimate, f.plan
        bubble = bubble_closed_form(p.schedule, p.pp, p.micro_batches)
        print(f"{p.describe():<52}" + "".join(f"{fmt(v):>9}" for v in e.categories().values())
              + f"{fmt(e.total):>9}{fmt(f.comm['total']):>11}{bubble:>8.1%}")
    if len(fits) > a.top:
        print(f"... {len(fits) - a.top} more (--top {len(fits)} shows all)")
    return 0


__all__ = ["main", "parse_size", "parse_plan", "fmt", "print_comparison"]
