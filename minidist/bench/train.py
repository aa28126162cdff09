"""Benchmark: training throughput of data parallelism (and ZeRO) against one rank.

Weak scaling: every rank keeps the same batch (`--batch-per-rank`), so dp ranks process
dp times the tokens of one rank per step; on dp idle cores the ideal is dp x the tokens/s
of the dp=1 run made in the same invocation. Each run is minidist.train.train_on_rank on
the tiny GPT, all ranks spawned at once. Per step the slowest rank's step time counts;
the table shows the median over the steps after `--warmup`. The runs are repeated
`--repeats` times, interleaved (dp=1, dp=W, ..., dp=1, dp=W, ...), and each row keeps its
fastest repeat: on a shared machine the other repeats measure the neighbours' load.

    tokens/s   global batch x T / median step time (input tokens)
    ratio      tokens/s / tokens/s of the dp=1 run
    compute    forward + backward of all micro-batches (buckets launched inside)
    comm wait  time step() waited for gradient communication after backward (mean
               over ranks): with overlap, only the part backward did not hide
    cpu        CPU time of one rank's process per step, all its threads (mean over ranks):
               unlike the wall times it hardly moves with the neighbours' load; dp=W
               near dp=1 means the data-parallel overhead itself is small
    sent/rank  bytes this rank sent per step (group.stats), and the DP formula
               2(W-1)/W Ψ x itemsize next to it

Rows: dp=1 (the reference); "W x dp=1": W ranks that each train alone on their own
batch, no communication at all, i.e. the ceiling this machine allows right now (on a
machine shared with other jobs it can be far below W); dp=W with overlap, dp=W without
(--overlap / --no-overlap keep one of the two); with --zero k the ZeRO-k engine
(Plan(zero=k), parallel/zero.py). dp=W against "W x dp=1" is the cost of data
parallelism itself.

Run:  python -m minidist bench train --dp 2 [--zero 1,2,3] [--steps 30] [--warmup 5]
      [--repeats 3] [--batch-per-rank 32] [--overlap | --no-overlap] [--n-layer 2]
      [--n-embd 64] [--dtype float32] [--bucket-bytes 64K]       (default: about 25 s)
Reference: Li et al. 2020, arXiv:2006.15704, Sec. 5 (DDP overlap and bucket size).
Read next: bench/collectives.py
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import argparse                                # noqa: E402
import shlex                                   # noqa: E402
import statistics                              # noqa: E402
import sys                                     # noqa: E402
from dataclasses import dataclass              # noqa: E402

import numpy as np                             # noqa: E402

from minidist.baseline import model_config_for  # noqa: E402
from minidist.bench.collectives import parse_bytes  # noqa: E402
from minidist.data import DataConfig           # noqa: E402
from minidist.nn import GPT                    # noqa: E402
from minidist.runtime.launch import spawn      # noqa: E402
from minidist.train import Plan, train_on_rank  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One run of the table (times in seconds, medians over the measured steps)."""

    name: str
    dp: int
    tokens_per_s: float
    step: float
    compute: float
    comm_wait: float
    cpu: float
    sent: int


@dataclass
class _Alone:
    """A one-rank context around a one-member group: this rank trains by itself."""

    world: object
    world_size: int = 1
    rank: int = 0


def _on_rank(ctx, model_cfg, data_cfg, plan: Plan, steps: int, batch: int, alone: bool):
    if alone:                                  # every rank creates every group, in order
        mine = [ctx.new_group((r,), name=f"alone{r}") for r in range(ctx.world_size)]
        ctx = _Alone(mine[ctx.rank])
    r = train_on_rank(ctx, model_cfg, data_cfg, plan, steps=steps, global_batch=batch,
                      lr=1e-3)
    return r.timing, [b["sent"] for b in r.bytes_per_step]


def measure(name: str, model_cfg, data_cfg, plan: Plan, steps: int, warmup: int,
            batch_per_rank: int, alone: int = 0) -> Row:
    """Spawn plan.dp ranks (or `alone` ranks training by themselves), train
    `warmup + steps` steps, reduce the timings to a Row."""
    ranks = alone or plan.dp
    batch = batch_per_rank * ranks
    runs = spawn(ranks, _on_rank, model_cfg, data_cfg, plan, warmup + steps,
                 batch_per_rank * plan.dp, bool(alone))
    keep = slice(warmup, warmup + steps)
    slowest = [max(t) for t in zip(*(timing["step"][keep] for timing, _ in runs))]
    mean = lambda key: [float(np.mean(t)) for t in                       # noqa: E731
                        zip(*(timing[key][keep] for timing, _ in runs))]
    step = statistics.median(slowest)
    return Row(name, ranks if not alone else 1, batch * data_cfg.block_size / step, step,
               statistics.median(mean("compute")), statistics.median(mean("comm_wait")),
               statistics.median(mean("cpu")), int(statistics.median(runs[0][1][keep])))


def _zero_available() -> str | None:
    try:
        from minidist.parallel.zero import ZeroEngine  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_table(a: argparse.Namespace) -> list[Row]:
    data_cfg = DataConfig(task="sort", length=a.length)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=a.dtype)
    common = dict(model_cfg=cfg, data_cfg=data_cfg, steps=a.steps, warmup=a.warmup,
                  batch_per_rank=a.batch_per_rank)
    modes = [True, False] if a.overlap is None else [a.overlap]
    plan = lambda dp, **kw: Plan(dp=dp, bucket_bytes=a.bucket_bytes, **kw)  # noqa: E731
    runs = [("dp=1", plan(1, overlap=modes[0]), 0)]
    if a.dp > 1:
        runs.append((f"{a.dp} x dp=1", plan(1, overlap=modes[0]), a.dp))
    runs += [(f"dp={a.dp} {'overlap' if o else 'no overlap'}", plan(a.dp, overlap=o), 0)
             for o in modes]
    missing = _zero_available() if a.zero else None
    for k in a.zero:
        if missing:
            print(f"zero-{k}: skipped, the ZeRO engine is not importable ({missing})")
        else:
            runs.append((f"dp={a.dp} zero-{k}", plan(a.dp, zero=k), 0))
    best: dict[str, Row] = {}
    for _ in range(a.repeats):                         # interleaved: load hits all alike
        for name, p, alone in runs:
            row = measure(name, plan=p, alone=alone, **common)
            if name not in best or row.tokens_per_s > best[name].tokens_per_s:
                best[name] = row
    return [best[name] for name, _, _ in runs]


def render(rows: list[Row], psi: int, itemsize: int) -> str:
    base = rows[0].tokens_per_s
    lines = [f"{'run':<20}{'tokens/s':>10}{'ratio':>7}{'step ms':>9}{'compute ms':>12}"
             f"{'comm wait ms':>14}{'cpu ms':>8}{'sent/rank/step':>16}{'2(W-1)/W Ψ':>12}"]
    for r in rows:
        formula = int(round(2 * (r.dp - 1) / r.dp * psi * itemsize))
        lines.append(f"{r.name:<20}{r.tokens_per_s:>10.0f}{r.tokens_per_s / base:>7.2f}"
                     f"{r.step * 1e3:>9.2f}{r.compute * 1e3:>12.2f}{r.comm_wait * 1e3:>14.3f}"
                     f"{r.cpu * 1e3:>8.2f}{r.sent:>16,d}{formula:>12,d}")
    return "\n".join(lines)


def _stages(text: str) -> list[int]:
    try:
        stages = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        stages = [0]
    if not stages or any(s not in (1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"--zero {text!r}: give stages 1, 2, 3 as e.g. 1,2,3")
    return stages


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist bench train`: tokens/s of dp ranks vs one, comm wait per step."""
    p = argparse.ArgumentParser(prog="python -m minidist bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default 2)")
    p.add_argument("--zero", type=_stages, default=[], help="ZeRO stages to add, e.g. 1,2,3")
    p.add_argument("--steps", type=int, default=30, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs; best kept")
    p.add_argument("--batch-per-rank", type=int, default=32, help="sequences per rank")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="only with (--overlap) or without (--no-overlap); default both")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--length", type=int, default=8, help="prompt length: T = 2 x length")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--bucket-bytes", type=parse_bytes, default=64 << 10,
                   help="DDP bucket size (default 64K: several buckets, so overlap matters)")
    a = p.parse_args(argv)
    if a.dp < 1 or a.steps < 1 or a.warmup < 0 or a.batch_per_rank < 1 or a.repeats < 1:
        p.error("need --dp, --steps, --repeats, --batch-per-rank >= 1 and --warmup >= 0")
    cfg = model_config_for(DataConfig(task="sort", length=a.length), n_layer=a.n_layer,
                           n_embd=a.n_embd, n_head=a.n_head, dtype=a.dtype)
    psi = GPT(cfg).num_parameters()
    print("$ python -m minidist bench train " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, T={cfg.block_size}, Ψ={psi:,} params, "
          f"{cfg.dtype}; {a.batch_per_rank} sequences per rank (weak scaling); medians over "
          f"{a.steps} steps after {a.warmup} warm-up, best of {a.repeats} runs; "
          f"{os.cpu_count()} CPU cores")
    rows = run_table(a)
    print(render(rows, psi, np.dtype(cfg.dtype).itemsize))
    return 0
