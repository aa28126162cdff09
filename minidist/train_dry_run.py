"""`python -m minidist train --dry-run --world N`: one rank of an N-rank job, run for real, alone.

A prediction of a job too big for this machine needs, per rank, what the rank holds and
what it sends. Both can be counted rather than modelled: rank R runs its real
`train_on_rank` in this process, on runtime/dry_run.py's DryContext of N ranks, whose
groups move no data but count every call as the real transport does. The memory ledger
(memory/ledger.py) counts the arrays the rank makes. So the numbers come from the code that
would run: the layout is checked by the same rules as a real run's (train_options.py), the
groups are the mesh's, the algorithms are those the real transport would pick.

The world and the layout (--world N):
    --dp given        --dp x --tp x --cp x --pp must be N (else an error naming both);
    --dp left out     dp = N / (tp x cp x pp) (an error if that does not divide);
    --world left out  N = dp x tp x cp x pp, as a real run.
    --rank R          the rank that runs (default 0); --steps S (default 2 here);
    --transport       shm: the shared-memory runtime's algorithms (direct reductions in
                      shared regions, DDP's buckets), as the real run on this machine; mpi:
                      runtime/mpi.py's (no shared memory: ring, tree, halving), as across
                      machines.

One rank's view (`main`):
    1. refuse the options a dry run cannot honour (`_refuse`), fill dp in from --world;
    2. check the layout by train_options.resolve, the real run's rules (less the check
       that this machine can start the ranks: none is started);
    3. `dry_run`: train_on_rank(DryContext(R, N), ...) under the memory ledger;
    4. print: the layout, R's mesh coordinates and the global ranks of its group on each
       axis; its ledger peak (per category, and the largest buffers then); its bytes per
       axis in the last step, sent and received, as train.py's counters count them
       (RankResult.bytes_by_axis, recv_by_axis); its calls in that step per group, by op
       and algorithm; the wall time.

Exact: R's bytes and calls on every group, and R's ledger peak (the same code makes the
same arrays; tests/runtime/test_dry_run.py compares both with real runs, every rank of
layouts up to 8 ranks). Not computed: values. Refused, because what they do depends on
what other ranks send: expert parallelism (--ep, --expert-tp: token counts from the
others' routing), --deterministic (its gradient tree is built from nodes the ranks
exchange), --precision fp16 (its overflow vote skips steps), --spike, --straggler; and
what needs real ranks or files: --check, --check-placements, checkpoints, restarts,
--inject, --run-dir, --device gpu. Assumed, and said: a MoE layer routes by this rank's own
(meaningless) values, so its activations are a sample, not the real run's.

Read next: runtime/dry_run.py (the transport), train.py (what runs), train_options.py.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from minidist import train_options
from minidist.cli import cli_error
from minidist.data import DataConfig
from minidist.memory.ledger import CATEGORIES, DeviceOutOfMemory, format_bytes
from minidist.nn import GPTConfig
from minidist.parallel import placement
from minidist.parallel.compose import Plan
from minidist.runtime.dry_run import DryContext
from minidist.train import Hook, OptimizerConfig, RankResult, RunConfig, train_on_rank

DRY_STEPS = 2                   # --steps under --dry-run: the first step, and one after it
WIDTH = 100                     # characters per printed line


@dataclass(frozen=True)
class DryRun:
    """What one dry run gives: rank R's RankResult (its bytes per axis and step, its
    ledger's summary under memory["ledger"]), the DryContext (its groups and every Call),
    and the run's wall time in seconds."""

    result: RankResult
    ctx: DryContext
    seconds: float


class StepLabels(Hook):
    """Labels the context's calls with the step they run in (None outside the steps)."""

    def __init__(self, ctx: DryContext) -> None:
        self.ctx = ctx

    def on_step_start(self, step: int) -> None:
        self.ctx.step = step

    def on_step_end(self, end) -> None:
        self.ctx.step = None


def check(plan: Plan, run: RunConfig) -> None:
    """ValueError for a Plan or run whose traffic depends on what other ranks send (the
    message in their fields; train_options.in_flags turns the Plan's into flags)."""
    if run.deterministic:
        raise ValueError("dry run: deterministic=True sums the gradients in a tree built "
                         "from the nodes the ranks exchange (which grains each holds), "
                         "which a dry run does not move; use deterministic=False.")
    for field in ("ep", "expert_tp"):
        if getattr(plan, field) > 1:
            raise ValueError(f"dry run: {field}={getattr(plan, field)} sends each token to "
                             "the rank of its expert, in numbers decided by the other ranks' "
                             f"routing, which a dry run does not compute; use {field}=1 (the "
                             "MoE layers then run unsharded).")
    if plan.precision == "fp16":
        raise ValueError("dry run: precision='fp16' skips a step when any rank's gradients "
                         "overflow, a vote on values a dry run does not compute; use "
                         "precision='bf16' (the same bytes per value).")


def dry_run(rank: int, world_size: int, model_cfg: GPTConfig, data_cfg: DataConfig,
            plan: Plan, run: RunConfig, opt: OptimizerConfig, *,
            shared_memory: bool = True) -> DryRun:
    """Rank `rank` of a `world_size`-rank job: train_on_rank on a DryContext, under the
    memory ledger, with placement checks off (they compare values across ranks); the
    process's check mode is restored afterwards. shared_memory: the shared-memory runtime's
    algorithms (True) or MPI's (False)."""
    check(plan, run)
    ctx = DryContext(rank, world_size, shared_memory)
    checking = placement.checking()
    t0 = time.perf_counter()
    try:
        result = train_on_rank(ctx, model_cfg, data_cfg, replace(plan, check_placements=False),
                               replace(run, memory_ledger=True), opt, [StepLabels(ctx)])
    finally:
        placement.set_checking(checking)
    return DryRun(result, ctx, time.perf_counter() - t0)


# --- the command ------------------------------------------------------------------------

def main(a: argparse.Namespace) -> int:
    """`train --dry-run`'s options, parsed by train_cli.py: refuse what makes no dry run,
    fill the world in, check the layout as a real run would, run, print the report.
    Returns 0; 2 after one `error:` line; 1 if the rank runs past --device-memory (the
    ledger's DeviceOutOfMemory, one line on stderr)."""
    try:
        _refuse(a)
        _fill_world(a)
        job = train_options.resolve(a)
        run = RunConfig(steps=a.steps, global_batch=a.batch, seed=a.seed,
                        device_memory=a.device_memory)
        check(job.plan, run)
        world, rank = job.plan.world_size, 0 if a.rank is None else a.rank
        if rank >= world:
            raise train_options.OptionError(f"--rank {rank} is not a rank of the {world}-rank "
                                            f"job; use --rank 0..{world - 1}")
    except ValueError as e:
        return cli_error(train_options.in_flags(e))
    for note in job.notes:
        print("\n".join(_wrap(note)))
    try:
        dry = dry_run(rank, world, job.cfg, job.data_cfg, job.plan, run,
                      OptimizerConfig(lr=a.lr, name=a.optimizer),
                      shared_memory=(a.transport or "shm") == "shm")
    except DeviceOutOfMemory as e:             # the prediction: it would not fit
        print(f"dry run: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    for line in report(dry, job.cfg, job.plan, a):
        print(line)
    return 0


def _refuse(a: argparse.Namespace) -> None:
    """OptionError, one line naming the flag, for options a dry run cannot honour."""
    refused = {
        "--check": a.check and "compares the run with the single-process one, but a "
                               "--dry-run computes no real values",
        "--check-placements": a.check_placements and "compares activations across ranks, but "
                                                     "a --dry-run moves none",
        f"--spike {a.spike}": a.spike != "off" and "decides each update from the global "
                                                   "loss, which a --dry-run does not compute",
        f"--straggler {a.straggler}": a.straggler != "off" and "compares the ranks' step "
                                                               "times, but a --dry-run runs one",
        "--checkpoint-dir": a.checkpoint_dir is not None and "saves and resumes the ranks' "
                                                             "state, but a --dry-run has none",
        "--elastic": a.elastic and "restarts failed ranks, but a --dry-run starts none",
        "--max-restarts": a.max_restarts > 0 and "restarts failed ranks, but a --dry-run "
                                                 "starts none",
        "--inject": bool(a.inject) and "makes real ranks fail, but a --dry-run starts none",
        "--deterministic": a.deterministic and "builds its gradient tree from nodes the "
                                               "ranks exchange, which a --dry-run does not move",
        "--run-dir": a.run_dir is not None and a.run_dir.lower() != "none"
        and "records the ranks' steps, but a --dry-run prints its own report",
        "--device gpu": a.device == "gpu" and "would put a rank on the GPU, but a --dry-run "
                                              "runs its one rank on the CPU (the ledger counts "
                                              "the same arrays)"}
    for flag, reason in refused.items():
        if reason:
            raise train_options.OptionError(f"{flag} {reason}; drop {flag.split()[0]}")
    if a.steps == 0:
        raise train_options.OptionError("--steps 0 trains nothing, so a --dry-run has nothing "
                                        "to count; use --steps 1 or more")


def _fill_world(a: argparse.Namespace) -> None:
    """--world N: dp = N / (tp cp pp) when --dp is left out; else they must agree."""
    if a.world is None:
        return
    others = a.tp * a.cp * a.pp
    layout = f"--tp {a.tp} x --cp {a.cp} x --pp {a.pp}"
    if a.dp is None:
        if a.world % others:
            raise train_options.OptionError(
                f"--world {a.world} is not a multiple of {layout} = {others}, so no --dp "
                f"fills it; use a --world that is (e.g. {max(1, a.world // others) * others})")
        a.dp = a.world // others
    elif a.dp * others != a.world:
        raise train_options.OptionError(
            f"--world {a.world}, but --dp {a.dp} x {layout} = {a.dp * others} ranks; make "
            "them agree, or drop --dp" + (f" (dp is then {a.world} / {others} = "
                                          f"{a.world // others})" if a.world % others == 0
                                          else ""))


# --- the report ---------------------------------------------------------------------------

def report(dry: DryRun, cfg: GPTConfig, plan: Plan, a: argparse.Namespace) -> list[str]:
    """The lines `train --dry-run` prints (each at most WIDTH characters)."""
    r, ctx = dry.result, dry.ctx
    steps = len(r.bytes_by_axis)
    lines = [f"dry run: rank {ctx.rank} of {ctx.world_size} · {plan.describe()}, ZeRO-"
             f"{plan.zero}" + (f", {plan.micro_batches} micro-batches" if plan.pp > 1 else ""),
             f"task {a.task} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.dtype} · batch "
             f"{a.batch} · {a.optimizer} lr {a.lr} · {steps} steps · transport "
             f"{'shm' if ctx.shared_memory else 'mpi'}"]
    sync, algos = plan.algorithms(ctx.shared_memory).split(" · ")
    lines += [f"gradient sync: {sync}", f"reductions: {algos}"]
    lines += _coordinates(plan, ctx.rank)
    lines += _memory(r.memory["ledger"])
    lines += _traffic(r)
    lines += _calls(ctx, steps - 1)
    moe = " MoE layers route by this rank's own values: their activations are a sample." \
        if cfg.moe_every else ""
    lines += [f"wall time: {dry.seconds:.2f} s for {steps} steps of rank {ctx.rank}, in this "
              "one process; nothing moved.",
              "exact: the bytes and calls above, and the ledger's peak (the same code, the same"
              " arrays).", f"not computed: values (every peer holds what this rank holds).{moe}"]
    return [line for text in lines for line in _wrap(text)]


def _coordinates(plan: Plan, rank: int) -> list[str]:
    """Rank's coordinate on each mesh axis and the global ranks of its group there."""
    axes, shape = plan.mesh_axes()
    coords = np.unravel_index(rank, shape)
    groups = plan.group_ranks(rank)
    if plan.world_size == 1:
        return [f"rank {rank}: the whole job"]
    mesh = " x ".join(f"{a}={n}" for a, n in zip(axes, shape) if n > 1)
    where = " · ".join(f"{a} {int(c)}" for a, c, n in zip(axes, coords, shape) if n > 1)
    lines = [f"rank {rank} at {where} (mesh {mesh}, the last axis fastest)"]
    named = [(a, groups[a]) for a, n in zip(axes, shape) if n > 1]
    if plan.cp > 1 and plan.dp > 1:
        named.append(("dp x cp", groups["grad"]))          # the gradient sync's group
    lines += [f"  {a:<8}{len(ranks):>6} ranks: {_ranks(ranks)}" for a, ranks in named]
    return lines


def _ranks(ranks: tuple[int, ...]) -> str:
    """'0, 1024, 2048, 3072', or '0, 2, 4, ..., 1022 (stride 2)' for a long list."""
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    steps = set(np.diff(ranks).tolist())
    every = f" (stride {steps.pop()})" if len(steps) == 1 else ""
    return f"{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[-1]}{every}"


def _memory(ledger: dict) -> list[str]:
    """The ledger's peak, its steps' peaks, each category's own peak, the largest buffers
    alive at the peak."""
    steps = ", ".join(format_bytes(p) for p in ledger["step_peaks"])
    lines = [f"memory peak (memory/ledger.py): {format_bytes(ledger['peak'])} "
             f"({ledger['peak']:,} B); per step: {steps}",
             "  each category at its own peak: " + " · ".join(
                 f"{c} {format_bytes(ledger['peak_by_category'][c])}" for c in CATEGORIES)]
    lines += [f"  at the peak: {category} '{name}' {shape} {format_bytes(n)}"
              for category, name, shape, n in ledger["peak_top"][:3]]
    return lines


def _traffic(r: RankResult) -> list[str]:
    """Bytes per axis in the last step, as train.py counts them (and which steps differ)."""
    last, sent, recv = len(r.bytes_by_axis) - 1, r.bytes_by_axis[-1], r.recv_by_axis[-1]
    lines = [f"traffic in step {last}, per axis (train.py's counters; bytes):",
             f"  {'axis':<8}{'sent':>16}{'received':>16}"]
    lines += [f"  {axis:<8}{int(sent[axis]):>16,}{int(recv[axis]):>16,}" for axis in sent]
    other = [s for s in range(last) if (r.bytes_by_axis[s], r.recv_by_axis[s]) != (sent, recv)]
    if other:
        lines.append(f"  steps {', '.join(map(str, other))} moved other bytes: sent "
                     + "; ".join(f"{s}: {sum(map(int, r.bytes_by_axis[s].values())):,}"
                                 for s in other))
    return lines


def _calls(ctx: DryContext, step: int) -> list[str]:
    """This rank's calls in `step`, per group, counted by op and algorithm."""
    by_group: dict[str, Counter] = {}
    for c in ctx.calls:
        if c.step == step:
            algo = re.sub(r", step \d+$", "", c.algo)        # ring attention's passes
            name = f"{c.op}/{algo}" if algo else c.op
            by_group.setdefault(c.group, Counter())[name] += 1
    size = {g.name: g.size for g in ctx.groups}
    lines = [f"calls in step {step}, per group of this rank (op/algorithm x count):"]
    for group, counts in by_group.items():
        lines.append(f"  {group} ({size[group]} ranks): "
                     + ", ".join(f"{name} x{n}" for name, n in counts.items()))
    outside = [c for c in ctx.calls if c.step is None]
    lines.append(f"  outside the steps: {len(outside)} call{'s' * (len(outside) != 1)}, "
                 f"{sum(c.sent for c in outside):,} B sent (the losses' sums, the gathered "
                 "parameters of the result)")
    return lines


def _wrap(text: str) -> list[str]:
    """text in lines of at most WIDTH characters, continuations indented under its start."""
    if len(text) <= WIDTH:
        return [text]
    start = len(text) - len(text.lstrip())
    lines, line = [], text[:start]
    for word in text[start:].split(" "):
        if line.strip() and len(line) + 1 + len(word) > WIDTH:
            lines.append(line)
            line = " " * (start + 4) + word
        else:
            line = f"{line} {word}" if line.strip() else line + word
    return lines + [line]
