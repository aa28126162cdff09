"""Benchmark: what offloading the optimizer state costs per step, and what it saves on the device.

The bench model of bench/train.py (2 layers, C = 64, T = 16, 32 sequences per rank, float32,
dp = 2) is trained with the optimizer state on the device (`none`), in host memory
(`host`) and in memmap files read ahead on a worker thread (`disk`; memory/offload.py),
under DDP or a ZeRO stage (--zero; under ZeRO-3 the parameter shards move too). The runs
are interleaved (none, host, disk, none, ...) `--repeats` times and each row keeps its
fastest repeat, as bench/train.py does: on a shared machine the others measure the
neighbours. One more 1-step run per tier under memory/ledger.py gives the device peak.

    step ms      median over the measured steps of the slowest rank's step time
    ratio        step / step of `none`; the issue's target: <= 1.3 with prefetch
    compute ms   forward + backward (mean over ranks); the rest of a step is the update
                 and the gradient communication: what offloading can slow down
    cpu ms       CPU time per step of one rank's process, all threads (the disk tier's
                 worker included; mean over ranks), and its ratio: on a shared machine it
                 moves much less than the wall clock
    peak         the ledger's device peak of rank 0, and its drop against `none`
    moved        bytes taken off rank 0's device: the optimizer state (AdamW: m and v),
                 plus the parameter shards under ZeRO-3; the drop must equal it

The disk tier reads and writes every state byte once per step (2 x the state bytes) and
the OS page cache may hold the files in RAM: this measures the mechanics (a thread, copies,
memmap pages), not an NVMe drive's bandwidth.

Run:  python -m minidist bench offload [--dp 2] [--zero 0] [--steps 30] [--warmup 5]
      [--repeats 3] [--batch-per-rank 32] [--n-layer 2] [--n-embd 64] [--length 8]
      [--dtype float32] [--offload-dir D]                      (default: about 15 s)
Reference: Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840; Rajbhandari et al. 2021,
    "ZeRO-Infinity", arXiv:2104.07857.
Read next: memory/offload.py, demos/21_offload.py.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import argparse                                # noqa: E402
import shlex                                   # noqa: E402
import sys                                     # noqa: E402

from minidist.bench.train_runs import Row, measure  # noqa: E402
from minidist.cli import CliParser, at_least, directory   # noqa: E402
from minidist.data import DataConfig, model_config_for  # noqa: E402
from minidist.memory.ledger import format_bytes  # noqa: E402
from minidist.memory.offload import TIERS      # noqa: E402
from minidist.nn import GPT                    # noqa: E402
from minidist.runtime.launch import spawn      # noqa: E402
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank  # noqa: E402

TARGET = 1.3                                   # issue 11: step <= 1.3 x the plain step


def _peak(ctx, cfg, data_cfg, plan: Plan, batch: int) -> tuple[int, int]:
    """(device peak, bytes moved off the device) of this rank over one step."""
    run = train_on_rank(ctx, cfg, data_cfg, plan,
                        RunConfig(steps=1, global_batch=batch, memory_ledger=True),
                        OptimizerConfig(lr=1e-3))
    moved = run.memory["optimizer"] + (run.memory["params"] if plan.zero == 3 else 0)
    return run.memory["ledger"]["peak"], moved if plan.offload != "none" else 0


def run_rows(a: argparse.Namespace, cfg, data_cfg) -> tuple[list[Row], dict]:
    """The timed rows (best of a.repeats, interleaved) and {tier: (peak, moved)}."""
    plans = {t: Plan(dp=a.dp, zero=a.zero, offload=t, check_placements=False,
                     offload_dir=a.offload_dir if t == "disk" else None) for t in TIERS}
    batch = a.batch_per_rank * a.dp
    best: dict[str, Row] = {}
    for _ in range(a.repeats):
        for tier, plan in plans.items():
            row = measure(tier, cfg, data_cfg, plan, a.steps, a.warmup, batch)
            if tier not in best or row.step < best[tier].step:
                best[tier] = row
    peaks = {t: spawn(a.dp, _peak, cfg, data_cfg, p, batch)[0] for t, p in plans.items()}
    return [best[t] for t in TIERS], peaks


def render(rows: list[Row], peaks: dict) -> str:
    base, (peak0, _) = rows[0].step, peaks["none"]
    lines = [f"{'offload':<9}{'step ms':>9}{'ratio':>7}{'compute ms':>12}{'cpu ms':>8}"
             f"{'ratio':>7}{'peak':>11}{'drop':>11}{'moved':>11}"]
    for r in rows:
        peak, moved = peaks[r.name]
        lines.append(f"{r.name:<9}{r.step * 1e3:>9.2f}{r.step / base:>7.2f}"
                     f"{r.compute * 1e3:>12.2f}{r.cpu * 1e3:>8.2f}{r.cpu / rows[0].cpu:>7.2f}"
                     f"{format_bytes(peak):>11}"
                     f"{format_bytes(peak0 - peak):>11}{format_bytes(moved):>11}")
    return "\n".join(lines)


def verdict(rows: list[Row], peaks: dict) -> list[str]:
    """The target line and the ledger line."""
    base = rows[0].step
    ratios = [f"{r.name} {r.step / base:.2f}x {'yes' if r.step / base <= TARGET else 'NO'}"
              for r in rows[1:]]
    exact = all(peaks["none"][0] - peaks[t][0] == peaks[t][1] for t in TIERS[1:])
    return [f"target step <= {TARGET}x none (prefetch on): " + ", ".join(ratios),
            f"device peak drop = bytes moved off the device, exactly: {'yes' if exact else 'NO'}"]


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench offload`: step time and device peak, offload none / host /
    disk. Exits 0 (the timings are reported, not judged); 1 if the ledger's drop is not
    exactly the bytes moved."""
    p = CliParser(prog="python -m minidist bench offload", description=__doc__,
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=at_least(1), default=2, help="data-parallel ranks")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--steps", type=at_least(1), default=30, help="measured steps")
    p.add_argument("--warmup", type=at_least(0), default=5)
    p.add_argument("--repeats", type=at_least(1), default=3, help="interleaved runs; best kept")
    p.add_argument("--batch-per-rank", type=at_least(1), default=32)
    p.add_argument("--n-layer", type=at_least(1), default=2)
    p.add_argument("--n-embd", type=at_least(1), default=64)
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=8, help="prompt length: T = 2 x it")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--offload-dir", type=directory, default=None, metavar="D",
                   help="where the disk tier's files go (default: the OS temp dir)")
    a = p.parse_args(argv)
    data_cfg = DataConfig(task="sort", length=a.length)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=a.dtype)
    try:
        Plan(dp=a.dp, zero=a.zero).validate(cfg, a.batch_per_rank * a.dp, cfg.block_size)
    except ValueError as e:
        p.error(str(e))
    print("$ python -m minidist bench offload " + shlex.join(sys.argv[1:] if argv is None
                                                              else argv))
    print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, T={cfg.block_size}, "
          f"Ψ={GPT(cfg).num_parameters():,} params, {cfg.dtype}; dp={a.dp}, ZeRO-{a.zero}, "
          f"{a.batch_per_rank} sequences per rank; medians over {a.steps} steps after "
          f"{a.warmup} warm-up, best of {a.repeats} runs; {os.cpu_count()} CPU cores")
    rows, peaks = run_rows(a, cfg, data_cfg)
    print(render(rows, peaks))
    lines = verdict(rows, peaks)
    print("\n".join(lines))
    return 0 if lines[-1].endswith("yes") else 1


if __name__ == "__main__":
    sys.exit(main())
