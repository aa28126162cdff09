"""Benchmark: training throughput of data (ZeRO), tensor and context parallelism vs one rank.

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
(Plan(zero=k), parallel/zero/engine.py). dp=W against "W x dp=1" is the cost of data
parallelism itself.

Tensor (--tp T > 1), context (--cp C > 1) and expert parallelism (--ep W > 1, the MoE GPT)
are strong scaling instead: bench/train_layouts.py builds and prints those tables.
Placement checks are off in every run: their digests would be traffic too.

Run:  python -m minidist bench train --dp 2 [--zero 1,2,3] [--steps 30] [--warmup 5]
      [--repeats 3] [--batch-per-rank 32] [--overlap | --no-overlap] [--n-layer 2]
      [--n-embd 64] [--dtype float32] [--bucket-bytes 64K]       (default: about 25 s)
      python -m minidist bench train --tp 2 [--dp 2] [--sp] [--batch 8] [--steps 10]
      [--warmup 2] [--n-layer 4] [--n-embd 256] [--length 64]    (T = 128; a minute or two)
      python -m minidist bench train --cp 2 [--cp-algo ulysses] [--dp 2]  (T = 512; ~1 min)
      python -m minidist bench train --ep 2 [--n-experts 4] [--top-k 2]   (T = 128; ~10 s)
Reference: Li et al. 2020, arXiv:2006.15704, Sec. 5 (DDP overlap and bucket size);
    Shoeybi et al. 2019, arXiv:1909.08053 (tp); Korthikanti et al. 2022, arXiv:2205.05198
    (SP; Table 2, printed under the tp table); Liu et al. 2023, arXiv:2310.01889 (ring
    attention); Jacobs et al. 2023, arXiv:2309.14509 (Ulysses).
Read next: bench/collectives.py
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")          # effective only if NumPy is not imported yet

import argparse                                # noqa: E402
import shlex                                   # noqa: E402
import sys                                     # noqa: E402

import numpy as np                             # noqa: E402

from minidist.bench import train_layouts as lay  # noqa: E402
from minidist.bench.collectives import parse_bytes  # noqa: E402
from minidist.bench.train_runs import Row, best_of  # noqa: E402
from minidist.cli import CliParser, at_least    # noqa: E402
from minidist.data import DataConfig, model_config_for  # noqa: E402
from minidist.nn import GPT                    # noqa: E402
from minidist.train import Plan                # noqa: E402


def run_table(a: argparse.Namespace, cfg, data_cfg) -> list[Row]:
    common = dict(model_cfg=cfg, data_cfg=data_cfg, steps=a.steps, warmup=a.warmup)
    modes = [True, False] if a.overlap is None else [a.overlap]
    plan = lambda dp, **kw: Plan(dp=dp, bucket_bytes=a.bucket_bytes,     # noqa: E731
                                 check_placements=False, **kw)
    runs = [("dp=1", plan(1, overlap=modes[0]), 0)]
    if a.dp > 1:
        runs.append((f"{a.dp} x dp=1", plan(1, overlap=modes[0]), a.dp))
    runs += [(f"dp={a.dp} {'overlap' if o else 'no overlap'}", plan(a.dp, overlap=o), 0)
             for o in modes]
    runs += [(f"dp={a.dp} zero-{k}", plan(a.dp, zero=k), 0) for k in a.zero]
    batch = lambda p: a.batch_per_rank * p.dp                            # noqa: E731
    return best_of(a.repeats, [(n, p, alone, batch(p)) for n, p, alone in runs], common)


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
    """`python -m minidist bench train`: tokens/s of dp ranks vs one, comm wait per step;
    with --tp (--cp): dp x tp (dp x cp) vs one rank on the same batch, bytes and memory."""
    p = CliParser(prog="python -m minidist bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=at_least(1), default=None,
                   help="data-parallel ranks (default 2; with --tp: 1)")
    p.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel ranks: the tp table")
    p.add_argument("--sp", action="store_true", help="add sequence-parallel rows (--tp > 1)")
    p.add_argument("--cp", type=at_least(1), default=1, help="context-parallel ranks: the cp table")
    p.add_argument("--cp-algo", default="ring", choices=["ring", "ulysses"])
    p.add_argument("--cp-layout", default="zigzag", choices=["zigzag", "contiguous"])
    p.add_argument("--batch", type=at_least(1), default=8,
                   help="global batch of every tp/cp-table row (strong scaling; default 8)")
    p.add_argument("--zero", type=_stages, default=[], help="ZeRO stages to add, e.g. 1,2,3")
    p.add_argument("--steps", type=at_least(1), default=None,
                   help="measured steps after warm-up (default 30; --tp, --cp: 10)")
    p.add_argument("--warmup", type=at_least(0), default=None, help="default 5; --tp, --cp: 2")
    p.add_argument("--repeats", type=at_least(1), default=3, help="interleaved runs; best kept")
    p.add_argument("--batch-per-rank", type=at_least(1), default=32, help="sequences per rank")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="only with (--overlap) or without (--no-overlap); default both")
    p.add_argument("--n-layer", type=at_least(1), default=None, help="default 2; --tp: 4")
    p.add_argument("--n-embd", type=at_least(1), default=None,
                   help="default 64; --tp: 256; --cp, --ep: 128")
    p.add_argument("--n-head", type=at_least(1), default=4)
    p.add_argument("--length", type=at_least(1), default=None,
                   help="prompt length, T = 2 x length (default 8; --tp, --ep: 64; --cp: 256)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--bucket-bytes", type=parse_bytes, default=64 << 10,
                   help="DDP bucket size (default 64K: several buckets, so overlap matters)")
    lay.add_ep_arguments(p)
    a = p.parse_args(argv)
    if a.ep != 1:                                  # the MoE GPT: its own table and defaults
        return lay.main_ep(a, p, argv)
    tp_mode, cp_mode = a.tp > 1, a.cp > 1
    defaults = dict(dp=1, steps=10, warmup=2, n_layer=4, n_embd=256, length=64) if tp_mode \
        else dict(dp=1, steps=10, warmup=2, n_layer=2, n_embd=128, length=256) if cp_mode \
        else dict(dp=2, steps=30, warmup=5, n_layer=2, n_embd=64, length=8)
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.sp and not tp_mode:                    # the numbers' ranges: at parsing
        p.error("--sp needs --tp > 1")
    if tp_mode and cp_mode:
        p.error("--tp with --cp: no table here; run python -m minidist train --tp T --cp C")
    if (tp_mode or cp_mode) and a.zero:
        p.error("--zero is not in the --tp and --cp tables; drop it")
    if (tp_mode or cp_mode) and a.batch % a.dp:
        p.error(f"--batch {a.batch} must divide by --dp {a.dp}")
    data_cfg = DataConfig(task="sort", length=a.length)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           dtype=a.dtype)
    psi = GPT(cfg).num_parameters()
    print("$ python -m minidist bench train " + shlex.join(sys.argv[1:] if argv is None else argv))
    if tp_mode or cp_mode:
        try:
            Plan(dp=a.dp, tp=a.tp, cp=a.cp, cp_algo=a.cp_algo, cp_layout=a.cp_layout,
                 sequence_parallel=a.sp).validate(cfg, a.batch, cfg.block_size)
        except ValueError as e:
            p.error(str(e))
        print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, H={cfg.n_head}, T={cfg.block_size}, "
              f"Ψ={psi:,} params, {cfg.dtype}; global batch {a.batch} in every row (strong "
              f"scaling); medians over {a.steps} steps after {a.warmup} warm-up, best of "
              f"{a.repeats} runs; {os.cpu_count()} CPU cores; bytes and act per rank (rank 0)")
        rows = lay.run_strong_table(a, cfg, data_cfg)
        print(lay.render_cp(rows, cfg, a.batch) if cp_mode
              else lay.render_tp(rows, cfg, a.batch))
        print(lay.cp_notes(rows) if cp_mode else lay.paper_line(cfg, a.batch // a.dp, a.tp))
        return 0
    print(f"GPT {cfg.n_layer} layers, C={cfg.n_embd}, T={cfg.block_size}, Ψ={psi:,} params, "
          f"{cfg.dtype}; {a.batch_per_rank} sequences per rank (weak scaling); medians over "
          f"{a.steps} steps after {a.warmup} warm-up, best of {a.repeats} runs; "
          f"{os.cpu_count()} CPU cores")
    rows = run_table(a, cfg, data_cfg)
    print(render(rows, psi, np.dtype(cfg.dtype).itemsize))
    return 0
