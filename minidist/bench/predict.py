"""Local truth for the step-time model: predicted against measured steps on this machine.

`python -m minidist bench predict` trains each layout below for real (bench/train_runs.py:
warm-up, then measured steps; per step the slowest rank; the median over steps), `--repeats`
times, and prints the median of the repeats beside what hardware/predict.py says for the same
model, layout and batch on this machine's profile (hardware/profiles.this_machine: one
rank's measured matmul peak, the measured read bandwidth, the calibrated shared-memory link),
with the same three efficiency parameters that were fitted on Megatron's published runs:
nothing is fitted here. Error: measured / predicted - 1 (positive: the model is fast). (runs): the fastest and the
slowest run, the machine's noise.

    layouts   the single process; dp=2 (ZeRO 0, 1, 3); tp=2 (with and without SP); pp=2
              (1F1B, GPipe); cp=2 (ring, Ulysses); and a MoE GPT on one process and on
              dp=2 x ep=2. At most os.cpu_count() ranks: one core per rank, as one GPU per
              rank (a 2-core machine runs W = 2)
    model     GPT of 4 layers, C=256, 4 heads, T=128, float32, global batch 8 (the bench
              model of bench/train_layouts.py); the MoE GPT: every block 4 experts, top-2,
              capacity factor 1.25. Its router is untrained: its loads are not balanced
              (max / mean over the 2 ep ranks 1.0-1.7 in the first steps), so the model is
              told the capacity bound: the busiest rank's experts run 1.25 x the balanced
              rows (predict's `imbalance`), and every MoE layer waits for it

Read next: hardware/predict.py, bench/train_runs.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

from minidist.bench.train_runs import measure
from minidist.cli import at_least
from minidist.data import DataConfig, model_config_for
from minidist.hardware import profiles
from minidist.hardware.predict import predict
from minidist.train import Plan

LAYOUTS = [  # (name, Plan fields, MoE model)
    ("1 process", {}, False),
    ("dp=2", {"dp": 2}, False),
    ("dp=2 zero=1", {"dp": 2, "zero": 1}, False),
    ("dp=2 zero=3", {"dp": 2, "zero": 3}, False),
    ("tp=2", {"tp": 2}, False),
    ("tp=2 sp", {"tp": 2, "sequence_parallel": True}, False),
    ("pp=2 1f1b M=4", {"pp": 2, "micro_batches": 4}, False),
    ("pp=2 gpipe M=4", {"pp": 2, "micro_batches": 4, "schedule": "gpipe"}, False),
    ("cp=2 ring", {"cp": 2}, False),
    ("cp=2 ulysses", {"cp": 2, "cp_algo": "ulysses"}, False),
    ("MoE, 1 process", {}, True),
    ("MoE, dp=2 ep=2", {"dp": 2, "ep": 2}, True),
]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m minidist bench predict",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=at_least(1), default=3,
                    help="runs of each layout; the median is reported")
    ap.add_argument("--steps", type=at_least(1), default=5, help="measured steps a run")
    ap.add_argument("--warmup", type=at_least(0), default=2, help="steps before measuring")
    ap.add_argument("--only", default="",
                    help="comma-separated layout names (as printed) to run; default all")
    return ap.parse_args(argv)


def models():
    """(data, dense GPT, MoE GPT) of the module docstring."""
    data = DataConfig(task="sort", length=64)
    dense = model_config_for(data, n_layer=4, n_embd=256, n_head=4, dtype="float32")
    return data, dense, replace(dense, moe_every=1, n_experts=4, top_k=2)


def run(a) -> list[tuple[str, list[float], float, dict]]:
    """[(layout, measured step s of each run, predicted step s, predicted breakdown)] of
    LAYOUTS; the repeats interleaved (every layout once, then again), so that a slow spell of
    the machine hits all layouts alike rather than one layout's every run."""
    data, dense, moe = models()
    hw, batch, cores = profiles.this_machine(), 8, os.cpu_count() or 1
    wanted = {w.strip() for w in a.only.split(",") if w.strip()}
    unknown = wanted - {name for name, *_ in LAYOUTS}
    if unknown:
        raise ValueError(f"--only: unknown layouts {sorted(unknown)}; known: "
                         f"{', '.join(name for name, *_ in LAYOUTS)}")
    chosen = [(name, Plan(**fields), moe if is_moe else dense)
              for name, fields, is_moe in LAYOUTS
              if (not wanted or name in wanted) and Plan(**fields).world_size <= cores]
    steps: dict[str, list[float]] = {name: [] for name, *_ in chosen}
    for i in range(a.repeats):
        t0 = time.perf_counter()
        for name, plan, cfg in chosen:
            steps[name].append(measure(name, cfg, data, plan, a.steps, a.warmup, batch).step)
        print(f"  ... round {i + 1} of {a.repeats}: {len(chosen)} layouts in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for name, plan, cfg in chosen:
        p = predict(replace(cfg, dropout=0.0), replace(plan, check_placements=False), batch,
                    hw, fmt="fp32", memory=False, imbalance=cfg.capacity_factor or 1.0)
        rows.append((name, steps[name], p.step_s, p.breakdown))
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    data, dense, _ = models()
    hw = profiles.this_machine()
    print(f"bench predict · GPT {dense.n_layer} layers, C={dense.n_embd}, T={data.block_size},"
          f" float32, batch 8 · median of {a.repeats} runs ({a.steps} steps after {a.warmup})")
    print(f"this machine: {os.cpu_count()} cores, one rank's matmul {hw.peak('fp32') / 1e9:.0f}"
          f" GFLOP/s, read {hw.hbm_bytes_per_s / 1e9:.0f} GB/s, link alpha "
          f"{hw.intra_latency_s * 1e6:.1f} us, {hw.intra_bytes_per_s / 1e9:.1f} GB/s")
    try:
        rows = run(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"  {'layout':<16}{'measured ms':>12}{'(runs)':>12}{'predicted':>10}{'error':>8}   "
          "predicted: largest parts (ms)")
    for name, runs, want, parts in rows:
        got = statistics.median(runs)
        top = sorted(((v, k) for k, v in parts.items() if k != "pipeline" and v > 0),
                     reverse=True)[:2]
        print(f"  {name:<16}{1e3 * got:>12.1f}{f'{1e3 * min(runs):.0f}-{1e3 * max(runs):.0f}':>12}"
              f"{1e3 * want:>10.1f}{100 * (got / want - 1):>+7.1f}%   "
              + ", ".join(f"{k} {1e3 * v:.1f}" for v, k in top))
    errors = [abs(statistics.median(runs) / want - 1) for _, runs, want, _ in rows]
    if errors:
        inside = sum(e <= 0.25 for e in errors)
        print(f"{inside} of {len(rows)} layouts within +-25% (mean |error| "
              f"{100 * statistics.mean(errors):.1f}%, worst {100 * max(errors):.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
