"""`python -m minidist train`: the main job's command line around train.py's train_on_rank.

main() parses the options (baseline's, and the layout's: --dp, --tp, --cp, --pp, --ep,
--zero, --schedule, ...; reliability's --checkpoint-dir, --inject, --spike, --straggler;
memory's --recompute, --precision, --offload, --device-memory; --deterministic (--grain,
--token-tiles); the run directory's --run-dir, --trace-steps), builds the job (GPTConfig,
DataConfig, Plan), runs a single process through baseline.run when nothing asks for more,
and otherwise spawns the ranks through reliability/recovery.py (restarts, elastic), each
running _rank_main: train_on_rank with its checkpoints, faults, straggler handling and
run-directory observer, rank 0 printing the progress line of observe/progress.py. At the
end: held-out samples,
`params sha256: <hex>`, the run directory, and with --check the verdict against the
single process (bitwise under --deterministic).
Read next: train.py (train_on_rank), reliability/recovery.py, observe/progress.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from minidist import collectives as C
from minidist import baseline
from minidist.data import DataConfig
from minidist.nn import GPTConfig
from minidist.observe import run_dir
from minidist.observe.peak import peak_flops
from minidist.observe.progress import Progress
from minidist.parallel.compose import Plan
from minidist.reliability import confined, recovery, straggler as stragglers
from minidist.reliability.checkpoint import CheckpointError, CheckpointStorageError
from minidist.train import RankResult, StepEnd, train_on_rank


def main(argv: list[str] | None = None) -> int:
    """`python -m minidist train [--dp D] [--cp C] [--tp T [--sp]] [--zero K] [--check]`:
    train the tiny GPT on D x C x T ranks (one process each; all 1 and K = 0 is the
    single-process baseline), print progress and held-out samples; --check also trains the
    single-process baseline and compares the loss curves and final parameters.
    Returns the exit code: 0; 2 for options that make no job (one `error:` line on stderr,
    before any rank starts); 1 if a rank fails (the RankFailure, with that rank's
    traceback, on stderr) or --check finds a mismatch. --steps 0 trains nothing and shows
    no samples. A closed stdout (`| head`) raises BrokenPipeError and Ctrl-C
    KeyboardInterrupt, however the ranks saw it: __main__.py ends both quietly."""
    a = _arguments().parse_args(argv)
    if a.ep > 1 and a.dp == 1:
        a.dp = a.ep                              # the ep ranks are data-parallel ranks
    if a.pp > 1 and a.grad_accum == 1:
        a.grad_accum = 2 * a.pp                  # micro-batches to fill the pipeline
    try:                                         # a bad plan fails here, before spawning
        resilience = recovery.options(a, a.dp * a.tp * a.cp * a.pp, a.pp)
        if a.dp == a.tp == a.cp == a.pp == 1 and a.zero == 0 and not a.check \
                and not resilience.active and a.run_dir is None \
                and a.device_memory is None and a.precision == "fp32" \
                and a.offload == "none":
            return baseline.run(a)
        if a.device == "gpu":                    # backend.py: not staged for ranks yet
            raise ValueError(baseline.backend.MULTI_RANK_GPU)
        cfg, data_cfg, plan = _job(a)
    except ValueError as e:
        return baseline.cli_error(e)
    layout = f"{plan.describe()}, ZeRO-{a.zero}" + (
        f", {plan.micro_batches} micro-batches" if plan.pp > 1 else "")
    print(f"task {a.task} · GPT {cfg.n_layer} layers, C={cfg.n_embd}, {cfg.dtype} · batch "
          f"{a.batch} on {layout} = {plan.world_size} ranks · {a.optimizer} lr {a.lr}",
          flush=True)
    if a.steps == 0:
        print(baseline.NOTHING_TRAINED)
        return 0
    a.peak_flops = peak_flops(cfg.dtype).flops   # one rank's, for MFU (measured once, cached)
    from minidist.runtime import RankFailure
    a.run_path = run_dir.for_cli(a, ["python", "-m", "minidist", "train",
                                     *(sys.argv[1:] if argv is None else argv)],
                                 cfg, data_cfg, plan)          # observe/run_dir.py
    try:
        run = recovery.run(a, cfg, data_cfg, plan, resilience, _rank_main)
    except RankFailure as e:
        return _rank_failed(e)
    except (ValueError, CheckpointError) as e:   # another run's, or no intact checkpoint
        return baseline.cli_error(e)
    finally:                                     # a failed run's directory is kept too
        if a.run_path is not None:
            run_dir.finish(a.run_path)
    baseline.show_samples(cfg, data_cfg, run.params)
    print(f"params sha256: {baseline.params_digest(run.params)}")
    if a.run_path is not None:
        print(f"run directory: {a.run_path} (python -m minidist report {a.run_path})")
    return _check(a, cfg, data_cfg, run, layout) if a.check else 0


def _arguments() -> argparse.ArgumentParser:
    """baseline's options and the parallel ones."""
    ap = baseline.train_arguments("python -m minidist train")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (one rank each)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel ranks: data-parallel ranks sharing the experts "
                         "(--dp defaults to --ep)")
    ap.add_argument("--schedule", default="1f1b",
                    help="pipeline schedule: gpipe, 1f1b, interleaved, zb-h1, or a CSV file "
                         "(one line per stage, cells like 0F0,0F1,0B0)")
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="model chunks per pp rank for --schedule interleaved (default 2)")
    ap.add_argument("--layers-per-stage", type=_int_list, default=None,
                    help="layers of each (virtual) stage, comma-separated, e.g. 3,2")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Megatron)")
    ap.add_argument("--sp", action="store_true",
                    help="sequence parallelism over the tp ranks (needs --tp > 1)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (sequence)")
    ap.add_argument("--cp-algo", default="ring", choices=["ring", "ulysses"],
                    help="attention across the cp ranks")
    ap.add_argument("--cp-layout", default="zigzag", choices=["zigzag", "contiguous"],
                    help="which positions each cp rank holds")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "fp8"],
                    help="mixed precision (memory/precision.py): the model copy and "
                         "activations in bf16 / fp16 / fp8 GEMMs, fp32 master weights")
    ap.add_argument("--grad-reduce", default="fp32", choices=["fp32", "low"],
                    help="gradients stored and summed over dp in fp32 (4 bytes each) or "
                         "in the low-precision format (2 bytes)")
    ap.add_argument("--offload", default="none", choices=["none", "host", "disk"],
                    help="optimizer state (ZeRO-3: parameter shards too) off the device: in "
                         "host memory, or in memmap files read ahead of the update "
                         "(memory/offload.py)")
    ap.add_argument("--offload-dir", default=None, metavar="D",
                    help="--offload disk: the run's files go under D (default: the OS temp "
                         "dir); directories of dead runs there are swept")
    ap.add_argument("--check", action="store_true",
                    help="also run the single-process baseline and compare")
    recovery.add_arguments(ap)
    ap.add_argument("--device-memory", type=_device_memory, default=None, metavar="SIZE",
                    help="per-rank device-memory budget, e.g. 64MB or 2GiB: every rank runs "
                         "under memory/ledger.py's Ledger and fails past it")
    run_dir.add_arguments(ap)
    ap.add_argument("--check-placements", action="store_true",
                    help="assert the placement of every activation crossing a parallel "
                         "boundary (also MINIDIST_CHECK_PLACEMENTS=1)")
    return ap


def _device_memory(text: str) -> int:
    """--device-memory: "64MB" -> 64000000 (memory/ledger.py's parse_bytes)."""
    from minidist.memory.ledger import parse_bytes
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


def _job(a) -> tuple[GPTConfig, DataConfig, Plan]:
    """The model, the task and the validated Plan of the options (notes on stdout where an
    option is changed); ValueError if they make no job."""
    if a.check and a.precision != "fp32":
        raise ValueError(f"--check compares with the float64 baseline; --precision "
                         f"{a.precision} rounds on purpose. Drop one of the two.")
    if a.check and a.dtype != "float64":
        print("--check trains in float64: in float32 the layouts' different rounding grows "
              "over hundreds of Adam steps, so only float64 can show they compute the same.")
        a.dtype = "float64"
    chunks = a.virtual_stages or (2 if a.schedule == "interleaved" else 1)
    if a.pp > 1 and a.layers_per_stage is None and a.n_layer < a.pp * chunks:
        print(f"note: n_layer {a.n_layer} -> {a.pp * chunks}, so that each of the pp x "
              f"virtual stages = {a.pp * chunks} pieces of the model holds a layer")
        a.n_layer = a.pp * chunks
    cfg, data_cfg = baseline.configs_from(a)
    if cfg.recompute == "selective" and a.cp > 1:
        raise ValueError("--recompute selective recomputes the attention core of one rank; "
                         f"with --cp {a.cp} ring attention already rebuilds its probabilities "
                         "block by block and Ulysses is not wrapped: use --recompute full.")
    plan = Plan(dp=a.dp, tp=a.tp, cp=a.cp, pp=a.pp, ep=a.ep, zero=a.zero,
                micro_batches=a.grad_accum, sequence_parallel=a.sp, cp_algo=a.cp_algo,
                cp_layout=a.cp_layout, check_placements=a.check_placements or None,
                schedule=_schedule_argument(a.schedule), virtual_stages=a.virtual_stages,
                layers_per_stage=a.layers_per_stage, precision=a.precision,
                grad_reduce=a.grad_reduce, offload=a.offload, offload_dir=a.offload_dir)
    plan.validate(cfg, a.batch, data_cfg.block_size)
    return cfg, data_cfg, plan


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

    resume["on_step_end"] = progress
    path = getattr(a, "run_path", None)          # main()'s run directory, if any
    observer = None if path is None else run_dir.RankObserver(path, ctx.rank, a.trace_steps,
                                                              ctx.world.group_names)
    result = train_on_rank(ctx, cfg, data_cfg, plan, global_batch=a.batch, lr=a.lr,
                           seed=a.seed, optimizer=a.optimizer,
                           on_step=lambda step, loss: losses.update({step: loss})
                           if printed(step) else None,
                           straggler=straggler, observer=observer,
                           device_memory=getattr(a, "device_memory", None),
                           deterministic=getattr(a, "deterministic", False),
                           grain=getattr(a, "grain", 1),
                           token_tiles=getattr(a, "token_tiles", None), **resume)
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


def _check(a, cfg: GPTConfig, data_cfg: DataConfig, run: RankResult, layout: str) -> int:
    """--check: train the single-process baseline, print the verdict; the exit code."""
    ref = baseline.train_single_process(cfg, data_cfg, steps=a.steps, global_batch=a.batch,
                                        lr=a.lr, seed=a.seed, grad_accum=a.grad_accum,
                                        optimizer=a.optimizer,
                                        deterministic=getattr(a, "deterministic", False),
                                        grain=getattr(a, "grain", 1),
                                        token_tiles=getattr(a, "token_tiles", None))
    if getattr(a, "deterministic", False):       # the same bits, or a mismatch
        same = run.losses == ref.losses and all(np.array_equal(run.params[k], v)
                                                for k, v in ref.params.items())
        print(f"{'OK' if same else 'MISMATCH'}: {layout} training "
              f"{'equals' if same else 'differs from'} the deterministic single-process run "
              f"bit for bit ({cfg.dtype}; every loss and parameter compared with ==)")
        return 0 if same else 1
    d_loss = max((abs(x - y) for x, y in zip(run.losses, ref.losses)), default=0.0)
    d_param = max(float(np.max(np.abs(run.params[k] - v))) for k, v in ref.params.items())
    d_first = abs(run.losses[0] - ref.losses[0]) if ref.losses else 0.0
    # The layouts add the same numbers in a different order (partial sums over ranks,
    # then their sum), a ~1e-16 difference per step that Adam's 1/sqrt(v) amplifies over
    # many steps; hence a tight bound on the first step and a looser one over the run.
    ok = d_first <= 1e-12 and max(d_loss, d_param) <= 1e-6
    print(f"{'OK' if ok else 'MISMATCH'}: {layout} training "
          f"{'matches' if ok else 'differs from'} the single-process run (float64; |Δ| loss "
          f"at step 0 = {d_first:.1e}, max over {a.steps} steps = {d_loss:.1e}, final params "
          f"max |Δ| = {d_param:.1e})")
    return 0 if ok else 1


def _schedule_argument(value: str):
    """--schedule: a schedule name, or the path of a CSV schedule (schedule_csv.py)."""
    from minidist.parallel.schedule_csv import from_csv
    from minidist.parallel.schedules import SCHEDULES
    if value in SCHEDULES:
        return value
    try:
        text = confined.read_named(value, 16 << 20).decode()
    except confined.Refused as e:
        raise ValueError(f"--schedule: {e}") from None
    except OSError:
        raise ValueError(f"--schedule {value!r} is neither one of {SCHEDULES} nor a readable "
                         "CSV file.") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--schedule {value}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None
    return from_csv(text, name=value)
