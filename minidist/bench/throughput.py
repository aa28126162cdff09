"""Benchmark: tokens/s, the FLOP ledger against 6N + 12LHQT, this CPU's peak, MFU and HFU.

What it prints:
    1. the peak: NumPy's (n, n) matmul on one BLAS thread, float32 and float64, measured
       in a rank (pinned as every rank is) or read from the cache (observe/peak.py);
    2. the FLOP ledger of one training step of rank 0 (dp=1) by phase, and its matmul
       FLOPs against the closed form, term by term (observe/throughput.py): equal, exactly;
       then MFU's model FLOPs of that step, tokens x (6N + 12LHQT) with N every parameter;
    3. one row per run, dp=1 and dp=W (weak scaling: --batch-per-rank sequences per rank),
       with tokens/s, the median step time (slowest rank), model FLOPs per step (tokens x
       6N + 12LHQT, N every parameter: the one convention, as the main job's line and
       `report`) and hardware FLOPs (the ledger's, all ranks: recomputation and the
       elementwise work included), and MFU = model FLOPs / (step s x peak x ranks), HFU
       likewise with hardware FLOPs.

One rank's view: train warm-up + steps AdamW steps with minidist.train.train_on_rank; the
ledger counts the first step (a warm-up step, so its hooks never slow a timed step) and
is switched off when it ends; the optimizer's FLOPs are added from its formula (AdamW 14
per element, the gradient norm 2 per element: observe/op_flops.py), per rank over all Ψ
parameters (DDP: every rank updates every parameter). Placement checks are off.

Why MFU is low here: each autograd op costs some microseconds of Python, the elementwise
passes (GELU, LayerNorm, softmax) run at memory speed, and a (B T, C) @ (C, F) matmul of
this size reaches only part of the BLAS peak that an (n, n) one does.

Run:  python -m minidist bench throughput [--dp 2] [--steps 5] [--warmup 1]
      [--batch-per-rank 8] [--n-layer 4] [--n-embd 256] [--n-head 4] [--length 64]
      [--dtype float32] [--peak-size 1024] [--refresh-peak]     (about 20 s)
Reference: Chowdhery et al. 2022, "PaLM", arXiv:2204.02311, App. B (MFU, HFU).
Read next: observe/throughput.py
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from minidist.cli import CliParser, at_least
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.observe import op_flops
from minidist.observe.flops import PHASES, FlopLedger
from minidist.observe.peak import DTYPES, peak_flops
from minidist.observe.throughput import closed_form, from_ledger, model_flops_per_token
from minidist.runtime.launch import spawn
from minidist.train import OnStep, OptimizerConfig, Plan, RunConfig, train_on_rank


def _peaks(ctx, n: int, refresh: bool) -> list:
    return [peak_flops(dtype, n=n, refresh=refresh) for dtype in DTYPES]


def _on_rank(ctx, cfg, data_cfg, plan: Plan, steps: int, batch: int):
    """Train; count the first step with the ledger; return (step times, the ledger)."""
    led = FlopLedger().start()
    try:
        r = train_on_rank(ctx, cfg, data_cfg, plan, RunConfig(steps=steps, global_batch=batch),
                          OptimizerConfig(lr=1e-3), hooks=[OnStep(lambda step, loss: led.stop())])
    finally:
        led.stop()
    return r.timing["step"], led


def measure(cfg, data_cfg, dp: int, a: argparse.Namespace) -> tuple[FlopLedger, float]:
    """Run dp ranks; return (the ranks' ledgers of one step merged, optimizer included;
    the median over the measured steps of the slowest rank's step time)."""
    batch = a.batch_per_rank * dp
    runs = spawn(dp, _on_rank, cfg, data_cfg, Plan(dp=dp, check_placements=False),
                 a.warmup + a.steps, batch)
    led = FlopLedger()
    sizes = [p.size for p in GPT(cfg, None).parameters()]
    for _, part in runs:
        led.merge(part)
        led.add("AdamW", "optimizer", other=op_flops.optimizer_flops("adamw", sum(sizes)))
        led.add("grad_norm", "optimizer", other=op_flops.grad_norm_flops(sizes))
    slowest = [max(t) for t in zip(*(times[a.warmup:] for times, _ in runs))]
    return led, statistics.median(slowest)


def ledger_vs_formula(led: FlopLedger, cfg, tokens: int, T: int) -> tuple[str, bool]:
    """The closed form's terms for `tokens` tokens next to the ledger's matmul FLOPs, and
    under them MFU's model FLOPs (6N + 12LHQT, N every parameter: the one convention)."""
    cf = closed_form(cfg, T)
    lines = [f"{'closed form (PaLM App. B), per step':<52}{'FLOPs':>18}"]
    for label, per_token in cf.terms():
        lines.append(f"  {label:<50}{per_token * tokens:>18,d}")
    equal = led.model_flops() == cf.matmul * tokens
    lines.append(f"  {'ledger: matmul FLOPs of forward + backward':<50}"
                 f"{led.model_flops():>18,d}   {'equal' if equal else 'DIFFERENT'}")
    n = GPT(cfg, None).num_parameters()
    lines.append(f"  {f'MFU: 6N + 12LHQT, N = {n:,} every param':<50}"
                 f"{model_flops_per_token(cfg, T) * tokens:>18,d}")
    return "\n".join(lines), equal


def phases(led: FlopLedger) -> str:
    """Matmul and other FLOPs of one step per phase."""
    lines = [f"{'ledger of one step, rank 0':<28}{'matmul FLOPs':>18}{'other FLOPs':>16}"]
    for ph in PHASES:
        lines.append(f"  {ph:<26}{led.total('matmul', (ph,)):>18,d}"
                     f"{led.total('other', (ph,)):>16,d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench throughput`: tokens/s, ledger vs formula, peak, MFU, HFU."""
    p = CliParser(prog="python -m minidist bench throughput", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=at_least(1), default=2, help="ranks of the second run")
    p.add_argument("--steps", type=at_least(1), default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=at_least(1), default=1,
                   help="untimed steps first, >= 1: the first one is counted (default 1)")
    p.add_argument("--batch-per-rank", type=at_least(1), default=8)
    p.add_argument("--n-layer", type=at_least(1), default=4)
    p.add_argument("--n-embd", type=at_least(1), default=256)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=64, help="prompt length; T = 2x")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--peak-size", type=at_least(1), default=1024, help="n of the (n, n) "
                   "matmul measuring the peak (default 1024)")
    p.add_argument("--refresh-peak", action="store_true", help="measure the peak again")
    a = p.parse_args(argv)
    data_cfg = DataConfig(task="sort", length=a.length)
    try:
        cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd,
                               n_head=a.n_head, dtype=a.dtype)
    except ValueError as e:
        p.error(str(e))
    T = data_cfg.block_size
    print("$ python -m minidist bench throughput " +
          shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, H={cfg.n_head}, T={T}, V="
          f"{cfg.vocab_size}, {GPT(cfg, None).num_parameters():,} params, {cfg.dtype}; "
          f"{a.batch_per_rank} sequences per rank; medians over {a.steps} steps after "
          f"{a.warmup} warm-up; one BLAS thread per rank")
    peaks = {pk.dtype: pk for pk in spawn(1, _peaks, a.peak_size, a.refresh_peak)[0]}
    for pk in peaks.values():
        print(f"peak {pk.dtype}: {pk.flops / 1e9:.1f} GFLOP/s (({pk.n}, {pk.n}) matmul, "
              f"1 thread, median of {pk.repeats}; {'cached in' if pk.cached else 'saved to'}"
              f" {pk.path})")
    rows, ok = [], True
    for dp in dict.fromkeys((1, a.dp)):
        led, step = measure(cfg, data_cfg, dp, a)
        tokens = a.batch_per_rank * dp * T
        if dp == 1:
            print(phases(led))
            text, ok = ledger_vs_formula(led, cfg, tokens, T)
            print(text)
        rows.append((f"dp={dp}", from_ledger(led, cfg, step, tokens, peaks[a.dtype].flops,
                                             dp)))
    print(f"{'run':<8}{'tokens/s':>10}{'step ms':>10}{'model GFLOP':>13}{'hw GFLOP':>10}"
          f"{'peak GFLOP/s':>14}{'MFU':>8}{'HFU':>8}")
    for name, t in rows:
        print(f"{name:<8}{t.tokens_per_s:>10.0f}{t.seconds * 1e3:>10.2f}"
              f"{t.model_flops / 1e9:>13.4g}{t.hardware_flops / 1e9:>10.4g}"
              f"{t.peak / 1e9:>14.1f}{t.mfu:>8.1%}{t.hfu:>8.1%}")
    if not ok:
        print("MISMATCH: the ledger's matmul FLOPs differ from the closed form")
    return 0 if ok else 1
