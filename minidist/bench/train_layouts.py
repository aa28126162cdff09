"""Benchmark rows for tensor, context and expert parallelism: strong scaling next to formulas.

`python -m minidist bench train --tp T`, `--cp C` or `--ep W` (bench/train.py parses the
options and measures the tp and cp runs; the time columns are its). Every row trains the SAME
global batch (`--batch`), so ratio is the speed-up over one rank.

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
Expert parallelism (--ep W > 1; --dp defaults to W): the MoE GPT (every block a MoE, E=4
experts, top-2, C=128, 2 layers, T=128, float32, batch 8) in rows dp=1, dp=D (experts
replicated) and dp=D ep=W (parallel/expert/), measured as bench/train.py measures (slowest
rank per step, median over steps, best of repeats). Columns besides the times:
    ep sent              bytes sent over the ep groups per step SUMMED OVER THE RANKS (the
                         "ep" axis of bytes_by_axis): the all-to-alls and the gradient norm
    a2a formula          the sum over MoE layers and ranks of ExpertParallelMoE.take_traffic
    norm                 the all_gather of each rank's expert sum of squares over ep
                         (sharding.grad_sq): one float64, (W-1) x 8 B per rank
    check                OK when ep sent = a2a formula + norm on every rank and every step
                         (warm-up included), MISMATCH otherwise
    dp sync, edp sync    bytes rank 0 sent per step for the gradient sync of the dense
                         parameters (over dp; with ep=1 the experts' too) and of its experts
                         (over their R = dp / ep replicas), next to 2(D-1)/D Ψd and
                         2(R-1)/R Ψe (Ψd: the dense elements, Ψe: one rank's expert ones)
    kept max/mean        load imbalance over the W ep ranks: tokens kept by each rank's E/W
                         experts (routing stats, summed over dp), sum over layers of the
                         busiest rank over the sum of the mean (each layer's all-to-all waits
                         for its busiest rank), median over steps; dp rows: as if split
    drop                 share of the assignments dropped (capacity), mean over layers
Read next: parallel/tensor/memory.py, parallel/context/memory.py, parallel/expert/ (the
formulas).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from dataclasses import dataclass

import numpy as np

from minidist.bench.train_runs import Row, best_of
from minidist.cli import at_least
from minidist.data import DataConfig, model_config_for
from minidist.nn import GPT
from minidist.parallel import placement as pl
from minidist.parallel.context import memory as cm
from minidist.parallel.context import ring_attention as ra
from minidist.parallel.expert.expert_parallel import is_expert_parameter
from minidist.parallel.tensor import memory as tm
from minidist.parallel.tensor.tensor_parallel import expected_placement
from minidist.runtime.launch import spawn
from minidist.train import OptimizerConfig, Plan, RunConfig, train_on_rank


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
    rows = best_of(a.repeats, [(n, q, 0, a.batch) for n, q in runs], common)
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




# --- expert parallelism: `bench train --ep W` ---------------------------------------------

EP_DEFAULTS = dict(steps=10, warmup=2, n_layer=2, n_embd=128, length=64)      # T = 128


@dataclass(frozen=True)
class EpRow:
    """One run of the --ep table: times in seconds and bytes per step (medians over steps)."""

    name: str
    plan: Plan
    tokens_per_s: float
    step: float
    cpu: float                    # one rank's CPU seconds per step, mean over ranks
    ep_sent: int                  # "ep" bytes, all ranks together
    a2a_formula: int              # take_traffic over layers and ranks
    norm: int                     # the grad norm's all_gather over ep, all ranks
    exact: bool                   # ep_sent == a2a_formula + norm, every rank and step
    dp_sync: int                  # rank 0: dense gradients (ep = 1: all of them)
    edp_sync: int                 # rank 0: expert gradients over their replicas
    imbalance: float              # kept max/mean over the ep ranks (module docstring)
    drop: float                   # share of assignments dropped, mean over layers
    kept: tuple = ()              # last step: per layer, tokens kept per ep rank


def add_ep_arguments(p: argparse.ArgumentParser) -> None:
    """The --ep table's options, on the parser of `bench train`."""
    p.add_argument("--ep", type=at_least(1), default=1,
                   help="expert-parallel ranks: the MoE table (--dp defaults to --ep)")
    p.add_argument("--n-experts", type=at_least(1), default=4, help="--ep: experts per MoE layer")
    p.add_argument("--top-k", type=at_least(1), default=2, help="--ep: experts per token")
    p.add_argument("--capacity-factor", type=at_least(0.0, float), default=1.25,
                   help="--ep: capacity")


def _ep_on_rank(ctx, cfg, data_cfg, plan: Plan, steps: int, batch: int):
    """train_on_rank, and after each step this rank's all-to-all bytes by the formula (the
    sum over its MoE layers of RankResult.moe's "a2a_bytes", ExpertParallelMoE.take_traffic)."""
    r = train_on_rank(ctx, cfg, data_cfg, plan, RunConfig(steps=steps, global_batch=batch),
                      OptimizerConfig(lr=1e-3))
    formula = [sum(v.get("a2a_bytes", 0) for v in step.values()) for step in r.moe]
    return r.timing, r.bytes_by_axis, formula, r.moe


def _kept_per_rank(step_stats: dict, W: int) -> list[np.ndarray]:
    """Per MoE layer: tokens kept by each ep rank's E/W experts (W,)."""
    return [np.asarray(s["kept"]).reshape(W, -1).sum(axis=1) for s in step_stats.values()]


def measure_ep(name: str, cfg, data_cfg, plan: Plan, steps: int, warmup: int, batch: int,
               W: int) -> EpRow:
    """Spawn plan.world_size ranks, train warmup + steps steps of `batch`, reduce to a row;
    W: the ep size the imbalance is measured for (the table's, also on the dp rows)."""
    runs = spawn(plan.world_size, _ep_on_rank, cfg, data_cfg, plan, warmup + steps, batch)
    timing, by_axis, formula, moe = zip(*runs)                      # each: one per rank
    keep = range(warmup, warmup + steps)
    med = lambda f: statistics.median(f(s) for s in keep)                       # noqa: E731
    sent = lambda s, axis: [b[s].get(axis, 0) for b in by_axis]                 # noqa: E731
    norm = (plan.ep - 1) * 8            # sharding.grad_sq: all_gather of one float64 over ep
    exact = all(sent(s, "ep") == [f[s] + norm for f in formula] for s in range(warmup + steps))
    kept = [_kept_per_rank(moe[0][s], W) for s in keep]             # global: summed over dp
    step = med(lambda s: max(t["step"][s] for t in timing))         # the slowest rank
    return EpRow(
        name, plan, tokens_per_s=batch * cfg.block_size / step, step=step,
        cpu=med(lambda s: float(np.mean([t["cpu"][s] for t in timing]))),
        ep_sent=int(med(lambda s: sum(sent(s, "ep")))),
        a2a_formula=int(med(lambda s: sum(f[s] for f in formula))),
        norm=norm * len(runs), exact=exact,
        dp_sync=int(med(lambda s: sent(s, "dp")[0])),
        edp_sync=int(med(lambda s: sent(s, "edp")[0])),
        imbalance=statistics.median(sum(k.max() for k in ks) / max(sum(k.mean() for k in ks), 1)
                                    for ks in kept),
        drop=med(lambda s: float(np.mean([v["drop_rate"] for v in moe[0][s].values()]))),
        kept=tuple(tuple(int(v) for v in k) for k in kept[-1]))


def run_ep_table(a: argparse.Namespace, cfg, data_cfg) -> list[EpRow]:
    """dp=1, dp=D and dp=D x ep=W on the global batch a.batch, `a.repeats` times
    interleaved; each row keeps its fastest repeat."""
    plan = lambda **kw: Plan(check_placements=False, overlap=a.overlap is not False,  # noqa
                             bucket_bytes=a.bucket_bytes, **kw)
    runs = [("dp=1", plan())] + ([(f"dp={a.dp}", plan(dp=a.dp))] if a.dp > 1 else [])
    runs.append((f"dp={a.dp} ep={a.ep}", plan(dp=a.dp, ep=a.ep)))
    best: dict[str, EpRow] = {}
    for _ in range(a.repeats):
        for name, q in runs:
            row = measure_ep(name, cfg, data_cfg, q, a.steps, a.warmup, a.batch, a.ep)
            if name not in best or row.tokens_per_s > best[name].tokens_per_s:
                best[name] = row
    return [best[name] for name, _ in runs]


def _ep_params(cfg, ep: int) -> tuple[int, int]:
    """(dense elements, expert elements one ep rank holds) of GPT(cfg)."""
    dense = expert = 0
    for name, p in GPT(cfg, seed=None).named_parameters():
        if is_expert_parameter(name):
            expert += int(np.prod(p.shape))
        else:
            dense += int(np.prod(p.shape))
    return dense, expert // ep


def render_ep(rows: list[EpRow], cfg) -> str:
    b, cores = np.dtype(cfg.dtype).itemsize, os.cpu_count() or 1
    ring = lambda W, n: int(round(2 * (W - 1) / W * n * b))                     # noqa: E731
    lines = [_header([("run", 20), ("ranks", 6), ("tokens/s", 10), ("ratio", 7),
                      ("step ms", 9), ("cpu ms", 8), ("ep sent", 12), ("a2a formula", 12),
                      ("norm", 6), ("check", 9), ("dp sync", 12), ("2(D-1)/D Ψd", 13),
                      ("edp sync", 12), ("2(R-1)/R Ψe", 13), ("kept max/mean", 15),
                      ("drop", 7)])]
    for r in rows:
        q, over = r.plan, "*" if r.plan.world_size > cores else ""
        dense, expert = _ep_params(cfg, q.ep)
        dp_f = ring(q.dp, dense + (expert if q.ep == 1 else 0))
        edp_f = ring(q.dp // q.ep, expert) if q.ep > 1 else 0
        cells = [f"{r.name:<20}", f"{str(q.world_size) + over:>6}", f"{r.tokens_per_s:>10.0f}",
                 f"{r.tokens_per_s / rows[0].tokens_per_s:>7.2f}", f"{r.step * 1e3:>9.2f}",
                 f"{r.cpu * 1e3:>8.2f}", f"{r.ep_sent:>12,d}", f"{r.a2a_formula:>12,d}",
                 f"{r.norm:>6d}", f"{'OK' if r.exact else 'MISMATCH':>9}"]
        cells += [f"{r.dp_sync:>12,d}", f"{dp_f:>13,d}", f"{r.edp_sync:>12,d}", f"{edp_f:>13,d}"]
        lines.append("".join(cells + [f"{r.imbalance:>15.3f}", f"{r.drop:>7.1%}"]))
    if any(r.plan.ep > 1 and r.plan.dp > 2 for r in rows):
        lines.append("dp sync with ep at dp > 2: the plain engine (DataParallel, for the edp "
                     "groups) all-reduces each parameter alone, and one of <= 4 KiB\n(direct_"
                     "small) is read by all D-1 peers: (D-1) n B, not 2(D-1)/D n B")
    if any(r.plan.world_size > cores for r in rows):
        lines.append(f"* oversubscribed: more ranks than the {cores} CPU cores, so ranks "
                     "take turns and the times measure the sharing, not the layout")
    return "\n".join(lines)


def ep_notes(rows: list[EpRow], W: int) -> str:
    """The routing of the ep row's last step and the issue's target beside the measurement."""
    r, ratio = rows[-1], lambda row: row.tokens_per_s / rows[0].tokens_per_s    # noqa: E731
    kept = "; ".join(f"layer {i}: {list(k)}" for i, k in enumerate(r.kept))
    dp = f" ({rows[1].name}, experts replicated: {ratio(rows[1]):.2f} x)" if len(rows) > 2 else ""
    return (f"tokens kept per ep rank (E/{W} experts each), {r.name}, last step: {kept}\n"
            f"target (issue): tokens/s of {r.name} >= 1.50 x dp=1 at the same global batch, "
            f"measured {ratio(r):.2f} x{dp}")


def main_ep(a: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """`bench train --ep W`: check the options, print the command, the setting, the table."""
    for key, value in dict(dp=a.ep, **EP_DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.tp > 1 or a.cp > 1 or a.sp or a.zero or a.warmup < 0 \
            or min(a.dp, a.steps, a.repeats, a.batch) < 1:
        p.error("--ep: no --tp, --cp, --sp or --zero in this table; --dp, --steps, --repeats, "
                "--batch must be >= 1 and --warmup >= 0")
    data_cfg = DataConfig(task="sort", length=a.length)
    try:
        cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                               dtype=a.dtype, moe_every=1, n_experts=a.n_experts,
                               top_k=a.top_k, capacity_factor=a.capacity_factor)
        Plan(dp=a.dp, ep=a.ep).validate(cfg, a.batch, cfg.block_size)
    except ValueError as e:
        p.error(str(e))
    print("$ python -m minidist bench train " + shlex.join(sys.argv[1:] if argv is None else argv))
    dense, expert = _ep_params(cfg, 1)
    print(f"MoE GPT {cfg.n_layer} layers (all MoE), C={cfg.n_embd}, H={cfg.n_head}, "
          f"T={cfg.block_size}, E={cfg.n_experts}, top-{cfg.top_k}, capacity factor "
          f"{cfg.capacity_factor}, Ψ={dense + expert:,} params ({expert:,} in experts), "
          f"{cfg.dtype}; global batch {a.batch} in every row (strong scaling); medians over "
          f"{a.steps} steps after {a.warmup} warm-up, best of {a.repeats} runs; "
          f"{os.cpu_count()} CPU cores; ep bytes: all ranks, sync bytes: rank 0")
    rows = run_ep_table(a, cfg, data_cfg)
    print(render_ep(rows, cfg))
    print(ep_notes(rows, a.ep))
    return 0
