"""`python -m minidist train`: the main job's command line around train.py's train_on_rank.

main() parses the options (baseline's, and the layout's: --dp, --tp, --cp, --pp, --ep,
--zero, --schedule, ...; reliability's --checkpoint-dir, --inject, --spike, --straggler;
memory's --recompute, --precision, --offload, --device-memory; --deterministic (--grain,
--token-tiles); the run directory's --run-dir, --trace-steps), builds the job (GPTConfig,
DataConfig, Plan), runs a single process (baseline.py's ground truth, _single_process) when
nothing asks for more,
and otherwise spawns the ranks through reliability/recovery.py (restarts, elastic), each
running _rank_main: train_on_rank with its checkpoints, faults, straggler handling and
run-directory observer, rank 0 printing the progress line of observe/progress.py. At the
end: held-out samples,
`params sha256: <hex>`, the run directory, and with --check the verdict against the
single process (bitwise under --deterministic). --dry-run hands the options to
train_dry_run.py instead: one rank of a job of any --world, run in this process, its memory
and traffic counted.
Read next: train.py (train_on_rank), reliability/recovery.py, observe/progress.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from minidist import backend, baseline, collectives as C, train_check, train_dry_run
from minidist import train_options
from minidist.cli import CliParser, at_least, cli_error, directory
from minidist.data import DataConfig, SyntheticData, answer_accuracy
from minidist.deterministic.digest import params_digest
from minidist.memory.fp8_recipes import RECIPES
from minidist.memory.ledger import parse_bytes
from minidist.nn import GPT, GPTConfig
from minidist.observe import run_dir
from minidist.observe.peak import peak_flops
from minidist.observe.progress import Progress
from minidist.parallel.compose import Plan
from minidist.parallel.pipeline.family import SCHEDULES
from minidist.reliability import recovery, straggler as stragglers
from minidist.reliability.checkpoint import CheckpointError, CheckpointStorageError
from minidist.runtime import RankFailure
from minidist.train import (OnStep, OnStepEnd, OptimizerConfig, RankResult, RunConfig,
                            StepEnd, train_on_rank)


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist train [--dp D] [--cp C] [--tp T [--sp]] [--zero K] [--check]`:
    train the tiny GPT on D x C x T ranks (one process each; all 1 and K = 0 is the
    single-process baseline), print progress and held-out samples; --check also trains the
    single-process baseline and compares the loss curves and final parameters.
    Returns the exit code: 0; 2 for options that make no job (one `error:` line on stderr,
    before any rank starts); 1 if a rank fails (the RankFailure, with that rank's
    traceback, on stderr) or --check finds a mismatch. --steps 0 trains nothing and shows
    no samples. A closed stdout (`| head`) raises BrokenPipeError and Ctrl-C
    KeyboardInterrupt, however the ranks saw it: __main__.py ends both quietly.
    --dry-run runs one rank of the job in this process instead (train_dry_run.py)."""
    ap = _arguments()
    a = ap.parse_args(argv)
    if a.dry_run:                                # --steps defaults to DRY_STEPS there
        ap.set_defaults(steps=train_dry_run.DRY_STEPS)
        return train_dry_run.main(ap.parse_args(argv))
    if (a.world, a.rank, a.transport) != (None, None, None):
        return cli_error("--world, --rank and --transport describe a --dry-run; add "
                         "--dry-run, or drop them")
    if train_options.mpi_rank() not in (None, 0) and not a.verbose:
        _stdout_to_devnull()                     # under mpiexec rank 0 prints the job's lines
    try:                                         # every rule, before any rank starts
        job = train_options.resolve(a)
    except ValueError as e:
        return cli_error(e)
    for note in job.notes:
        print(note)
    cfg, data_cfg, plan = job.cfg, job.data_cfg, job.plan
    a.nodes = train_options.nodes(a, plan.world_size)       # spawn's (recovery.run)
    if a.nodes is not None:
        print(f"nodes: {plan.world_size // a.nodes.ranks_per_node} of {a.nodes.ranks_per_node} "
              f"ranks; across them {a.inter_latency_us:g} us + n / {a.inter_gbs:g} GB/s "
              "(emulated), no shared memory")
    if plan.world_size == 1 and a.zero == 0 and not a.check and not job.resilience.active \
            and a.run_dir is None and a.device_memory is None and a.precision == "fp32" \
            and a.offload == "none":
        return _single_process(a, cfg, data_cfg)
    # the gradient sync's group shares memory unless it spans emulated nodes
    shared = a.nodes is None or a.nodes.count(plan.group_ranks(0)["grad"]) == 1
    layout = f"{plan.describe()}, ZeRO-{a.zero}" + (
        f", {plan.micro_batches} micro-batches" if plan.pp > 1 else "")
    print(f"task {a.task} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.dtype} · batch "
          f"{a.batch} on {layout} = {plan.world_size} ranks · {a.optimizer} lr {a.lr}\n"
          f"algorithms: {plan.algorithms(shared)}" + ("" if a.plain else " · --plain: the "
                                                       "textbook ones"), flush=True)
    if a.steps == 0:
        print(NOTHING_TRAINED)
        return 0
    a.peak_flops = peak_flops(cfg.dtype).flops   # one rank's, for MFU (measured once, cached)
    try:
        a.run_path = run_dir.for_cli(a, ["python", "-m", "minidist", "train",
                                         *(sys.argv[1:] if argv is None else argv)],
                                     cfg, data_cfg, plan)      # observe/run_dir.py
    except ValueError as e:
        return cli_error(e)
    try:
        run = recovery.run(a, cfg, data_cfg, plan, job.resilience, _rank_main)
    except RankFailure as e:
        return _rank_failed(e)
    except (ValueError, CheckpointError) as e:   # another run's, or no intact checkpoint
        return cli_error(e)
    finally:                                     # a failed run's directory is kept too
        if a.run_path is not None:
            run_dir.finish(a.run_path)
    show_samples(cfg, data_cfg, run.params)
    print(f"params sha256: {params_digest(run.params)}")
    if a.run_path is not None:
        print(f"run directory: {a.run_path} (python -m minidist report {a.run_path})")
    return train_check.check(a, cfg, data_cfg, run, layout, plan) if a.check else 0


def train_arguments(prog: str) -> argparse.ArgumentParser:
    """The model's, the task's and the run's options (_arguments adds the layout's). A
    default of None is filled in by train_options.resolve from the other options."""
    ap = CliParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                   description="Train the tiny GPT and show it solving held-out prompts.")
    ap.add_argument("--task", default="sort", choices=["copy", "reverse", "sort", "add"],
                    help="the synthetic task (minidist/data.py)")
    ap.add_argument("--length", type=at_least(1), default=6,
                    help="prompt length (copy/reverse/sort; add has 2 numbers)")
    ap.add_argument("--steps", type=at_least(0), default=300,
                    help="optimizer steps (0 trains nothing and shows no samples; "
                         f"--dry-run's default is {train_dry_run.DRY_STEPS})")
    ap.add_argument("--batch", type=at_least(1), default=32, help="global batch (sequences)")
    ap.add_argument("--grad-accum", type=at_least(1), default=None,
                    help="micro-batches per step (None: 1; under --pp a divisor of the rows "
                         "per dp rank near 2 x pp)")
    ap.add_argument("--lr", type=at_least(0.0, float), default=3e-3, help="learning rate")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="optimizer")
    ap.add_argument("--n-layer", type=at_least(1), default=None,
                    help="transformer blocks (None: 2, or one per pipeline piece)")
    ap.add_argument("--n-embd", type=at_least(1), default=32, help="embedding width C")
    ap.add_argument("--n-head", type=at_least(1), default=4, help="attention heads")
    ap.add_argument("--moe-every", type=at_least(0), default=0,
                    help="every k-th block a MoE (0: none)")
    ap.add_argument("--n-experts", type=at_least(1), default=4, help="experts per MoE block")
    ap.add_argument("--top-k", type=at_least(1), default=1, help="experts per token (MoE)")
    ap.add_argument("--capacity-factor", type=at_least(0.0, float), default=1.25,
                    help="an expert's slots per routing group: factor x k x tokens / experts "
                         "(0: dropless, no token dropped)")
    ap.add_argument("--moe-group-size", type=at_least(0), default=None,
                    help="tokens per MoE routing group (None or 0: one sequence; under --cp "
                         "one cp chunk)")
    ap.add_argument("--z-loss", type=at_least(0.0, float), default=0.0,
                    help="router z-loss coefficient")
    ap.add_argument("--router", default="softmax", choices=["softmax", "sigmoid",
                                                            "expert-choice"],
                    help="MoE routing (nn/routing.py): softmax top-k, sigmoid top-k with the "
                         "gates normalised over the k (DeepSeek-V3), or expert choice (each "
                         "expert takes its top tokens)")
    ap.add_argument("--balance", default="aux", choices=["aux", "bias"],
                    help="MoE load balancing: the auxiliary loss (--aux-loss), or bias: "
                         "aux-loss-free, a routing bias moved by --bias-rate after each step "
                         "from the global batch's load (with a small sequence-wise aux loss)")
    ap.add_argument("--bias-rate", type=at_least(0.0, float), default=None,
                    help="gamma of --balance bias: each step's bias move (None: 0.001)")
    ap.add_argument("--aux-loss", type=at_least(0.0, float), default=None,
                    help="load-balancing loss coefficient (None: 0.01; 0.0001 under "
                         "--balance bias, DeepSeek-V3's sequence-wise alpha)")
    ap.add_argument("--shared-experts", type=at_least(0), default=0,
                    help="always-on experts beside the routed ones (DeepSeekMoE)")
    ap.add_argument("--expert-hidden", type=at_least(0), default=0,
                    help="each expert's hidden width (0: 4 x n_embd; smaller for "
                         "fine-grained experts)")
    ap.add_argument("--route-groups", type=at_least(1), default=1,
                    help="experts in this many equal groups (group-limited routing)")
    ap.add_argument("--route-limit", type=at_least(0), default=0,
                    help="a token's experts in at most this many of --route-groups "
                         "(DeepSeek-V3's node-limited routing; 0: no limit)")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                    help="activation recomputation: selective = the attention core, full = "
                         "every block (memory/recompute.py; the same numbers, less memory)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float64"],
                    help="the model's dtype (None: float32, float64 under --check)")
    ap.add_argument("--deterministic", action="store_true",
                    help="bitwise the same parameters and losses under every layout and "
                         "micro-batch count: one sample per micro-batch, summed in a fixed "
                         "tree (minidist/deterministic/tree_sum.py)")
    ap.add_argument("--grain", type=at_least(1), default=1,
                    help="--deterministic: samples per leaf of the tree; larger is faster, "
                         "and runs compare bitwise only at the same grain")
    ap.add_argument("--token-tiles", type=at_least(1), default=None,
                    help="--deterministic: every sum over positions in a tree over this "
                         "many runs per sequence (None: one token per leaf; under --cp the "
                         "fewest runs each rank holds whole); runs compare bitwise only at "
                         "the same value")
    ap.add_argument("--device", type=_device, default=os.environ.get(backend.DEVICE_ENV, ""),
                    help="cpu (NumPy) or gpu (CuPy; needs the 'gpu' extra and a CUDA "
                         f"device); default ${backend.DEVICE_ENV}, else cpu")
    ap.add_argument("--seed", type=at_least(0), default=0, help="the model's and the data's seed")
    ap.add_argument("--every", type=at_least(1), default=25, help="print every N steps")
    ap.add_argument("--verbose", action="store_true",
                    help="under mpiexec, every rank prints the job's lines (default: rank 0)")
    return ap


def _device(text: str) -> str:
    """--device (and its default, $MINIDIST_DEVICE): 'cpu' or 'gpu' (backend.parse_device)."""
    try:
        return backend.parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def show_samples(cfg: GPTConfig, data_cfg: DataConfig, params: dict[str, np.ndarray]) -> float:
    """Print a few held-out prompts with the trained model's answers; return the accuracy."""
    model = GPT(cfg, seed=None)
    model.load_state_dict(params)
    acc, lines = answer_accuracy(model, SyntheticData(data_cfg))
    print("held-out samples (prompt | model's answer):")
    for line in lines[:6]:
        print("  " + line)
    print(f"exact-match accuracy on 64 held-out prompts: {acc:.0%}")
    return acc


def _single_process(a: argparse.Namespace, cfg: GPTConfig, data_cfg: DataConfig) -> int:
    """The main job on one process: baseline.train_single_process, the ground truth, with
    the progress line and the held-out samples. Returns the exit code: 2 (one `error:`
    line on stderr) if there is no GPU for --device gpu.
    --steps 0 trains nothing: it says so and shows no samples (an untrained model's answers
    are noise, not a result)."""
    try:
        backend.use_device(getattr(a, "device", "cpu"))     # one line if there is no GPU
    except ValueError as e:
        return cli_error(e)
    bar = Progress.for_model(cfg, a.batch, 1, a.steps, peak_flops=peak_flops(cfg.dtype).flops)
    t0 = last = time.perf_counter()

    def progress(step: int, loss: float, model: GPT) -> None:
        nonlocal last
        now = time.perf_counter()
        if step % a.every == 0 or step == a.steps - 1:     # no communication; memory: not
            print(bar.line(step, loss, now - t0, [[now - last, 0.0, 0.0]]),  # measured here
                  flush=True)              # a reader of a pipe (| head) sees each step now
        last = now

    print(f"task {a.task} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.dtype} · "
          f"batch {a.batch} · {a.optimizer} lr {a.lr}", flush=True)
    if a.steps == 0:
        print(NOTHING_TRAINED)
        return 0
    result = baseline.train_single_process(
        cfg, data_cfg, steps=a.steps, global_batch=a.batch, lr=a.lr, seed=a.seed,
        grad_accum=a.grad_accum, optimizer=a.optimizer, on_step=progress,
        deterministic=a.deterministic, grain=a.grain, token_tiles=a.token_tiles)
    print(bar.summary(time.perf_counter() - t0))
    show_samples(cfg, data_cfg, result.params)
    print(f"params sha256: {params_digest(result.params)}")
    return 0


NOTHING_TRAINED = "--steps 0: nothing to train, so no held-out samples to show."


def _arguments() -> argparse.ArgumentParser:
    """train_arguments and the layout's options."""
    ap = train_arguments("python -m minidist train")
    ap.add_argument("--dp", type=at_least(1), default=None,
                    help="data-parallel ranks (None: 1, or --ep)")
    ap.add_argument("--pp", type=at_least(1), default=1, help="pipeline stages (one rank each)")
    ap.add_argument("--expert-tp", type=at_least(1), default=1,
                    help="expert tensor parallelism: each expert's MLP split over this many "
                         "of the data-parallel ranks (MoE parallel folding; dp = edp x ep x "
                         "expert-tp)")
    ap.add_argument("--ep", type=at_least(1), default=1,
                    help="expert-parallel ranks: data-parallel ranks sharing the experts")
    ap.add_argument("--schedule", default="1f1b",
                    help=f"pipeline schedule: {', '.join(SCHEDULES)} (what each needs and "
                         "claims: parallel/pipeline/family.py), or a CSV file (one line per "
                         "stage, cells like 0F0,0F1,0B0; 0F4&1B1 an overlapped pair)")
    ap.add_argument("--virtual-stages", type=at_least(1), default=None,
                    help="model chunks per pp rank for --schedule interleaved (default 2)")
    ap.add_argument("--schedule-costs", type=_costs, default=None, metavar="F,B,W",
                    help="a stage's forward, input-gradient and weight-gradient costs (any "
                         "unit; e.g. from bench pipeline) that --schedule zb-1p, zb-2p or "
                         "zbv is searched for (default 1,1,1)")
    ap.add_argument("--layers-per-stage", type=_int_list, default=None,
                    help="layers of each (virtual) stage, comma-separated, e.g. 3,2")
    ap.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel ranks (Megatron)")
    ap.add_argument("--sp", action="store_true",
                    help="sequence parallelism over the tp ranks (needs --tp > 1)")
    ap.add_argument("--async-tp", action="store_true",
                    help="with --sp: SP's all-gather and reduce-scatter cut into steps hidden "
                         "behind the matmul chunks (parallel/tensor/async_tp.py)")
    ap.add_argument("--cp", type=at_least(1), default=1, help="context-parallel ranks (sequence)")
    ap.add_argument("--cp-algo", default="ring", choices=["ring", "ulysses"],
                    help="attention across the cp ranks")
    ap.add_argument("--cp-layout", default="zigzag", choices=["zigzag", "contiguous"],
                    help="which positions each cp rank holds")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    ap.add_argument("--local-steps", type=at_least(0), default=0, metavar="H",
                    help="DiLoCo: each dp replica trains alone for H steps, then an outer "
                         "Nesterov step on their mean progress (1/H of DDP's bytes; "
                         "parallel/data/diloco.py); 0: sum the gradients every step")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="--local-steps' outer lr")
    ap.add_argument("--outer-momentum", type=float, default=0.9,
                    help="--local-steps' outer Nesterov momentum")
    ap.add_argument("--onebit-adam", type=at_least(0), default=0, metavar="T",
                    help="1-bit Adam: T Adam steps on summed gradients, then the momentum "
                         "sent as signs + a scale with error feedback (parallel/data/"
                         "onebit_adam.py); 0: off")
    ap.add_argument("--powersgd", type=at_least(0), default=0, metavar="R",
                    help="PowerSGD: each gradient matrix summed as a rank-R factorisation "
                         "with error feedback (parallel/data/powersgd.py); 0: off")
    ap.add_argument("--hsdp", type=at_least(0), default=0, metavar="S",
                    help="hybrid sharding: ZeRO's state sharded over groups of S dp ranks "
                         "(inside a node) and replicated over --dp / S (across nodes); "
                         "0: over every dp rank")
    ap.add_argument("--zeropp", type=at_least(0), default=0, metavar="L",
                    help="ZeRO++ (with --zero 3): the dp ranks as nodes of L; int8 weight "
                         "gather (qwZ), the backward's gather inside the node (hpZ), int4 "
                         "two-hop gradient reduce-scatter (qgZ) (parallel/zero/zeropp.py); "
                         "0: off")
    ap.add_argument("--zeropp-parts", default="qwz,hpz,qgz", metavar="LIST",
                    help="which of ZeRO++'s collectives --zeropp uses: a comma list of qwz, "
                         "hpz, qgz (hpz alone changes no number)")
    ap.add_argument("--param-gather", default="model", choices=["model", "fp8"],
                    help="ZeRO-3's parameter all-gathers: in the model copy's dtype, or as "
                         "fp8 E4M3 codes with a power-of-two scale per 256 numbers (1 byte "
                         "a number; collectives/quantized.py)")
    ap.add_argument("--plain", action="store_true",
                    help="the textbook algorithms instead of the fast paths: DDP with one "
                         "all-reduce per parameter (parallel/data/ddp.py), ring reductions "
                         "(collectives/ring.py); the same results")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "fp8"],
                    help="mixed precision (memory/precision.py): the model copy and "
                         "activations in bf16 / fp16 / fp8 GEMMs, fp32 master weights")
    ap.add_argument("--fp8-recipe", default="delayed", choices=list(RECIPES),
                    help="under --precision fp8: delayed (per-tensor, amax history), "
                         "tensorwise, rowwise, blockwise (DeepSeek-V3's 1x128 / 128x128), "
                         "mxfp8 (32-element blocks, E8M0 scales) (memory/fp8_recipes.py)")
    ap.add_argument("--grad-reduce", default="fp32", choices=["fp32", "low"],
                    help="gradients stored and summed over dp in fp32 (4 bytes each) or "
                         "in the low-precision format (2 bytes)")
    ap.add_argument("--offload", default="none", choices=["none", "host", "disk"],
                    help="optimizer state (ZeRO-3: parameter shards too) off the device: in "
                         "host memory, or in memmap files read ahead of the update "
                         "(memory/offload.py)")
    ap.add_argument("--offload-dir", type=directory, default=None, metavar="D",
                    help="--offload disk: the run's files go under D (default: the OS temp "
                         "dir); directories of dead runs there are swept")
    ap.add_argument("--check", action="store_true",
                    help="also run the single-process baseline and compare")
    recovery.add_arguments(ap)
    ap.add_argument("--device-memory", type=_device_memory, default=None, metavar="SIZE",
                    help="per-rank device-memory budget, e.g. 64MB or 2GiB: every rank runs "
                         "under memory/ledger.py's Ledger and fails past it")
    run_dir.add_arguments(ap)
    ap.add_argument("--ranks-per-node", type=at_least(1), default=None, metavar="N",
                    help="emulate nodes of N ranks on this machine: messages between nodes "
                         "take --inter-latency-us + n / --inter-gbs, groups across nodes "
                         "share no memory (runtime/nodes.py); None: one node")
    ap.add_argument("--inter-latency-us", type=float, default=100.0,
                    help="with --ranks-per-node: the inter-node latency per message (us)")
    ap.add_argument("--inter-gbs", type=float, default=0.25,
                    help="with --ranks-per-node: the inter-node bandwidth per rank (GB/s)")
    ap.add_argument("--check-placements", action="store_true",
                    help="assert the placement of every activation crossing a parallel "
                         "boundary (also MINIDIST_CHECK_PLACEMENTS=1)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run one rank of the job in this process, on a transport that moves "
                         "no data (runtime/dry_run.py), and print its memory peak (the "
                         "ledger's) and its bytes and calls per axis: exact for that rank, "
                         "at any --world (train_dry_run.py)")
    ap.add_argument("--world", type=at_least(1), default=None, metavar="N",
                    help="--dry-run: the job's ranks. Without --dp, dp = N / (tp x cp x pp); "
                         "with it, dp x tp x cp x pp must be N (None: that product)")
    ap.add_argument("--rank", type=at_least(0), default=None, metavar="R",
                    help="--dry-run: the rank that runs (None: 0)")
    ap.add_argument("--transport", default=None, choices=["shm", "mpi"],
                    help="--dry-run: the algorithms of the shared-memory runtime (shm: direct "
                         "reductions, DDP's buckets; None: shm) or of runtime/mpi.py (mpi: "
                         "across machines, no shared memory)")
    return ap


def _device_memory(text: str) -> int:
    """--device-memory: "64MB" -> 64000000 (memory/ledger.py's parse_bytes)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list(text: str) -> tuple[int, ...]:
    """--layers-per-stage: "3,2" -> (3, 2)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "layer counts, e.g. 3,2") from None


def _costs(text: str) -> tuple[float, float, float]:
    """--schedule-costs: "1.3,1.1,0.8" -> (1.3, 1.1, 0.8)."""
    try:
        costs = tuple(float(v) for v in text.split(","))
    except ValueError:
        costs = ()
    if len(costs) != 3 or not all(0 < c < float("inf") for c in costs):
        raise argparse.ArgumentTypeError(f"{text!r} is not three positive costs F,B,W, e.g. "
                                         "1.3,1.1,0.8")
    return costs


def _rank_main(ctx, a, cfg: GPTConfig, data_cfg: DataConfig, plan: Plan, t0: float,
               job: tuple) -> RankResult:
    """What every rank of `train` runs: train_on_rank from the checkpoint (if any), with
    its faults and checkpoints; rank 0 prints the progress (all ranks take part in
    on_step's all-reduce)."""
    straggler = stragglers.for_rank(ctx, a, plan, cfg)
    resume, saver = recovery.on_rank(ctx, a, plan, job, {"straggler": straggler})
    bar = Progress.for_model(cfg, a.batch, plan.world_size, a.steps, resume["start_step"],
                             getattr(a, "peak_flops", 0.0))
    losses: dict[int, float] = {}

    def printed(step: int) -> bool:
        return step % a.every == 0 or step == a.steps - 1

    def progress(end: StepEnd) -> None:
        """COLLECTIVE at printed steps: every rank's [step s, comm wait s, memory bytes]."""
        if printed(end.step):
            mine = np.array([end.seconds[0], end.seconds[1], end.memory], np.float64)
            table = C.all_gather(mine, group=ctx.world)                  # (W, 3)
            if ctx.rank == 0:
                say(bar.line(end.step, losses.pop(end.step), time.perf_counter() - t0, table))
        if saver is not None:
            saver.on_step_end(end)

    def say(text: str) -> None:
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError:              # the reader left (| head): fail this rank, but
            _stdout_to_devnull()             # quietly, so its last flush at exit succeeds
            raise

    path = getattr(a, "run_path", None)          # main()'s run directory, if any
    observer = None if path is None else run_dir.RankObserver(path, ctx.rank, a.trace_steps,
                                                              ctx.world.group_names)
    run = RunConfig(steps=resume["steps"], global_batch=a.batch, seed=a.seed,
                    start_step=resume["start_step"], total_steps=resume["total_steps"],
                    data_offset=resume["data_offset"],
                    device_memory=getattr(a, "device_memory", None),
                    deterministic=getattr(a, "deterministic", False),
                    grain=getattr(a, "grain", 1), token_tiles=getattr(a, "token_tiles", None))
    remember = OnStep(lambda step, loss: losses.update({step: loss}) if printed(step) else None)
    result = train_on_rank(ctx, cfg, data_cfg, plan, run,
                           OptimizerConfig(lr=a.lr, name=a.optimizer),
                           [remember, observer, resume["injector"], OnStepEnd(progress)],
                           straggler=straggler, guard=resume["guard"],
                           initial_state=resume["initial_state"])
    if saver is not None:
        saver.close()
    if observer is not None:
        observer.close()
    if ctx.rank == 0 and bar.samples:
        say(bar.summary(time.perf_counter() - t0))
    return result


def _stdout_to_devnull() -> None:
    """Point this process's stdout at /dev/null (what is still buffered goes there)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def _rank_failed(e) -> int:
    """A RankFailure from spawn: exit code 1 with its text (the failing rank's traceback
    included) on stderr. A rank that failed on a closed stdout or on Ctrl-C re-raises
    that, for __main__.py to end quietly."""
    first = e.failures.get(e.rank, "")
    if first.startswith("BrokenPipeError"):
        raise BrokenPipeError(f"rank {e.rank}: stdout was closed") from None
    if first.startswith("KeyboardInterrupt"):
        raise KeyboardInterrupt from None
    if first.startswith(CheckpointError.__name__) or \
            first.startswith(CheckpointStorageError.__name__):   # it says it all: one line
        print(f"error: {' '.join(first.split(chr(10))[0].split())}", file=sys.stderr)
        return 1
    print(f"minidist train: {e}", file=sys.stderr)
    return 1
