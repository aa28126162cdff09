"""The main job's options: the defaults a layout needs, and every rule, checked before any
rank starts, in the flags the user typed.

`python -m minidist train` (train_cli.py) hands its parsed options to `resolve`, which
returns the job (model config, data config, Plan) or raises OptionError, one line that
train_cli prints as `error: ...` with exit code 2. Nothing here starts a process, so a
layout that cannot run is refused in a fraction of a second, whichever rank would have
found out.

    1. defaults that depend on the layout (a note on stdout says each one):
         --dp              --ep x --expert-tp (the experts' ranks are data-parallel ranks)
         --grad-accum      1; under --pp P a CSV schedule's own count, else the divisor of
                           the rows per dp rank nearest 2 P (>= P where one exists): the
                           pipeline fills with micro-batches that split the batch evenly
         --n-layer         2, or one layer per pipeline piece (pp x virtual stages)
         --dtype           float32; float64 under --check (only float64 shows the layouts
                           compute the same over hundreds of Adam steps)
         --moe-group-size  one sequence; under --cp the positions of one cp chunk (a
                           routing group must sit whole on a rank)
         --token-tiles     under --deterministic --cp: the fewest runs per sequence that
                           every rank's positions hold whole (2 cp for the zig-zag layout,
                           cp for the contiguous one, times tp under --sp)
       A flag the user typed is never changed: a value that cannot run is refused instead.
    2. the rules, in one pass: each option's own (cross-flag), the Plan's
       (parallel/compose.Plan.validate: splits of the batch, heads, positions, experts,
       layers and the schedule), the deterministic mode's (deterministic/step.check) and
       the resilience options' (reliability/recovery.options); then, unless the options
       ask for a dry run (train_dry_run.py: one rank in this process), whether this
       machine can start the ranks.
    3. messages name flags: the Plan and the model config speak in their fields
       (`micro_batches=6`) for Python callers; `in_flags` names the flag that sets each
       (`--grad-accum 6`). A fix this module suggests is checked first (`_accepted`: the
       same rules on the changed options), so only fixes that run are printed.
Read next: train_cli.py (what runs the job), parallel/compose.py (Plan.validate).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, replace

from minidist import backend
from minidist.data import DataConfig, model_config_for
from minidist.deterministic import step as determinism
from minidist.memory.budget_models import parameter_count
from minidist.nn import GPTConfig
from minidist.parallel.compose import Plan
from minidist.parallel.pipeline.schedule_csv import from_csv
from minidist.parallel.pipeline.family import SCHEDULES, chunks_of, pieces
from minidist.parallel.pipeline.schedules import PipelineSchedule
from minidist.reliability import confined, recovery
from minidist.runtime.launch import check_world_size
from minidist.runtime.mpi import MPI_ENV
from minidist.runtime.nodes import Nodes
from minidist.runtime.world import RuntimeConfig


class OptionError(ValueError):
    """Options that make no job: one line, in the flags the user typed."""


@dataclass(frozen=True)
class Job:
    """What the options ask for: the model, the task, the layout, and the notes on the
    defaults chosen for them (printed before the job starts)."""

    cfg: GPTConfig
    data_cfg: DataConfig
    plan: Plan
    resilience: recovery.Resilience
    notes: tuple[str, ...] = ()


# The flag that sets each field the Plan, GPTConfig and DataConfig name in their messages.
FLAGS = {"global_batch": "--batch", "micro_batches": "--grad-accum", "dp": "--dp",
         "tp": "--tp", "cp": "--cp", "pp": "--pp", "ep": "--ep", "zero": "--zero",
         "expert_tp": "--expert-tp", "hsdp": "--hsdp", "zeropp": "--zeropp",
         "zeropp_parts": "--zeropp-parts", "param_gather": "--param-gather",
         "local_steps": "--local-steps",
         "outer_lr": "--outer-lr", "outer_momentum": "--outer-momentum",
         "onebit_warmup": "--onebit-adam", "powersgd_rank": "--powersgd",
         "cp_layout": "--cp-layout", "cp_algo": "--cp-algo", "n_head": "--n-head",
         "n_embd": "--n-embd", "n_layer": "--n-layer", "moe_every": "--moe-every",
         "n_experts": "--n-experts", "moe_group_size": "--moe-group-size", "top_k": "--top-k",
         "layers_per_stage": "--layers-per-stage", "virtual_stages": "--virtual-stages",
         "schedule_costs": "--schedule-costs",
         "schedule": "--schedule", "precision": "--precision", "grad_reduce": "--grad-reduce",
         "fp8_recipe": "--fp8-recipe",
         "dtype": "--dtype", "recompute": "--recompute", "offload": "--offload",
         "offload_dir": "--offload-dir", "length": "--length", "task": "--task",
         "router": "--router", "route_groups": "--route-groups", "route_limit": "--route-limit",
         "bias_rate": "--bias-rate", "shared_experts": "--shared-experts",
         "expert_hidden": "--expert-hidden", "capacity_factor": "--capacity-factor",
         "aux_loss_coef": "--aux-loss", "z_loss_coef": "--z-loss"}
_FIELD = re.compile(r"\b(" + "|".join(FLAGS) + r")\s*(<=|>=|=)\s*"
                    r"('[^']*'|\([^)]*\)|\d+(?:\.\d+)?|\w+)")


def _balancing(a) -> tuple[float, float]:
    """(bias_rate, aux_loss_coef) of --balance, --bias-rate and --aux-loss."""
    if a.balance == "aux" and a.bias_rate is not None:
        raise OptionError(f"--bias-rate {a.bias_rate} moves the routing bias of --balance "
                          "bias; add --balance bias, or drop --bias-rate")
    if a.balance == "bias":
        return (0.001 if a.bias_rate is None else a.bias_rate,
                0.0001 if a.aux_loss is None else a.aux_loss)
    return 0.0, 0.01 if a.aux_loss is None else a.aux_loss


def in_flags(message: object) -> str:
    """A Plan's or config's message in the flags of `train`: `micro_batches=6` ->
    `--grad-accum 6`, `cp_layout='contiguous'` -> `--cp-layout contiguous`,
    `sequence_parallel=False` -> `no --sp`, `zero <= 2` -> `--zero <= 2`."""
    text = " ".join(str(message).split())
    for prefix in ("Plan: ", "GPTConfig: ", "DataConfig: ", "pipeline: "):
        text = text.removeprefix(prefix)
    text = text.replace("sequence_parallel=False", "no --sp")
    text = text.replace("sequence_parallel=True", "--sp")

    def flag(m: re.Match) -> str:
        name, op, value = m.groups()
        value = value.strip("'")
        if value.startswith("("):                        # layers_per_stage=(3, 2) -> 3,2
            value = value.strip("(,)").replace(" ", "")
        return f"{FLAGS[name]} {value}" if op == "=" else f"{FLAGS[name]} {op} {value}"
    return _FIELD.sub(flag, text)


def resolve(a: argparse.Namespace) -> Job:
    """The job of the parsed options: defaults filled into `a` (module docstring, step 1),
    every rule checked (step 2); OptionError, one line in flags, if they make no job."""
    notes = _defaults(a)
    try:
        return replace(_validated(a), notes=tuple(notes))
    except OptionError:
        raise
    except ValueError as e:
        raise OptionError(in_flags(e)) from None


def mpi_rank() -> int | None:
    """This process's rank under mpiexec (from the launcher's variables); None outside."""
    for name in MPI_ENV:
        if name in os.environ:
            try:
                return int(os.environ[name])
            except ValueError:
                return None
    return None


# --- 1. defaults ---------------------------------------------------------------------------

def _defaults(a: argparse.Namespace) -> list[str]:
    """Fill the options left at None (module docstring, step 1); the notes to print."""
    notes = []
    if a.dp is None:
        a.dp = a.ep * getattr(a, "expert_tp", 1)
    a.schedule_value = _schedule_argument(a.schedule)
    if a.n_layer is None:
        a.n_layer = max(2, _pieces(a)) if a.layers_per_stage is None \
            else sum(a.layers_per_stage)
        if a.n_layer > 2 and a.layers_per_stage is None:
            notes.append(f"note: --n-layer {a.n_layer} (default): one layer for each of the "
                         f"{_pieces(a)} pieces of the model (--pp {a.pp}, {_chunks(a)} "
                         "chunk(s) per stage)")
    if a.grad_accum is None:
        a.grad_accum = 1
        if a.pp > 1:
            a.grad_accum, why = _pipeline_micro_batches(a)
            notes.append(f"note: --grad-accum {a.grad_accum} (default under --pp {a.pp}): "
                         f"{why}; set --grad-accum to choose")
    if a.dtype is None:
        a.dtype = "float64" if a.check and a.precision == "fp32" else "float32"
        if a.check and a.precision == "fp32":
            notes.append("note: --dtype float64 (default under --check): in float32 the "
                         "layouts' different rounding grows over hundreds of Adam steps, so "
                         "only float64 can show they compute the same")
    T = _block_size(a)
    cut = (2 * a.cp if a.cp_layout == "zigzag" else a.cp) if a.cp > 1 else 1
    if a.moe_group_size is None:
        a.moe_group_size = 0
        if a.cp > 1 and a.moe_every and T is not None and T % cut == 0 and T // cut < T:
            a.moe_group_size = T // cut
            notes.append(f"note: --moe-group-size {T // cut} (default under --cp {a.cp}): "
                         f"a routing group sits whole on a rank, and each cp rank holds "
                         f"chunks of T / {cut} = {T // cut} positions")
    if a.deterministic and a.token_tiles is None and a.cp > 1 and T is not None \
            and (a.tp > 1 or not a.sp):                # (--sp without --tp is refused later)
        tiles = determinism.fewest_token_tiles(
            Plan(cp=a.cp, tp=a.tp, cp_layout=a.cp_layout, sequence_parallel=a.sp), T)
        if tiles is not None:
            a.token_tiles = tiles
            notes.append(f"note: --token-tiles {tiles} (default under --deterministic "
                         f"--cp {a.cp}): every sum over positions runs over {tiles} runs of "
                         f"T / {tiles} = {T // tiles} positions, the fewest each rank holds "
                         "whole; runs compare bitwise only at the same value")
    return notes


def _pipeline_micro_batches(a: argparse.Namespace) -> tuple[int, str]:
    """(M, why) under --pp P: a CSV schedule's count, else the divisor of the rows per dp
    rank nearest 2 P, preferring one >= P (fewer micro-batches than stages leave a stage
    idle), the larger of two equally near (a smaller bubble)."""
    if isinstance(a.schedule_value, PipelineSchedule):
        m = a.schedule_value.micro_batches
        return m, f"the micro-batches of the schedule in {a.schedule}"
    rows = a.batch // a.dp if a.batch % a.dp == 0 else a.batch
    divisors = _divisors(rows)
    enough = [m for m in divisors if m >= a.pp] or divisors
    m = min(enough, key=lambda m: (abs(m - 2 * a.pp), -m))
    if m == 2 * a.pp:
        return m, "2 x --pp micro-batches fill the pipeline"
    return m, (f"the divisor of the {rows} rows per dp rank nearest 2 x --pp = {2 * a.pp}, "
               "so the micro-batches split the batch evenly")


def _block_size(a: argparse.Namespace) -> int | None:
    """T of the options' task, None if they make no task."""
    try:
        return DataConfig(task=a.task, length=a.length, seed=a.seed).block_size
    except ValueError:
        return None


def _schedule_argument(value: str):
    """--schedule: a schedule name, or the path of a CSV schedule (schedule_csv.py)."""
    if value in SCHEDULES:
        return value
    try:
        text = confined.read_named(value, 16 << 20).decode()
    except confined.Refused as e:
        raise OptionError(f"--schedule: {e}") from None
    except OSError:
        raise OptionError(f"--schedule {value!r} is neither one of {', '.join(SCHEDULES)} "
                          "nor a readable CSV file.") from None
    except UnicodeDecodeError as e:
        raise OptionError(f"--schedule {value}: not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None
    try:
        return from_csv(text, name=value)
    except ValueError as e:
        raise OptionError(f"--schedule {value}: {e}") from None


# --- 2. the rules ---------------------------------------------------------------------------

def _validated(a: argparse.Namespace) -> Job:
    """Every rule, in the order a reader would fix them: the options' own, the task and
    model, the batch and positions (with fixes checked by _accepted), the Plan, the
    deterministic mode, resilience. ValueError (in fields) or OptionError (in flags)."""
    if a.sp and a.tp == 1:
        raise OptionError("--sp splits the sequence over the tensor-parallel ranks: give "
                          "--tp > 1 with it, or drop --sp")
    if a.async_tp and not a.sp:
        raise OptionError("--async-tp overlaps sequence parallelism's collectives with the "
                          "matmuls: give --sp (and --tp > 1) with it, or drop --async-tp")
    inexact = f"--local-steps {a.local_steps}" if a.local_steps else \
        f"--onebit-adam {a.onebit_adam}" if a.onebit_adam else \
        f"--powersgd {a.powersgd}" if a.powersgd else ""
    if a.check and inexact:
        raise OptionError(f"--check compares with the single process, which {inexact} (not "
                          "an exact method: it syncs less, or in fewer bits) is not meant to "
                          "equal; drop one of the two")
    if inexact and (a.precision != "fp32" or a.deterministic or a.checkpoint_dir
                    or a.offload != "none" or a.spike != "off"):
        raise OptionError(f"{inexact} runs in fp32 without --deterministic, checkpoints, "
                          "offloading or the spike guard; drop those")
    if a.onebit_adam and a.optimizer != "adamw":
        raise OptionError(f"--onebit-adam compresses Adam's momentum; --optimizer "
                          f"{a.optimizer} has none. Use --optimizer adamw")
    if a.check and a.dtype != "float64" and a.precision == "fp32":
        raise OptionError(f"--check compares in float64 (in {a.dtype} the layouts' rounding "
                          f"grows over the run); drop --dtype {a.dtype}")
    if a.recompute == "selective" and a.cp > 1:
        raise OptionError("--recompute selective recomputes the attention core of one rank; "
                          f"with --cp {a.cp} ring attention already rebuilds its "
                          "probabilities block by block and Ulysses is not wrapped: use "
                          "--recompute full")
    if a.pp > 1 and a.layers_per_stage is None and a.n_layer < _pieces(a):
        raise OptionError(f"--n-layer {a.n_layer} is fewer than the {_pieces(a)} pieces "
                          f"--pp {a.pp} --schedule {a.schedule} cuts the model into; use "
                          f"--n-layer {_pieces(a)} or more, or a smaller --pp")
    if a.run_dir is not None and a.run_dir.lower() != "none" and os.path.exists(a.run_dir) \
            and not os.path.isdir(a.run_dir):
        raise OptionError(f"--run-dir {a.run_dir}: is a file, not a directory; give a "
                          "directory (it is made if missing), or --run-dir none")
    if a.device == "gpu" and _world_size(a) > 1:
        raise OptionError(backend.MULTI_RANK_GPU)
    data_cfg = DataConfig(task=a.task, length=a.length, seed=a.seed)
    bias_rate, aux_loss = _balancing(a)
    cfg = model_config_for(data_cfg, n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head,
                           moe_every=a.moe_every, n_experts=a.n_experts, top_k=a.top_k,
                           capacity_factor=a.capacity_factor, moe_group_size=a.moe_group_size,
                           z_loss_coef=a.z_loss, dtype=a.dtype, recompute=a.recompute,
                           router=a.router, route_groups=a.route_groups,
                           route_limit=a.route_limit, bias_rate=bias_rate,
                           aux_loss_coef=aux_loss, shared_experts=a.shared_experts,
                           expert_hidden=a.expert_hidden)
    plan = Plan(dp=a.dp, tp=a.tp, cp=a.cp, pp=a.pp, ep=a.ep, expert_tp=a.expert_tp,
                zero=a.zero, hsdp=a.hsdp, zeropp=a.zeropp,
                zeropp_parts=a.zeropp_parts, param_gather=a.param_gather,
                local_steps=a.local_steps, outer_lr=a.outer_lr,
                outer_momentum=a.outer_momentum, onebit_warmup=a.onebit_adam,
                powersgd_rank=a.powersgd,
                micro_batches=a.grad_accum, sequence_parallel=a.sp, async_tp=a.async_tp,
                cp_algo=a.cp_algo,
                cp_layout=a.cp_layout, check_placements=a.check_placements or None,
                schedule=a.schedule_value, virtual_stages=a.virtual_stages,
                schedule_costs=getattr(a, "schedule_costs", None),
                layers_per_stage=a.layers_per_stage, precision=a.precision,
                grad_reduce=a.grad_reduce, fp8_recipe=a.fp8_recipe, offload=a.offload,
                offload_dir=a.offload_dir)
    plan = plan.textbook() if a.plain else plan
    _fits_in_memory(a, cfg, data_cfg.block_size)
    _batch_splits(a)
    _positions_split(a, data_cfg.block_size)
    plan.validate(cfg, a.batch, data_cfg.block_size)
    if a.deterministic:
        determinism.check(plan, cfg, spike=a.spike != "off",
                          rebalance=a.straggler == "rebalance", grain=a.grain,
                          global_batch=a.batch, token_tiles=a.token_tiles,
                          seq_len=data_cfg.block_size)
    resilience = recovery.options(a, plan.world_size, plan.pp)
    topology = nodes(a, plan.world_size)
    if topology is not None and plan.zeropp and \
            topology.count(plan.group_ranks(0)["shard"]) > 1:
        span = plan.zeropp * plan.tp
        raise OptionError(f"--zeropp {plan.zeropp}: a node's {plan.zeropp} dp ranks (with "
                          f"--tp {plan.tp}: {span} ranks) span several nodes of "
                          f"--ranks-per-node {a.ranks_per_node}; use --ranks-per-node "
                          f"{span} or a multiple of it, or --zeropp "
                          f"{max(1, a.ranks_per_node // plan.tp)}")
    if plan.world_size > 1 and not getattr(a, "dry_run", False):   # a dry run starts none
        check_world_size(plan.world_size)       # this machine's ranks, and the MINIDIST_*
        RuntimeConfig(plan.world_size)          # variables the launcher will read
    return Job(cfg, data_cfg, plan, resilience)


def nodes(a: argparse.Namespace, world_size: int) -> Nodes | None:
    """--ranks-per-node's emulated nodes (runtime/nodes.py), checked, or None."""
    if getattr(a, "ranks_per_node", None) is None:
        return None
    if mpi_rank() is not None:
        raise OptionError("--ranks-per-node emulates nodes on one machine; under mpiexec the "
                          "nodes are real. Drop --ranks-per-node")
    if getattr(a, "dry_run", False):
        raise OptionError("--ranks-per-node emulates a slower link between ranks, but a "
                          "--dry-run times no link; drop --ranks-per-node")
    if getattr(a, "elastic", False):
        raise OptionError("--elastic changes the number of ranks, which nodes of "
                          "--ranks-per-node would no longer tile; drop one of the two")
    if not (a.inter_latency_us >= 0 and a.inter_gbs > 0):
        raise OptionError(f"--inter-latency-us {a.inter_latency_us} must be >= 0 and "
                          f"--inter-gbs {a.inter_gbs} > 0")
    if world_size % a.ranks_per_node:
        fits = [k for k in range(1, world_size + 1) if world_size % k == 0]
        raise OptionError(f"--ranks-per-node {a.ranks_per_node} does not divide the layout's "
                          f"{world_size} ranks into nodes; use one of {fits}")
    return Nodes(a.ranks_per_node, a.inter_latency_us * 1e-6, 1.0 / (a.inter_gbs * 1e9))


def _fits_in_memory(a: argparse.Namespace, cfg: GPTConfig, T: int) -> None:
    """Sizes typed on the command line stay bounded: refuse, before anything is allocated,
    a job whose ranks together need more than this machine's memory. Counted is only what
    no layout avoids: the parameters with their gradients and Adam's two moments (4 N
    values, N of the dense model: MoE experts only add), and one micro-batch's activations
    at two values per token, width and layer (the input of every block) plus one layer's
    attention scores (rows x heads x T x T)."""
    item = 8 if cfg.dtype == "float64" else 4
    n = parameter_count(replace(cfg, moe_every=0))
    rows = max(1, a.batch // a.grad_accum)
    need = item * (4 * n + 2 * rows * T * cfg.n_embd * cfg.n_layer + rows * cfg.n_head * T * T)
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise OptionError(f"this model and batch need at least {need / 2**30:.1f} GiB "
                          f"(N = {n:,} parameters with gradients and Adam state, and one "
                          f"micro-batch of {rows} x T={T} tokens' activations), more than this "
                          f"machine's {have / 2**30:.1f} GiB; use a smaller --length, --batch, "
                          "--n-embd or --n-layer")


def _pieces(a: argparse.Namespace) -> int:
    """How many pieces the options cut the model into (one layer each at least)."""
    if isinstance(getattr(a, "schedule_value", None), PipelineSchedule):
        return a.schedule_value.n_virtual
    return pieces(a.schedule, a.pp, a.virtual_stages or 2)


def _chunks(a: argparse.Namespace) -> int:
    """Model chunks per pp rank of the options (Plan.chunks)."""
    if isinstance(getattr(a, "schedule_value", None), PipelineSchedule):
        return a.schedule_value.chunks
    return chunks_of(a.schedule, a.virtual_stages or 2)


def _world_size(a: argparse.Namespace) -> int:
    return a.dp * a.tp * a.cp * a.pp


def _batch_splits(a: argparse.Namespace) -> None:
    """--batch must split into --dp x --grad-accum equal micro-batches."""
    parts = a.dp * a.grad_accum
    if a.batch % parts == 0:
        return
    if getattr(a, "quiet", False):                    # inside _accepted: no fixes needed
        raise OptionError("--batch")
    low = a.batch - a.batch % parts
    fixes = [f"--batch {b}" for b in (low, low + parts) if b and _accepted(a, batch=b)]
    fixes += [f"--grad-accum {m}" for m in _divisors(a.batch // a.dp) if a.batch % a.dp == 0
              and abs(m - a.grad_accum) == min(abs(k - a.grad_accum)
                                              for k in _divisors(a.batch // a.dp))
              and _accepted(a, grad_accum=m)][:1]
    raise OptionError(f"--batch {a.batch} does not split over --dp {a.dp} x --grad-accum "
                      f"{a.grad_accum} = {parts} equal micro-batches"
                      + (f"; use {' or '.join(fixes)}" if fixes else
                         f" (--batch must be a multiple of {parts})"))


def _positions_split(a: argparse.Namespace, T: int) -> None:
    """Context parallelism cuts each sequence into 2 cp (zig-zag) or cp chunks, sequence
    parallelism each rank's positions over tp: T must divide."""
    cut = (2 * a.cp if a.cp_layout == "zigzag" else a.cp) if a.cp > 1 else 1
    pieces = math.lcm(cut, a.cp * a.tp) if a.sp else cut
    if T % pieces == 0:
        return
    if getattr(a, "quiet", False):
        raise OptionError("positions")
    what = f"--cp {a.cp} ({a.cp_layout}) cuts them into {cut} chunks" if a.cp > 1 else ""
    if a.sp:
        what += (" and " if what else "") + f"--sp splits each rank's over --tp {a.tp}"
    fixes = []
    if a.task != "add":
        fixes = [f"--length {n}" for n in range(a.length + 1, a.length + 4 * pieces + 1)
                 if _accepted(a, length=n)][:1]
    if a.cp > 1 and a.cp_layout == "zigzag" and _accepted(a, cp_layout="contiguous"):
        fixes.append("--cp-layout contiguous")
    if a.sp and _accepted(a, sp=False):
        fixes.append("no --sp")
    fixes += [f"--cp {c}" for c in range(a.cp - 1, 0, -1) if _accepted(a, cp=c)][:1]
    task = f"--task {a.task} --length {a.length}" if a.task != "add" else "--task add"
    raise OptionError(f"{task} makes sequences of T={T} positions; {what}, which needs T "
                      f"to be a multiple of {pieces}"
                      + (f"; use {' or '.join(fixes)}" if fixes else ""))


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order (sqrt(n) steps: n is a typed --batch)."""
    low = [m for m in range(1, math.isqrt(n) + 1) if n % m == 0]
    return low + [n // m for m in reversed(low) if m * m != n]


def _accepted(a: argparse.Namespace, **changes) -> bool:
    """Would the options with `changes` make a job? (A fix is printed only if so.)"""
    b = argparse.Namespace(**{**vars(a), **changes, "quiet": True})
    try:
        _validated(b)
    except ValueError:
        return False
    return True
