"""Benchmark rows for tensor and context parallelism: strong scaling next to the formulas.

`python -m minidist bench train --tp T` or `--cp C` (bench/train.py parses the options and
measures each run; the time columns are its). Every row trains the SAME global batch
(`--batch`), so ratio is the speed-up over one rank.

Tensor parallelism (--tp T > 1). Rows: dp=1; dp=D (with --dp D > 1);
the layout dp=D x tp=T; with --sp the same with sequence parallelism. Defaults are a model
where matmuls dominate: C=256, 4 layers, T=128, float32, batch 8. Columns besides the times:
    dp sent, 2(D-1)/D Ψ  bytes rank 0 sent per step over dp, and DDP's figure for its shard
    tp sent, formula     bytes rank 0 sent per step over tp (bytes_by_axis["tp"]) and
                         parallel/tensor_memory.step_bytes (exact, algorithm by algorithm)
    act/layer, formula   bytes one rank keeps for the backward of one block (block 0 of the
                         same sharded model, autograd/saved.py, parameters excluded) and
                         tensor_memory.activation_bytes
Context parallelism (--cp C > 1), strong scaling at T=512 (C=128, 2 layers, float32, batch
8): rows dp=1, dp=D, dp=D x cp=C. cp sent, formula: bytes_by_axis["cp"] of rank 0 and
context_memory.step_bytes (attention only: the gradient sync has its own group);
hidden: ring only, median over steps of 1 - wait/send of the ring's passes, all ranks
(ring_attention.RING_TIMES); GF zz, GF ct: the busiest rank's forward attention GFLOP per
step, zig-zag and contiguous layouts, with max/mean over ranks; act/layer,
formula: as for tp (context_memory.activation_bytes); 1 process: the same for cp=1.
Read next: parallel/tensor_memory.py, parallel/context_memory.py (the formulas).
"""

from __future__ import annotations

import argparse

import numpy as np

from minidist.bench.train import Row, _best_of
from minidist.nn import GPT
from minidist.parallel import context_memory as cm, placement as pl
from minidist.parallel import ring_attention as ra, tensor_memory as tm
from minidist.parallel.tensor import expected_placement
from minidist.runtime.launch import spawn
from minidist.train import Plan


def _act_on_rank(ctx, cfg, rows: int, plan: Plan) -> int:
    if plan.cp > 1:
        return cm.measure_layer_activations(ctx.world, cfg, rows, plan.cp_algo, plan.cp_layout)
    return tm.measure_layer_activations(ctx.world, cfg, rows, plan.sequence_parallel)


def _local_params(cfg, tp: int) -> int:
    """Elements of one tp rank's shard of GPT(cfg): what DDP all-reduces over dp."""
    total = 0
    for name, p in GPT(cfg, seed=None).named_parameters():
        shape, place = list(p.shape), expected_placement(name) if tp > 1 else pl.Replicate()
        if isinstance(place, pl.Shard):
            d = place.dim % len(shape)
            shape[d] = place.blocks * pl.piece_length(shape[d], tp, place.blocks)
        total += int(np.prod(shape))
    return total


def run_strong_table(a: argparse.Namespace, cfg, data_cfg) -> list[Row]:
    """dp=1, dp=D, then dp=D x tp=T (and with SP) or dp=D x cp=C, all on the global batch
    a.batch; then, untimed, the activations of one block of each row's layout."""
    def plan(dp: int = a.dp, **kw) -> Plan:
        return Plan(check_placements=False, overlap=a.overlap is not False,
                    bucket_bytes=a.bucket_bytes, dp=dp, **kw)

    pre = f"dp={a.dp} " if a.dp > 1 else ""
    runs = [("dp=1", plan(dp=1))] + ([(f"dp={a.dp}", plan())] if a.dp > 1 else [])
    if a.cp > 1:
        runs.append((f"{pre}cp={a.cp} {a.cp_algo}", plan(cp=a.cp, cp_algo=a.cp_algo,
                                                         cp_layout=a.cp_layout)))
    else:
        runs += [(f"{pre}tp={a.tp}{' sp' if sp else ''}", plan(tp=a.tp, sequence_parallel=sp))
                 for sp in ([False, True] if a.sp else [False])]
    common = dict(model_cfg=cfg, data_cfg=data_cfg, steps=a.steps, warmup=a.warmup)
    rows = _best_of(a.repeats, [(n, q, 0, a.batch) for n, q in runs], common)
    return [Row(**{**r.__dict__, "act": spawn(r.plan.tp * r.plan.cp, _act_on_rank, cfg,
                                              a.batch // r.plan.dp, r.plan)[0]}) for r in rows]


def _header(head: list[tuple[str, int]]) -> str:
    return "".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(head))


def render_tp(rows: list[Row], cfg, batch: int) -> str:
    b, T, C, H = np.dtype(cfg.dtype).itemsize, cfg.block_size, cfg.n_embd, cfg.n_head
    base = rows[0].tokens_per_s
    head = [("run", 20), ("ranks", 6), ("tokens/s", 10), ("ratio", 7), ("step ms", 9),
            ("compute ms", 12), ("cpu ms", 8), ("dp sent", 12), ("2(D-1)/D Ψ", 12),
            ("tp sent", 12), ("formula", 12), ("act/layer", 12), ("formula", 12)]
    lines = [_header(head)]
    for r in rows:
        q = r.plan
        rows_mb = batch // q.dp                                 # sequences per dp rank
        dp_formula = int(round(2 * (q.dp - 1) / q.dp * _local_params(cfg, q.tp) * b))
        tp_formula = tm.step_bytes(cfg, rows_mb, T, q.tp, q.sequence_parallel)
        act_formula = tm.activation_bytes(rows_mb, T, C, H, cfg.mlp_ratio * C, tp=q.tp,
                                          sp=q.sequence_parallel, itemsize=b,
                                          dropout=cfg.dropout > 0)
        cells = [f"{r.name:<20}", f"{r.dp:>6}", f"{r.tokens_per_s:>10.0f}",
                 f"{r.tokens_per_s / base:>7.2f}", f"{r.step * 1e3:>9.2f}",
                 f"{r.compute * 1e3:>12.2f}", f"{r.cpu * 1e3:>8.2f}"]
        cells += [f"{v:>12,d}" for v in (r.sent_by_axis.get("dp", 0), dp_formula,
                                          r.sent_by_axis.get("tp", 0), tp_formula, r.act,
                                          act_formula)]
        lines.append("".join(cells))
    return "\n".join(lines)


def paper_line(cfg, rows_mb: int, tp: int) -> str:
    """Korthikanti et al.'s Table 2 for this model (16-bit activations, with dropout)."""
    s, h, a = cfg.block_size, cfg.n_embd, cfg.n_head
    per = [("t=1", tm.paper_activation_bytes(s, rows_mb, h, a)),
           (f"t={tp}", tm.paper_activation_bytes(s, rows_mb, h, a, tp)),
           (f"t={tp} sp", tm.paper_activation_bytes(s, rows_mb, h, a, tp, True))]
    return ("Korthikanti et al. 2022, Table 2, per layer and rank at 16 bits with dropout "
            f"(s={s}, b={rows_mb}, h={h}, a={a}): " + ", ".join(f"{n} {v:,.0f} B" for n, v in per))


def render_cp(rows: list[Row], cfg, batch: int) -> str:
    b, T, C, H = np.dtype(cfg.dtype).itemsize, cfg.block_size, cfg.n_embd, cfg.n_head
    lines = [_header([("run", 20), ("ranks", 6), ("tokens/s", 10), ("ratio", 7), ("step ms", 9),
                      ("cpu ms", 8), ("cp sent", 12), ("formula", 12), ("hidden", 8),
                      ("GF zz", 8), ("max/mean", 9), ("GF ct", 8), ("max/mean", 9),
                      ("act/layer", 12), ("formula", 12), ("1 process", 12)])]
    for r in rows:
        q, rows_dp = r.plan, batch // r.plan.dp                 # sequences per dp rank
        act = lambda cp: cm.activation_bytes(rows_dp, T, C, H, cfg.mlp_ratio * C, cp=cp,  # noqa
                                             algo=q.cp_algo, itemsize=b, dropout=cfg.dropout > 0)
        cells = [f"{r.name:<20}", f"{r.dp:>6}", f"{r.tokens_per_s:>10.0f}",
                 f"{r.tokens_per_s / rows[0].tokens_per_s:>7.2f}", f"{r.step * 1e3:>9.2f}",
                 f"{r.cpu * 1e3:>8.2f}", f"{r.sent_by_axis.get('cp', 0):>12,d}",
                 f"{cp_formula(cfg, q, rows_dp, T):>12,d}",
                 "       -" if r.hidden != r.hidden else f"{r.hidden:>8.0%}"]
        for layout in ra.LAYOUTS:                               # zigzag, contiguous
            work = cm.attention_scores(T, q.cp, q.cp_algo, layout)
            gf = cfg.n_layer * cm.attention_flops(rows_dp, H, C // H, max(work)) / 1e9
            cells += [f"{gf:>8.3f}", f"{ra.imbalance(work):>9.3f}"]
        cells += [f"{v:>12,d}" for v in (r.act, act(q.cp), act(1))]
        lines.append("".join(cells))
    return "\n".join(lines)


def cp_formula(cfg, q, rows_dp: int, T: int) -> int:
    """context_memory.step_bytes for Plan q: bytes one cp rank sends per step."""
    return cm.step_bytes(cfg, rows_dp // q.micro_batches, T, q.cp, q.cp_algo, tp=q.tp,
                         micro_batches=q.micro_batches)


def cp_notes(rows: list[Row]) -> str:
    """The issue's targets beside what was measured."""
    r = rows[-1]
    hidden = "n/a (no ring)" if r.hidden != r.hidden else f"{r.hidden:.0%}"
    return (f"targets (issue 8, ring, T=512): tokens/s >= 1.50 x dp=1, measured "
            f"{r.tokens_per_s / rows[0].tokens_per_s:.2f} x; >= 50 % of the ring's send time "
            f"hidden, measured {hidden}")


